"""The in-process weight sync of a local run, at SmolLM2-135M's shape: policy to engine, checked.

Every RL step pushes the trainer's weights (float32) to the HF engine (bfloat16 on a GPU, as
`rollout.dtype: auto` makes it) and checks the engine's fingerprint against the policy's
(`reroll.distributed.weight_sync.InProcessSync`). This times the whole sync and its parts, the
fastest of REPEATS, on the device given (`cpu` or `cuda`):
- `load_weights`: the engine takes the state dict (cast to its dtype) and fingerprints it as
  received;
- `fingerprint`: the policy's fingerprint, over all 135M parameters' bytes.

Random-init weights of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49,152, tied embeddings): the sync's cost depends on the shape, not
the values.

    .venv/bin/python benchmarks/weight_sync.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reroll.distributed.weight_sync import InProcessSync
from reroll.engines.base import fingerprint
from reroll.engines.hf import HFEngine

REPEATS = 3
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
               tie_word_embeddings=True)


class Trainer:
    """The part of the policy the sync reads."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict_for_sync(self):
        return iter(self.model.state_dict().items())


def best_seconds(fn, device: str) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = LlamaConfig(**SMOLLM2)
    policy = Trainer(LlamaForCausalLM(config).to(args.device))
    engine_dtype = torch.bfloat16 if args.device == "cuda" else None
    engine = HFEngine(LlamaForCausalLM(config).to(args.device), 8, 0, dtype=engine_dtype)
    sync = InProcessSync(policy, engine)
    result = {
        "device": args.device, "engine_dtype": str(engine_dtype or torch.float32),
        "parameters": sum(p.numel() for p in policy.model.parameters()),
        "sync_s": best_seconds(lambda: sync(1), args.device),
        "load_weights_s": best_seconds(
            lambda: engine.load_weights(policy.state_dict_for_sync(), 1), args.device),
        "fingerprint_s": best_seconds(lambda: fingerprint(policy.state_dict_for_sync()),
                                      args.device),
    }
    for key, value in result.items():
        print(f"{key:>16}: {value:.3f}" if isinstance(value, float) else f"{key:>16}: {value}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
