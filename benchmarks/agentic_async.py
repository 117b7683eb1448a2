"""Asynchronous vs synchronous agentic training (issue 46): the same episodes trained both ways
on an environment with long-tailed step latency and variable episode lengths (tiny model, CPU).

The environment (`LongTailEnv`) is a remote-like task: an episode lasts 1-6 turns (by its env
seed), each step usually takes 10-40 ms, but one step in eight takes 1-2 s (a slow tool, a
cold sandbox). The reward is 1 when the reply holds a digit on the episode's last turn. A sync
step waits for its slowest episode, and the trainer idles while episodes run; async
(`async_training`, `order: start`, `max_ahead` 6) keeps up to seven steps' episodes running while
the trainer updates, and each step still trains the env seeds sync's step does (checked:
`same_episodes`), so the work is equal up to the sampled lengths (`trained_tokens_ratio`).

    .venv/bin/python benchmarks/agentic_async.py [--steps N] [--max-ahead A] [--groups G] [--group-size S]
        [--no-engine-process]

Reports the training loop's wall time of each mode (the final evaluation excluded), the
trainer's wait for its batch, the update time, and the held-out success of both. Last line:
JSON with `speedup` (sync loop time / async loop time), `trained_tokens_ratio` (async policy
tokens over sync's) and `eval_success` per mode.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

STEP_S = (0.01, 0.04)
SLOW_S, SLOW_SHARE = (1.0, 2.0), 0.125


class LongTailEnv:
    """1-6 turns by env seed; every step sleeps 10-40 ms, one in eight 1-2 s (seeded by the
    env seed and the turn, so both modes meet the same latencies)."""

    def __init__(self, max_turns: int = 6):
        self.max_turns = max_turns
        self.seed, self.turn, self.length = 0, 0, 1

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.seed, self.turn = seed or 0, 0
        self.length = 1 + random.Random(self.seed).randrange(min(self.max_turns, 6))
        return (f"Task {self.seed}: answer {self.length} questions, each with a number. "
                f"Question 1?", {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        rng = random.Random(self.seed * 1_000 + self.turn)
        slow = rng.random() < SLOW_SHARE
        time.sleep(rng.uniform(*(SLOW_S if slow else STEP_S)))
        self.turn += 1
        if self.turn >= self.length:
            success = any(c.isdigit() for c in action)
            return "Done.", float(success), True, False, {"success": success}
        return f"Question {self.turn + 1}?", 0.0, False, False, {}


def model_path() -> str:
    from reroll.models.factory import make_model

    local = Path("models/tiny")
    if (local / "config.json").is_file():
        return str(local)
    return str(make_model(Path(tempfile.mkdtemp()) / "tiny", "tiny"))


def train(model: str, args: argparse.Namespace, asynchronous: bool, out: Path) -> dict:
    from reroll.config.agentic import AgenticConfig
    from reroll.pipelines.run import Run
    from reroll.tracking import read_metrics

    name = "async" if asynchronous else "sync"
    config = AgenticConfig.model_validate({
        "pipeline": "agentic", "name": f"bench-agentic-{name}", "output_dir": str(out / name),
        "overwrite": True, "seed": 0, "steps": args.steps, "model": {"path": model},
        "env": {"id": f"{Path(__file__).resolve()}:LongTailEnv", "isolation": "thread",
                "max_turns": 6, "max_context_tokens": 512, "eval_episodes": args.eval_episodes},
        "rollout": {"prompts_per_step": args.groups, "group_size": args.group_size,
                    "max_new_tokens": 8},
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": args.group_size, "num_threads": 1},
        # The engine in a Ray actor of its own (1 CPU) in both modes: the same compute split,
        # and the one async needs to overlap decoding with the update on 2 cores.
        "scheduler": {"engine_process": args.engine_process},
        "eval": {"every_steps": 0},
        # The same correction in both modes (async turns it on by default): equal work.
        "algorithm": {"correction": {"tis": {"level": "token", "cap": 2.0}}},
        "async_training": {"enabled": asynchronous, "max_staleness": 8,
                           "max_ahead": args.max_ahead, "order": "start",
                           # weights load between two decoding steps: no preemption, and the
                           # trainer does not wait for the load (0.39 s a step otherwise)
                           "in_flight_updates": True},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 0}})
    pipeline = Run(config)
    evaluate, eval_s, seeds, tokens = pipeline.evaluate, [], [], [0]

    def timed_evaluate(*a) -> dict:  # the last step evaluates: kept out of the loop's time
        t0 = time.perf_counter()
        result = evaluate(*a)
        eval_s.append(time.perf_counter() - t0)
        return result

    task = pipeline.step.task
    next_batch = task.next_batch

    def counted(*a):
        trajectories = next_batch(*a)
        seeds.append(sorted({t.reward_info["env_seed"] for t in trajectories}))
        tokens[0] += sum(sum(t.policy_mask) for t in trajectories)
        return trajectories

    pipeline.evaluate, task.next_batch = timed_evaluate, counted
    summary = pipeline.run()
    rows = [r for r in read_metrics(summary["run_dir"]) if "time/step_s" in r]
    last = rows[-1]
    return {"loop_s": sum(r["time/step_s"] for r in rows) - eval_s[-1],
            "wait_s": sum(r["time/rollout_s"] for r in rows),
            "update_s": sum(r["time/train_s"] for r in rows),
            "tokens": tokens[0], "seeds": seeds, "eval_success": last["eval/success_rate"],
            "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
            "restarted": last.get("rollout/episodes_restarted", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-ahead", type=int, default=6)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=8)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine in a Ray actor of its own (default) or in the trainer's "
                             "process")
    args = parser.parse_args()
    model = model_path()
    out = Path(tempfile.mkdtemp(prefix="bench_agentic_async_"))
    sync = train(model, args, False, out)
    asynchronous = train(model, args, True, out)
    table = Table(title=f"{args.steps} steps x {args.groups} env seeds x {args.group_size} "
                        f"episodes, 1-6 turns, 1 step in 8 slow")
    for column in ("mode", "loop s", "trainer wait s", "update s", "policy tokens",
                   "eval success"):
        table.add_column(column)
    for mode, r in (("sync", sync), ("async", asynchronous)):
        table.add_row(mode, f"{r['loop_s']:.1f}", f"{r['wait_s']:.1f}", f"{r['update_s']:.1f}",
                      str(r["tokens"]), f"{r['eval_success']:.3f}")
    Console(file=sys.stderr).print(table)
    print(json.dumps({
        "speedup": round(sync["loop_s"] / asynchronous["loop_s"], 2),
        "trained_tokens_ratio": round(asynchronous["tokens"] / max(sync["tokens"], 1), 3),
        "eval_success": {"sync": sync["eval_success"], "async": asynchronous["eval_success"]},
        "same_episodes": sync["seeds"] == asynchronous["seeds"],
        "sync_loop_s": round(sync["loop_s"], 2), "async_loop_s": round(asynchronous["loop_s"], 2),
        "sync_wait_s": round(sync["wait_s"], 2), "async_wait_s": round(asynchronous["wait_s"], 2),
        "async_staleness_max": asynchronous["staleness_max"],
        "async_episodes_restarted": asynchronous["restarted"], "steps": args.steps}))


if __name__ == "__main__":
    main()
