"""Asynchronous vs synchronous RL training: end-to-end speedup at the same compute and samples.

Same model, data, algorithm (GRPO + token TIS), seeds and number of samples; the same compute
split in both modes: the rollout engine in a Ray actor with 1 CPU, the trainer with 1 thread in
the driver. Sync: each step waits for its rollout, then trains while the engine idles. Async
(`async_training.enabled`, max_staleness 1, partial rollout): the engine generates the next
batch while the trainer trains. Workload: benchmarks/_longtail.py (long-tailed lengths).
Reports the training-loop wall time of both and the final greedy eval reward, which must agree
within TOLERANCE. Last line: JSON with `speedup`.

    .venv/bin/python benchmarks/async_vs_sync.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _longtail import ROOT, build_workload  # noqa: E402

from reroll.config.schema import RLConfig  # noqa: E402
from reroll.distributed.ray_runtime import ensure_ray  # noqa: E402
from reroll.pipelines.rlvr import RLVRPipeline  # noqa: E402
from reroll.tracking import read_metrics  # noqa: E402

STEPS, PROMPTS, GROUP, MAX_NEW = 16, 8, 8, 96
TOLERANCE = 0.1
"""Largest accepted |async - sync| difference of the final greedy eval reward (mean over 48
prompts); run-to-run noise of a single configuration is of this order on this task."""


def train(workload: dict, asynchronous: bool) -> dict:
    name = "async" if asynchronous else "sync"
    config = RLConfig.model_validate({
        "name": f"bench-{name}", "output_dir": str(ROOT / f"run_{name}"), "seed": 0,
        "steps": STEPS, "model": {"path": workload["model"]},
        "data": {"train": workload["train"], "eval": workload["eval"]},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": MAX_NEW},
        "algorithm": {"correction": {"tis": {"level": "token", "cap": 2.0}}},
        "optimizer": {"lr": 1e-4}, "train": {"micro_batch_size": 32, "num_threads": 1},
        "eval": {"every_steps": 0},
        "scheduler": {"engine_process": True, "engine_threads": 1},
        "async_training": {"enabled": asynchronous, "max_staleness": 1},
        "tracking": {"tensorboard": False, "record_batch_every": 0}})
    summary = RLVRPipeline(config).run()
    rows = read_metrics(summary["run_dir"])
    return {"train_loop_s": sum(r["time/step_s"] for r in rows),
            "eval_start": summary["eval_reward_start"], "eval_end": summary["eval_reward_end"],
            "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
            "trainer_idle_s": sum(r.get("time/trainer_idle_s", 0.0) for r in rows),
            "samples": sum(r["rollout/groups_kept"] for r in rows) * GROUP}


def main() -> None:
    workload = build_workload()
    ensure_ray(num_cpus=2)
    sync = train(workload, asynchronous=False)
    asyn = train(workload, asynchronous=True)
    speedup = sync["train_loop_s"] / asyn["train_loop_s"]
    same = abs(asyn["eval_end"] - sync["eval_end"]) <= TOLERANCE
    table = Table(title=f"{STEPS} steps x {PROMPTS} prompts x {GROUP} samples; engine actor "
                        f"1 CPU, trainer 1 thread")
    for column in ("mode", "train loop s", "samples", "eval start", "eval end",
                   "staleness mean", "trainer idle s"):
        table.add_column(column)
    for name, r in (("sync", sync), ("async", asyn)):
        table.add_row(name, f"{r['train_loop_s']:.1f}", str(int(r["samples"])),
                      f"{r['eval_start']:.3f}", f"{r['eval_end']:.3f}",
                      f"{r['staleness_mean']:.2f}", f"{r['trainer_idle_s']:.1f}")
    Console().print(table)
    Console().print(f"speedup {speedup:.2f}x; eval reward within {TOLERANCE}: {same}")
    print(json.dumps({"speedup": round(speedup, 3), "sync_s": round(sync["train_loop_s"], 2),
                      "async_s": round(asyn["train_loop_s"], 2),
                      "sync_eval_reward": sync["eval_end"], "async_eval_reward": asyn["eval_end"],
                      "tolerance": TOLERANCE, "same_eval_reward": same}))


if __name__ == "__main__":
    main()
