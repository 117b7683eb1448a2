"""Metrics of a sandbox pool: throughput, queue wait, latency percentiles, failures by cause."""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Iterable

from reroll.sandbox.result import ExecResult


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; 0.0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class PoolMetrics:
    """Counters and a window of recent timings. Failure causes are a limit name
    (``wall_time``, ``memory``, ...), ``exit_code`` (the program failed on its own) or a sandbox
    failure (``sandbox_error``, ``spawn_error``, ``slot_died``)."""

    def __init__(self, window: int = 10000) -> None:
        self.started = time.perf_counter()
        self.executions = 0
        self.warm_hits = 0
        self.failures: Counter[str] = Counter()
        self.latency_s: deque[float] = deque(maxlen=window)
        self.queue_s: deque[float] = deque(maxlen=window)
        self.wall_s: deque[float] = deque(maxlen=window)
        self.spawn_s: deque[float] = deque(maxlen=window)

    def record(self, result: ExecResult) -> None:
        self.executions += 1
        self.warm_hits += int(result.warm)
        self.latency_s.append(result.total_s)
        self.queue_s.append(result.queue_s)
        self.wall_s.append(result.wall_s)
        if result.failure is not None:
            self.failures[result.failure] += 1

    def record_spawn(self, seconds: float) -> None:
        self.spawn_s.append(seconds)

    def record_failure(self, cause: str) -> None:
        self.failures[cause] += 1

    def snapshot(self) -> dict[str, float | int | dict[str, int]]:
        """A flat dict for a tracker (times in milliseconds)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        ms = 1000.0
        return {
            "executions": self.executions,
            "executions_per_s": self.executions / elapsed,
            "latency_p50_ms": percentile(self.latency_s, 50) * ms,
            "latency_p99_ms": percentile(self.latency_s, 99) * ms,
            "queue_wait_p50_ms": percentile(self.queue_s, 50) * ms,
            "queue_wait_p99_ms": percentile(self.queue_s, 99) * ms,
            "run_p50_ms": percentile(self.wall_s, 50) * ms,
            "spawn_p50_ms": percentile(self.spawn_s, 50) * ms,
            "warm_hit_rate": self.warm_hits / self.executions if self.executions else 0.0,
            "failures": dict(self.failures),
        }
