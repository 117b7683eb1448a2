"""Environment-level asynchrony: multi-turn episodes whose env step takes 50-200 ms (I/O-like
latency), run all at once (env steps in worker threads overlap generation and each other) vs one
episode at a time, on the same episodes with the same engine.

    .venv/bin/python benchmarks/env_async.py

Prints a table and, as the last line, JSON with `speedup` (sequential time / concurrent time).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.envs.guess_number import GuessNumberEnv
from reroll.models.factory import make_model
from reroll.models.loading import load_model, load_tokenizer
from reroll.rollout.agent_loop import AgentJob, run_episodes

EPISODES, GROUP, TURNS = 32, 4, 4


class SlowGuessNumber(GuessNumberEnv):
    """guess_number whose every step waits 50-200 ms, like a remote or sandboxed env."""

    def step(self, action):
        time.sleep(random.Random(hash(action) ^ self.turn).uniform(0.05, 0.2))
        return super().step(action)


def model_path() -> str:
    local = Path("models/tiny")
    if (local / "config.json").is_file():
        return str(local)
    return str(make_model(Path(tempfile.mkdtemp()) / "tiny", "tiny"))


def main() -> None:
    torch.set_num_threads(2)
    path = model_path()
    tokenizer = load_tokenizer(path)
    engine = HFEngine(load_model(path), 256, tokenizer.pad_token_id)
    params = SamplingParams(8, 1.0, 1.0, 0, (tokenizer.eos_token_id,))
    job = AgentJob(engine, tokenizer, lambda: SlowGuessNumber(high=8, max_turns=TURNS), params,
                   max_turns=TURNS, max_context_tokens=512)
    seeds = list(range(EPISODES // GROUP))
    run_episodes(job, [0], 2, run_seed=1, step=0)  # warm-up

    t0 = time.perf_counter()
    together, stats = run_episodes(job, seeds, GROUP, run_seed=0, step=1)
    concurrent_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    one_by_one = 0
    for seed in seeds:
        for _ in range(GROUP):
            one_by_one += len(run_episodes(job, [seed], 1, run_seed=0, step=1)[0])
    sequential_s = time.perf_counter() - t0

    speedup = sequential_s / concurrent_s
    table = Table(title=f"{EPISODES} episodes x up to {TURNS} turns, env step 50-200 ms")
    for column in ("mode", "seconds", "episodes/s"):
        table.add_column(column)
    table.add_row("one episode at a time", f"{sequential_s:.2f}", f"{one_by_one / sequential_s:.2f}")
    table.add_row("env-level async", f"{concurrent_s:.2f}", f"{len(together) / concurrent_s:.2f}")
    Console(file=sys.stderr).print(table)
    print(json.dumps({"speedup": round(speedup, 2), "sequential_s": round(sequential_s, 2),
                      "concurrent_s": round(concurrent_s, 2), "episodes": EPISODES,
                      "env_turns": stats.turns, "env_step_s_mean": round(stats.metrics()[
                          "env/step_s_mean"], 3)}))


if __name__ == "__main__":
    main()
