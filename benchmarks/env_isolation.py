"""What `env.isolation: process` costs: a trivial environment's step (it echoes the action)
through the agent loop's `step_async`, in threads of this process vs in an env process, one step
at a time and 32 episodes at once; and how long an env process takes to start.

    .venv/bin/python benchmarks/env_isolation.py

Prints a table and, as the last line, JSON with `overhead_ms_per_step` (process minus thread,
one step at a time): the time a step's round trip to the env process adds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time

from rich.console import Console
from rich.table import Table

from reroll.envs import make_env
from reroll.envs.base import reset_async, step_async
from reroll.envs.process import EnvProcesses

STEPS, EPISODES, CONCURRENT_STEPS = 300, 32, 20


class Echo:
    """The cheapest environment: the observation is the action, no end."""

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        return action, 0.0, False, False, {}


async def one_at_a_time(make) -> float:
    env = make()
    await reset_async(env, 0, 30)
    started = time.perf_counter()
    for _ in range(STEPS):
        await step_async(env, "x", 30)
    return (time.perf_counter() - started) / STEPS


async def together(make) -> float:
    """Seconds per step with EPISODES episodes stepping at once."""
    envs = [make() for _ in range(EPISODES)]
    await asyncio.gather(*(reset_async(env, i, 30) for i, env in enumerate(envs)))

    async def episode(env):
        for _ in range(CONCURRENT_STEPS):
            await step_async(env, "x", 30)

    started = time.perf_counter()
    await asyncio.gather(*(episode(env) for env in envs))
    return (time.perf_counter() - started) / (EPISODES * CONCURRENT_STEPS)


def main() -> None:
    factory = functools.partial(make_env, f"{__file__}:Echo")  # importable by a new process
    started = time.perf_counter()
    hosts = EnvProcesses(factory, "Echo")
    start_s = time.perf_counter() - started
    try:
        figures = {}
        for mode, make in (("thread", factory), ("process", hosts.make)):
            asyncio.run(one_at_a_time(make))  # warm-up
            figures[mode] = (asyncio.run(one_at_a_time(make)), asyncio.run(together(make)))
    finally:
        hosts.close()
    table = Table(title="a trivial env step (ms)")
    for column in ("isolation", "one at a time", f"{EPISODES} episodes at once"):
        table.add_column(column)
    for mode, (alone, many) in figures.items():
        table.add_row(mode, f"{alone * 1e3:.3f}", f"{many * 1e3:.3f}")
    Console(file=sys.stderr).print(table)
    ms = {mode: [round(v * 1e3, 3) for v in values] for mode, values in figures.items()}
    print(json.dumps({"overhead_ms_per_step": round(ms["process"][0] - ms["thread"][0], 3),
                      "thread_ms": ms["thread"], "process_ms": ms["process"],
                      "process_start_s": round(start_s, 2)}))


if __name__ == "__main__":
    main()
