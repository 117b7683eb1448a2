"""Full fine-tuning vs LoRA (`model.lora`) on a real model: peak RSS and time of one RL update.

The update is real_model.py's: GRPO loss and an AdamW step on 16 sequences of 256 tokens (2
prompts of 64 tokens x 8 responses of 192), micro-batch 16, float32, chunked LM head and
`train.gradient_checkpointing`, 2 threads, SmolLM2-135M (`models/smollm2`; a random-init model of
its shape when it is missing, as real_model.py does). LoRA: rank 16, alpha 32, every linear layer
of the decoder (`target_modules: all-linear`).

Each configuration runs in a fresh subprocess (a warm-up update on 2 short rows, then REPEATS
timed ones, the fastest kept), so its peak RSS (VmHWM: weights, gradients, AdamW moments, activations) is its own:
- `full`: every weight trained: gradients and AdamW moments for all 135M parameters;
- `lora`: only the adapter trained (4.9M parameters): the base weights have no gradient and no
  optimizer state;
- `full+kl`, `lora+kl` (the same with a KL term, `algorithm.kl.coef > 0`): the step also scores
  the batch with the reference policy, a second model in memory for `full`, the same model with
  the adapter switched off for `lora`.

Each configuration's peak RSS is broken down (GiB, adding up to the update's peak):
- `runtime`: the process before the model (interpreter, torch, transformers, PEFT);
- `weights`: parameters and buffers of every model in memory (a full reference's copy too);
- `gradients`: the trained parameters' gradients (they all exist at the end of a backward);
- `optimizer`: AdamW's moments (created by the first update);
- `activations`: the rest of the update's peak: saved activations, the LM head's chunks, the
  backward's temporaries and whatever freed memory the allocator holds on to.
The update's peak is measured from just before the first update (VmHWM reset through
/proc/self/clear_refs), so the model's loading does not count in it; `peak_rss_gb` is the
process's peak, loading included, as before.

Last line: JSON with `rss_ratio` and `step_time_ratio` (lora over full, without KL; the goal is
`rss_ratio` <= 0.6) and `rss_ratio_kl` / `step_time_ratio_kl` (with the KL term's reference).

    .venv/bin/python benchmarks/lora.py [--model PATH] [--no-kl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from real_model import LENGTH, MICRO, ROWS, TRAIN_PROMPT, grpo_batch, model_path  # noqa: E402

THREADS, REPEATS = 2, 2
LORA = {"rank": 16, "alpha": 32.0}
CONFIGS = {"full": {"lora": False, "kl": False}, "lora": {"lora": True, "kl": False},
           "full+kl": {"lora": False, "kl": True}, "lora+kl": {"lora": True, "kl": True}}
PARTS = ("runtime", "weights", "gradients", "optimizer", "activations")
console = Console(stderr=True)


def status_gb(key: str) -> float:
    """This process's `VmRSS` (now) or `VmHWM` (peak) in GiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 2**20


def reset_peak() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def tensor_gb(tensors) -> float:
    unique = {t.data_ptr(): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values()) / 2**30


def breakdown(models: list, trained: list, optimizer, base_gb: float, peak_gb: float) -> dict:
    """`PARTS` of the update's peak RSS (see the module's docstring)."""
    weights = tensor_gb(t for m in models for t in (*m.parameters(), *m.buffers()))
    gradients = tensor_gb(trained)
    state = tensor_gb(v for s in optimizer.state.values() for v in s.values())
    return {"runtime": base_gb - weights, "weights": weights, "gradients": gradients,
            "optimizer": state, "activations": peak_gb - base_gb - gradients - state}


def train_worker(spec: dict) -> dict:
    """One configuration's RL update, in this (fresh) process."""
    torch.set_num_threads(spec["threads"])
    from reroll.config.algorithm import AlgorithmConfig
    from reroll.config.lora import LoRAConfig
    from reroll.config.schema import OptimizerConfig, TrainConfig
    from reroll.models.loading import load_model
    from reroll.pipelines import objective
    from reroll.training.local import LocalStrategy
    from reroll.training.protocols import AdapterOffReference
    from reroll.workers.reference import ReferenceWorker

    model = load_model(spec["model"])
    train = TrainConfig(micro_batch_size=MICRO, gradient_checkpointing=True)
    lora = LoRAConfig(**LORA) if spec["lora"] else None
    strategy = LocalStrategy(model, OptimizerConfig(lr=1e-6), train, total_steps=2, lora=lora)
    reference = None
    if spec["kl"]:
        reference = AdapterOffReference(strategy) if lora else ReferenceWorker(
            rank=0, world_size=1, model_path=spec["model"], dtype="float32",
            micro_batch_size=MICRO)
    algorithm = AlgorithmConfig(kl={"coef": 0.01 if spec["kl"] else 0.0})
    trained = [p for p in model.parameters() if p.requires_grad]
    vocab = model.config.vocab_size
    # Read every weight once: loading may leave them mapped from the file and not yet resident,
    # and their pages would then count as the update's.
    for m in [model] + ([reference.model] if isinstance(reference, ReferenceWorker) else []):
        for t in (*m.parameters(), *m.buffers()):
            t.detach().sum()
    load_peak, base = status_gb("VmHWM"), status_gb("VmRSS")
    reset = reset_peak()
    timings = []
    for batch in (grpo_batch(vocab, rows=2, length=32, prompt=8, group=2, seed=1),
                  *[grpo_batch(vocab, seed=s) for s in range(spec.get("repeats", REPEATS))]):
        start = time.perf_counter()
        if reference is not None:
            batch["ref_logprobs"] = reference.logprobs(batch)
        loss_fn = objective.make_rl_loss(objective.build(algorithm, max_new_tokens=LENGTH - TRAIN_PROMPT), batch)
        strategy.train_step(batch, loss_fn)
        timings.append(time.perf_counter() - start)
    update_peak = status_gb("VmHWM")
    models = [model] + ([reference.model] if isinstance(reference, ReferenceWorker) else [])
    parts = breakdown(models, trained, strategy.optimizer, base,
                      update_peak if reset else max(update_peak, load_peak))
    # The fastest timed update: other work on a shared machine only ever slows one down.
    return {"seconds": min(timings[1:]), "peak_rss_gb": max(load_peak, update_peak),
            "update_peak_gb": update_peak, "trained_params": sum(p.numel() for p in trained),
            **{f"{part}_gb": parts[part] for part in PARTS}}


def run_config(name: str, path: str, repeats: int = REPEATS) -> dict:
    spec = {**CONFIGS[name], "model": path, "threads": THREADS, "repeats": repeats}
    console.log(f"update: {name} (fresh process)")
    out = subprocess.run([sys.executable, __file__, "--train-worker", json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"update {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--no-kl", action="store_true", help="skip the two runs with a KL term")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed updates per configuration (the fastest is kept); the peak "
                             "RSS is reached in the first")
    parser.add_argument("--train-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_worker:
        print(json.dumps(train_worker(json.loads(args.train_worker))))
        return {}
    started = time.perf_counter()
    path, is_real = model_path(args.model)
    names = ["full", "lora"] + ([] if args.no_kl else ["full+kl", "lora+kl"])
    runs = {name: run_config(name, path, args.repeats) for name in names}
    result = {"model": "SmolLM2-135M" if is_real else "random-init SmolLM2-135M shape",
              "threads": THREADS, "rows": ROWS, "length": LENGTH, "lora": LORA,
              **{name: {k: round(v, 3) for k, v in run.items()} for name, run in runs.items()}}
    for suffix, full, lora in (("", "full", "lora"), ("_kl", "full+kl", "lora+kl")):
        if full in runs:
            result[f"rss_ratio{suffix}"] = round(
                runs[lora]["peak_rss_gb"] / runs[full]["peak_rss_gb"], 3)
            result[f"step_time_ratio{suffix}"] = round(
                runs[lora]["seconds"] / runs[full]["seconds"], 3)
    result["wall_s"] = round(time.perf_counter() - started)
    report(runs)
    print(json.dumps(result))
    return result


def report(runs: dict) -> None:
    table = Table(title=f"one RL update: {ROWS} x {LENGTH} tokens, micro-batch {MICRO}, "
                        f"{THREADS} threads")
    for column in ("configuration", "trained params", "seconds", "peak RSS GB",
                   "update peak", *PARTS):
        table.add_column(column, justify="right")
    for name, run in runs.items():
        table.add_row(name, f"{run['trained_params'] / 1e6:.1f}M", f"{run['seconds']:.1f}",
                      f"{run['peak_rss_gb']:.2f}", f"{run['update_peak_gb']:.2f}",
                      *(f"{run[f'{part}_gb']:.2f}" for part in PARTS))
    Console(stderr=True, width=max(console.width, 130)).print(table)  # every column readable


if __name__ == "__main__":
    main()
