"""The vLLM engine: vLLM's async engine (AsyncLLM) behind reroll's Engine contract.

vLLM runs its engine core in child processes and binds its output handler to the asyncio loop
it first sees. reroll's rollouts open a fresh loop per call (`asyncio.run`), so the AsyncLLM
lives on a private loop in a background thread and `generate` hands requests over to it; any
caller's loop can await them.

Weights reach the engine as a safetensors file in shared memory, loaded by the worker extension
(reroll/engines/vllm_worker.py) through vLLM's `reload_weights` (which re-applies the CPU
backend's weight repacking, unlike `model.load_weights`). On a GPU cluster the same code runs
with the official `vllm` package.

Image prompts (of the architectures in IMAGE_ARCHITECTURES) go as the images and the prompt ids
with each image's tokens folded back to its placeholder: vLLM runs the processor itself.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from reroll import settings
from reroll.engines.base import (
    AdapterSyncError,
    Completion,
    EngineStats,
    LoadMeter,
    Request,
    fingerprint,
)
from reroll.engines.loop import BackgroundLoop
from reroll.models.logprobs import config_placeholder_ids

IMAGE_ARCHITECTURES = ("Idefics3ForConditionalGeneration",)
"""The vision-language architectures whose image prompts vLLM is given: those its logprobs were
checked against the trainer's on (docs/vlm.md). Others are refused rather than trusted."""

# Environment vLLM reads at import time; set here and nowhere else. Values the user already
# exported win. VLLM_CPU_KVCACHE_SPACE is set per engine from its settings (see _environment).
_DEFAULT_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # pinning cores fights the other processes on a laptop
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class VLLMOptions:
    """How the vLLM engine is built (a `rollout.engine` section of type `vllm` maps onto this)."""

    dtype: str = "float32"
    max_model_len: int | None = None
    """Longest prompt + response; None: the model's max_position_embeddings."""
    max_num_seqs: int = 256
    kv_cache_gib: float = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE); small, tests share one machine."""
    gpu_memory_utilization: float = 0.5
    """GPU only: share of device memory vLLM may take (the rest is the trainer's when colocated)."""
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    seed: int = 0
    max_lora_rank: int = 0
    """>0: vLLM's LoRA support on, for adapters up to this rank (a LoRA run's adapter-only sync,
    `model.lora.sync`); rounded up to a rank vLLM accepts."""


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


def _environment(options: VLLMOptions) -> None:
    settings.defaults(_DEFAULT_ENV)
    if not torch.cuda.is_available():
        settings.defaults({"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(options.kv_cache_gib)))})


class VLLMEngine:
    """Engine over vLLM's AsyncLLM for the HF model at `model_path`."""

    def __init__(self, model_path: str, options: VLLMOptions = VLLMOptions()):
        _environment(options)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_path = model_path
        self.options = options
        self.version = 0
        self.meter = LoadMeter()
        self._fingerprint: str | None = None
        self._lora = None
        """The LoRARequest of the adapter every request decodes with (None: the weights alone)."""
        self._loaded_in_full = False
        self._aborted: set[str] = set()
        self._latest: dict[str, object] = {}
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self._weights_dir = Path(tempfile.mkdtemp(prefix="reroll-vllm-", dir=_shared_memory()))
        self._vision = _VisionPrompts(model_path)
        args = AsyncEngineArgs(
            model=model_path, dtype=options.dtype, seed=options.seed,
            max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
            enforce_eager=options.enforce_eager, enable_prefix_caching=options.enable_prefix_caching,
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            enable_sleep_mode=self.sleep_supported,
            # Logprobs at the sampling temperature (reroll's behaviour logprobs), not of the raw logits.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="reroll.engines.vllm_worker.RerollWorkerExtension",
            disable_log_stats=True,
            **_lora_args(options.max_lora_rank),
        )
        self._loop = BackgroundLoop("reroll-vllm")
        try:
            self.llm = self._loop.run(_build(AsyncLLM, args))
        except BaseException:
            self._loop.close()
            raise

    # -- Engine protocol -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        # A run refuses what this engine cannot take at start (pipelines.validation); this
        # guards direct callers: dropping the images would sample from the text alone, silently.
        if request.model_inputs:
            self._vision.check(request)
        try:
            return await self._loop.wait(self._generate(request))
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request between decoding steps; its `generate` returns the tokens so far."""
        self._loop.call_soon(self._aborted.add, request_id)
        asyncio.run_coroutine_threadsafe(self.llm.abort(request_id), self._loop.loop)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        path = self._weights_dir / "weights.safetensors"
        save_file(_unshared(named_tensors), str(path))
        try:
            digests = self._loop.run(self.llm.collective_rpc("reroll_load_weights", args=(str(path),)))
        finally:
            path.unlink(missing_ok=True)
        if len(set(digests)) != 1:
            raise RuntimeError(f"vLLM workers disagree on the loaded weights: {digests}")
        self._loop.run(_forget_cached(self.llm))
        self._fingerprint, self.version = digests[0], version
        self._loaded_in_full = True
        self._drop_adapter()  # the weights are merged ones now: no adapter on top of them

    @property
    def takes_adapters(self) -> bool:
        return self.options.max_lora_rank > 0

    def load_adapter(self, adapter: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A LoRA adapter (`LoRAAdapter.adapter_tensors`) registered with vLLM's LoRA support as
        version `version` (a LoRARequest of its own); the requests that start after it decode
        with it, and the previous version is removed. Refused (AdapterSyncError, nothing
        changed) without LoRA support, after full weights replaced the base, or when vLLM
        cannot load it."""
        from vllm.lora.request import LoRARequest

        from reroll.models.lora import AdapterError, write_peft_adapter

        if not self.takes_adapters or self._loaded_in_full:
            raise AdapterSyncError("this vLLM engine " + (
                "holds merged weights, not the base an adapter applies to"
                if self._loaded_in_full else "was started without LoRA support"))
        tensors = dict(adapter)
        directory = self._weights_dir / f"adapter-v{version}"
        request = LoRARequest(f"reroll-v{version}", version + 1, str(directory))
        try:
            write_peft_adapter(tensors, directory, self.model_path)
            if not self._loop.run(self.llm.add_lora(request)):
                raise AdapterSyncError(f"vLLM did not register adapter version {version}")
        except (AdapterError, ValueError, RuntimeError) as e:
            raise AdapterSyncError(f"vLLM refused adapter version {version}: {e}") from None
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self._drop_adapter()
        self._lora, self.version = request, version
        self._fingerprint = fingerprint(tensors.items())

    def adapter_versions(self) -> set[int]:
        """The adapter versions vLLM holds now."""
        return {i - 1 for i in self._loop.run(self.llm.list_loras())}

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            self._loop.run(self.llm.remove_lora(self._lora.lora_int_id))
            self._lora = None

    def weights_fingerprint(self) -> str:
        """Fingerprint of the weights the workers loaded (as received, before vLLM repacks them);
        before the first `load_weights`, of the checkpoint at `model_path`."""
        if self._fingerprint is None:
            from reroll.models.loading import load_model

            self._fingerprint = fingerprint(load_model(self.model_path).state_dict().items())
        return self._fingerprint

    # -- colocation, load, shutdown ---------------------------------------------------------------

    def sleep(self) -> None:
        """Free weights and KV cache on GPU (level 1 keeps weights in CPU memory). vLLM's CPU
        backend has no sleep mode; there the call does nothing, as the memory is shared anyway."""
        if self.sleep_supported:
            self._loop.run(self.llm.sleep(level=1))

    def wake(self) -> None:
        if self.sleep_supported:
            self._loop.run(self.llm.wake_up())

    def stats(self) -> EngineStats:
        return self.meter.stats()

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            self._loop.run(_shutdown(llm))  # on its loop, so its output handler stops cleanly
            self._loop.close()
        if self._weights_dir.exists():
            for leftover in self._weights_dir.glob("*"):
                leftover.unlink()
            self._weights_dir.rmdir()

    shutdown = close

    # -- internals --------------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Completion:
        rid = request.request_id
        self.meter.started()
        final = None
        try:
            if rid not in self._aborted:
                stream = self.llm.generate(self._vision.prompt(request),
                                           _sampling_params(request, self._vision.placeholders),
                                           request_id=rid, lora_request=self._lora)
                async for output in stream:
                    final = output
                if final is not None and request.images:
                    self._vision.check_expanded(request, final.prompt_token_ids)
        finally:
            aborted = rid in self._aborted
            self._aborted.discard(rid)
            completion = _completion(request, final, aborted, self.version)
            self.meter.finished(len(completion.token_ids))
        return completion


def _lora_args(max_rank: int) -> dict:
    """vLLM's LoRA options for adapters up to `max_rank` (none for 0): one adapter at a time (a
    sync run decodes one version; the next is added before the last is removed), its rank rounded up to one vLLM accepts."""
    if max_rank <= 0:
        return {}
    accepted = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    rank = next((r for r in accepted if r >= max_rank), None)
    if rank is None:
        raise ValueError(f"vLLM takes LoRA adapters up to rank {accepted[-1]}, not {max_rank}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 2}


async def _build(async_llm_class, args):
    return async_llm_class.from_engine_args(args)


async def _forget_cached(llm) -> None:
    """After new weights: the workers dropped their image features (vLLM's reload_weights), so
    the scheduler must forget it holds them (or it schedules a prompt on features that are gone,
    and the engine dies); and cached prefixes' KV, computed by the old weights, must not be
    reused. A prefix still held by a running request (an in-flight update) stays."""
    await llm.reset_encoder_cache()
    await llm.reset_prefix_cache()


async def _shutdown(llm) -> None:
    llm.shutdown()


def _sampling_params(request: Request, placeholders: list[int]):
    """vLLM's sampling parameters for `request`; a VLM's image placeholder tokens out of the
    distribution (-inf logit bias, before vLLM's processed logprobs), as the HF engine's and the
    trainer's are (`reroll.models.logprobs.placeholder_ids`)."""
    from vllm import SamplingParams as VSamplingParams

    p = request.params
    return VSamplingParams(
        n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=p.max_new_tokens, seed=request.seed, logprobs=0,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=True,  # stops are the request's only
        skip_special_tokens=False, detokenize=False,
        logit_bias={i: float("-inf") for i in placeholders} or None,
    )


class _VisionPrompts:
    """A vision-language model's prompts as vLLM takes them. vLLM runs the model's processor on
    the images itself and expands each image placeholder in the prompt ids, so given ids the
    processor already expanded it would expand the first image's tokens again; it takes the ids
    with each image's tokens folded back to the placeholder, and the images. A text model: the
    ids alone."""

    def __init__(self, model_path: str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        self.model_path = model_path
        self.architecture = architecture(config)
        self.placeholders = config_placeholder_ids(config)
        self._processor = None

    def check(self, request: Request) -> None:
        """Raise ValueError for image data this engine cannot take."""
        if self.architecture not in IMAGE_ARCHITECTURES:
            raise ValueError(f"the vLLM engine does not take image prompts of a "
                             f"{self.architecture} ({vllm_image_refusal(self.architecture)}); "
                             f"use rollout.engine: hf")
        if not request.images:
            raise ValueError("an image prompt for the vLLM engine needs the request's images "
                             "(Request.images), not its pixel values alone")

    def prompt(self, request: Request) -> dict:
        ids = list(request.prompt_ids)
        if not request.images:
            return {"prompt_token_ids": ids}
        return {"prompt_token_ids": self._folded(ids, request.images),
                "multi_modal_data": {"image": list(request.images)}}

    def check_expanded(self, request: Request, expanded: list[int] | None) -> None:
        """vLLM's expansion of the image tokens must be the processor's the trainer scores."""
        if list(expanded or []) != list(request.prompt_ids):
            raise ValueError(f"vLLM expanded the image tokens of a {self.architecture} prompt "
                             f"into {len(expanded or [])} tokens, the model's processor into "
                             f"{len(request.prompt_ids)}; use rollout.engine: hf")

    def _folded(self, ids: list[int], images: list) -> list[int]:
        """`ids` with each image's expanded tokens (what the processor makes of the placeholder
        and that image, in order) back to the placeholder's."""
        processor = self._load_processor()
        token = processor.image_token
        placeholder = processor.tokenizer(token, add_special_tokens=False)["input_ids"]
        out, start = [], 0
        for k, image in enumerate(images):
            run = processor(text=[token], images=[[image]],
                            add_special_tokens=False)["input_ids"][0]
            run = [int(t) for t in run]
            at = _find(ids, run, start)
            if at < 0:
                raise ValueError(f"image {k} of the prompt: its {len(run)} tokens from the "
                                 f"model's processor are not in the prompt ids")
            out += ids[start:at] + placeholder
            start = at + len(run)
        return out + ids[start:]

    def _load_processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.model_path)
        return self._processor


def _find(ids: list[int], run: list[int], start: int) -> int:
    """The first index >= start where `run` occurs in `ids` (-1: none)."""
    for i in range(start, len(ids) - len(run) + 1):
        if ids[i:i + len(run)] == run:
            return i
    return -1


def architecture(config) -> str:
    """A transformers config's model class name ("?" when it names none)."""
    return (getattr(config, "architectures", None) or ["?"])[0]


def vllm_image_refusal(architecture: str) -> str:
    """Why vLLM is not given image prompts of `architecture` ("" for one it is)."""
    if architecture in IMAGE_ARCHITECTURES:
        return ""
    return (f"vLLM's image path is checked against the trainer's logprobs for "
            f"{', '.join(IMAGE_ARCHITECTURES)} only")


def _completion(request: Request, output, aborted: bool, version: int) -> Completion:
    if output is None:
        return Completion(request.request_id, request.prompt_ids, [], [], "abort", version)
    sample = output.outputs[0]
    tokens = list(sample.token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(sample.logprobs or [], tokens, strict=False)]
    if aborted or sample.finish_reason == "abort" or not output.finished:
        reason = "abort"
    elif sample.finish_reason == "stop":
        reason = "stop"
    else:
        reason = "length"
    return Completion(request.request_id, request.prompt_ids, tokens, logprobs[: len(tokens)],
                      reason, version)


def _unshared(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """CPU, contiguous copies where storage is shared (tied embeddings), as safetensors needs."""
    out, seen = {}, set()
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _shared_memory() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
