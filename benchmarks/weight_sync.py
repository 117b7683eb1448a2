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

With `--lora-rank R` it measures a LoRA run's sync instead (`model.lora` with rank R, alpha 2R,
all-linear): the adapter alone (`model.lora.sync: adapter`, which the engine merges into its own
copy of the base weights) against the merged weights (`merged`), the bytes each sends and the
time each takes; the last line then has `lora_sync_bytes_ratio` (adapter over merged bytes).

With `--delta` it measures the delta sync to a serving endpoint (`rollout.serving_endpoint.
weight_sync: delta`, `reroll.engines.delta`) after one GRPO-shaped update of SmolLM2-135M-Instruct
(models/smollm2: `make models/smollm2/config.json`) at examples/real/grpo.yaml's learning rate
(3e-5, AdamW): the bytes of the delta of the weights in bf16 (the endpoint's dtype) against all of
them, and the time to take the diff and patch a copy against the time to serialise the whole.
The last line then has `delta_sync_bytes_ratio` and `delta_sync_time_ratio`.

With `--moe` it measures only routing replay (`algorithm.routing_replay`, docs/moe.md) on the tiny
`qwen3_moe` (`reroll make-model` preset, 4 experts, top-2, 2 layers): a bf16 HF engine samples 8
prompts x 4 responses x 24 tokens, and the float32 trainer scores them routing afresh and replaying
the engine's routing (`reroll.routing_check`). The default run measures it too, after the sync.
The last line then has `routing_mismatch_without` and `routing_mismatch_with_replay` (the share of
tokens routed to other experts than the engine's in some layer) and the per-token behaviour KL of
each.

    .venv/bin/python benchmarks/weight_sync.py [--device cuda] [--lora-rank 16] [--delta] [--moe]
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


def lora_sync(rank: int, device: str) -> dict:
    """Adapter-only against merged sync of a LoRA policy of SmolLM2's shape, to the HF engine."""
    import copy

    from reroll.config.lora import LoRAConfig
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.training.local import LocalStrategy

    config = LlamaConfig(**SMOLLM2)
    base = LlamaForCausalLM(config)
    engine_base = copy.deepcopy(base)  # the engines load the same base model as the trainer
    policy = LocalStrategy(base, OptimizerConfig(), TrainConfig(),
                           total_steps=1, device=device,
                           lora=LoRAConfig(rank=rank, alpha=2.0 * rank))
    with torch.no_grad():  # a trained adapter (B starts at zero)
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    result: dict = {"device": device, "lora_rank": rank}
    for mode in ("adapter", "merged"):
        engine = HFEngine(copy.deepcopy(engine_base).to(device), 8, 0)
        sync = InProcessSync(policy, engine, mode)
        metrics = sync(1)
        if fingerprint(engine.model.state_dict().items()) != \
                fingerprint(policy.state_dict_for_sync()):
            raise SystemExit(f"{mode} sync: the engine's weights are not the trainer's merged ones")
        result[f"{mode}_bytes"] = int(metrics["weight_sync/bytes"])
        result[f"{mode}_sync_s"] = best_seconds(lambda s=sync: s(1), device)
    result["lora_sync_bytes_ratio"] = result["adapter_bytes"] / result["merged_bytes"]
    return result


def delta_sync(model_dir: str, lr: float) -> dict:
    """One AdamW step of a GRPO-shaped loss (-advantage x log-likelihood of sampled sequences,
    advantages +-1) on SmolLM2, then the bf16 delta between the weights before and after."""
    from safetensors.torch import save

    from reroll.engines.delta import body_bytes, diff, patch
    from reroll.models.loading import load_model

    model = load_model(model_dir)
    before = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (8, 96), generator=generator)
    advantages = torch.tensor([1.0, -1.0] * 4)
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(
        -1, ids[:, 1:, None]).squeeze(-1).mean(-1)
    (-(advantages * logp).mean()).backward()
    optimizer.step()
    after = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
    body = diff(before, after)
    patched = before | patch(before, body)
    if fingerprint(patched.items()) != fingerprint(after.items()):
        raise SystemExit("the patched weights are not the updated ones")
    full_s = best_seconds(lambda: save(after), "cpu")
    delta_s = best_seconds(lambda: save(diff(before, after)), "cpu") + \
        best_seconds(lambda: patch(before, body), "cpu")
    full = body_bytes(after)
    return {"model": model_dir, "lr": f"{lr:g}", "engine_dtype": "bfloat16", "full_bytes": full,
            "delta_bytes": body_bytes(body), "delta_sync_bytes_ratio": body_bytes(body) / full,
            "full_serialise_s": full_s, "delta_diff_patch_s": delta_s,
            "delta_sync_time_ratio": delta_s / full_s}


def moe_routing(seed: int = 0) -> dict:
    """`--moe`: routing mismatch and behaviour KL with and without replay, bf16 engine."""
    import tempfile

    from reroll.models.factory import make_model
    from reroll.models.loading import load_model
    from reroll.routing_check import compare_routing

    with tempfile.TemporaryDirectory() as folder:
        model = load_model(str(make_model(folder, "tiny", seed=seed, architecture="qwen3_moe")))
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (12,), generator=generator).tolist()
               for _ in range(8)]
    result = compare_routing(model, prompts, torch.bfloat16, tokens=24, samples=4)
    return {"moe_model": "tiny qwen3_moe", **{f"moe_{k}" if k.startswith("behaviour") or k in (
        "engine_dtype", "responses", "response_tokens") else k: v for k, v in result.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="measure a LoRA run's adapter-only against merged sync at this rank")
    p.add_argument("--delta", action="store_true",
                   help="measure the delta sync after one GRPO-shaped update of SmolLM2")
    p.add_argument("--model", default="models/smollm2", help="with --delta: the model folder")
    p.add_argument("--moe", action="store_true",
                   help="measure only routing replay on the tiny qwen3_moe (bf16 engine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.moe:
        report(moe_routing())
        return
    if args.delta:
        report(delta_sync(args.model, lr=3e-5))
        return
    if args.lora_rank:
        report(lora_sync(args.lora_rank, args.device))
        return
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
    report(result | moe_routing())


def report(result: dict) -> None:
    for key, value in result.items():
        print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
    print(json.dumps({k: _rounded(v) for k, v in result.items()}))


def _rounded(value):
    """4 decimals; 3 significant digits for small figures (a KL of 4e-6 is not 0)."""
    if not isinstance(value, float):
        return value
    return round(value, 4) if abs(value) >= 1e-2 or value == 0 else float(f"{value:.3g}")


if __name__ == "__main__":
    main()
