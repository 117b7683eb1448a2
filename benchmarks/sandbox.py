"""Sandbox benchmark: executions/s and start-to-finish latency of sandboxed programs.

    .venv/bin/python benchmarks/sandbox.py [--runs 200]

Phases (all on the real bubblewrap sandbox):
  1. cold      — trivial program, one at a time, a fresh sandbox started per call (`Sandbox.run`)
  2. warm      — trivial program, one at a time, through `SandboxPool` (sandboxes started ahead)
  3. parallel  — trivial program, `--concurrency` callers in closed loops through a pool of that
                 concurrency (on 2 cores, latency there is mostly waiting for a core)
  4. testcases — a stdin/stdout solution checked against 10 test cases by `CodeRewardFn`

Latency is measured around each `run` call (queue wait included). The last line printed is one
JSON object; ``p50_ms`` is the warm one-at-a-time p50 of the trivial program (goal: < 50 ms),
``warm_speedup`` the cold p50 divided by it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from reroll.rewards.base import RewardSample  # noqa: E402
from reroll.rewards.code import CodeRewardFn  # noqa: E402
from reroll.sandbox import Sandbox, SandboxPool  # noqa: E402
from reroll.sandbox.metrics import percentile  # noqa: E402

TRIVIAL = "print('hello')\n"
SOLUTION = "```python\nn = int(input())\nxs = sorted(map(int, input().split()))\nprint(*xs)\nprint(sum(xs))\n```"


def make_tests(count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    inputs, outputs = [], []
    for _ in range(count):
        xs = [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 200))]
        inputs.append(f"{len(xs)}\n{' '.join(map(str, xs))}\n")
        outputs.append(f"{' '.join(map(str, sorted(xs)))}\n{sum(xs)}\n")
    return json.dumps({"inputs": inputs, "outputs": outputs})


def summarize(latencies: list[float], elapsed: float) -> dict[str, float]:
    return {
        "exec_per_s": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }


async def timed(runner, progress, task, code: str = TRIVIAL) -> float:
    started = time.perf_counter()
    result = await runner.run(code)
    latency = time.perf_counter() - started
    if not result.ok or result.stdout != "hello\n":
        raise RuntimeError(f"unexpected result: {result}")
    progress.advance(task)
    return latency


async def sequential(runner, runs: int, progress, label: str) -> dict[str, float]:
    task = progress.add_task(label, total=runs)
    started = time.perf_counter()
    latencies = [await timed(runner, progress, task) for _ in range(runs)]
    return summarize(latencies, time.perf_counter() - started)


async def parallel(
    pool: SandboxPool, runs: int, workers: int, progress, label: str
) -> dict[str, float]:
    """``workers`` callers, each issuing its next call as soon as the previous one returns."""
    task = progress.add_task(label, total=runs)
    latencies: list[float] = []

    async def worker(share: int) -> None:
        for _ in range(share):
            latencies.append(await timed(pool, progress, task))

    shares = [runs // workers + (1 if i < runs % workers else 0) for i in range(workers)]
    started = time.perf_counter()
    await asyncio.gather(*(worker(share) for share in shares))
    return summarize(latencies, time.perf_counter() - started)


async def testcases(pool: SandboxPool, samples: int, tests: int, progress) -> dict[str, float]:
    reward = CodeRewardFn(sandbox=pool, credit="fractional", time_limit_s=10)
    answer = make_tests(tests)
    task = progress.add_task(f"testcases ({tests} tests/sample)", total=samples)

    async def one() -> float:
        started = time.perf_counter()
        result = await reward(RewardSample("sort", SOLUTION, answer))
        if result.score != 1.0:
            raise RuntimeError(f"the reference solution failed: {result.info}")
        progress.advance(task)
        return time.perf_counter() - started

    executions_before = pool.metrics()["executions"]
    started = time.perf_counter()
    per_sample = [await one() for _ in range(samples)]
    elapsed = time.perf_counter() - started
    executions = pool.metrics()["executions"] - executions_before
    return {
        "exec_per_s": executions / elapsed,
        "sample_p50_ms": percentile(per_sample, 50) * 1000,
        "sample_p99_ms": percentile(per_sample, 99) * 1000,
        "exec_p50_ms": pool.metrics()["latency_p50_ms"],
        "exec_p99_ms": pool.metrics()["latency_p99_ms"],
    }


async def main(args: argparse.Namespace, console: Console) -> dict[str, object]:
    sandbox = Sandbox()
    columns = (
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        await sandbox.run(TRIVIAL)  # warm the page cache
        cold = await sequential(sandbox, args.runs // 2, progress, "cold (fresh sandbox per call)")
        async with SandboxPool(sandbox, concurrency=1) as pool:
            await asyncio.sleep(0.2)
            warm = await sequential(pool, args.runs, progress, "warm pool, one at a time")
        async with SandboxPool(sandbox, concurrency=args.concurrency) as pool:
            await asyncio.sleep(0.2)
            label = f"warm pool, {args.concurrency} callers"
            par = await parallel(pool, args.runs, args.concurrency, progress, label)
        async with SandboxPool(sandbox, concurrency=args.concurrency) as pool:
            await asyncio.sleep(0.2)
            tc = await testcases(pool, args.samples, args.tests, progress)
    return {"cold": cold, "warm": warm, "parallel": par, "testcases": tc}


def report(
    figures: dict[str, dict[str, float]], args: argparse.Namespace, console: Console
) -> dict:
    table = Table(title=f"sandbox benchmark ({os.cpu_count()} cores, bubblewrap)")
    for column in ("phase", "executions/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for phase in ("cold", "warm", "parallel"):
        f = figures[phase]
        table.add_row(phase, f"{f['exec_per_s']:.1f}", f"{f['p50_ms']:.1f}", f"{f['p99_ms']:.1f}")
    tc = figures["testcases"]
    table.add_row(
        "testcases (per execution)",
        f"{tc['exec_per_s']:.1f}",
        f"{tc['exec_p50_ms']:.1f}",
        f"{tc['exec_p99_ms']:.1f}",
    )
    table.add_row(
        f"testcases (per sample of {args.tests})",
        "",
        f"{tc['sample_p50_ms']:.1f}",
        f"{tc['sample_p99_ms']:.1f}",
    )
    console.print(table)
    warm, cold, par = figures["warm"], figures["cold"], figures["parallel"]
    return {
        "benchmark": "sandbox",
        "p50_ms": round(warm["p50_ms"], 2),
        "p99_ms": round(warm["p99_ms"], 2),
        "exec_per_s": round(warm["exec_per_s"], 2),
        "cold_p50_ms": round(cold["p50_ms"], 2),
        "cold_p99_ms": round(cold["p99_ms"], 2),
        "cold_exec_per_s": round(cold["exec_per_s"], 2),
        "warm_speedup": round(cold["p50_ms"] / warm["p50_ms"], 2),
        "parallel_concurrency": args.concurrency,
        "parallel_exec_per_s": round(par["exec_per_s"], 2),
        "parallel_p50_ms": round(par["p50_ms"], 2),
        "parallel_p99_ms": round(par["p99_ms"], 2),
        "testcase_exec_per_s": round(tc["exec_per_s"], 2),
        "testcase_exec_p50_ms": round(tc["exec_p50_ms"], 2),
        "testcase_exec_p99_ms": round(tc["exec_p99_ms"], 2),
        "testcase_sample_p50_ms": round(tc["sample_p50_ms"], 2),
        "tests_per_sample": args.tests,
        "runs": args.runs,
        "cores": os.cpu_count(),
        "goal_p50_ms": 50,
        "goal_met": warm["p50_ms"] < 50,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="executions per trivial phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--samples", type=int, default=20, help="code-reward samples")
    parser.add_argument("--tests", type=int, default=10, help="test cases per sample")
    arguments = parser.parse_args()
    out = Console(stderr=False)
    figures = asyncio.run(main(arguments, out))
    print(json.dumps(report(figures, arguments, out)))
