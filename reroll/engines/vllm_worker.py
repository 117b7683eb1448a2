"""Methods that vLLM mixes into each of its workers (`worker_extension_cls`), called by the
engine through `collective_rpc`. Imported inside vLLM's worker processes only."""

from __future__ import annotations


class RerollWorkerExtension:
    def reroll_load_weights(self, path: str) -> str:
        """Load the HF-named weights in the safetensors file at `path` and return their
        fingerprint as this worker received them.

        `reload_weights` (not `model.load_weights`) re-runs vLLM's post-load processing, which the
        CPU backend needs: it repacks linear weights into its own kernel layout.
        """
        from safetensors.torch import load_file

        from reroll.engines.base import fingerprint

        weights = load_file(path)
        self.reload_weights(weights_iterator=iter(list(weights.items())), is_checkpoint_format=True)
        return fingerprint(weights.items())
