"""Metrics of a session manager, in Prometheus' format (``GET /metrics`` of the service) and as
plain windows of recent timings (`SessionManager.summary`).

- ``reroll_sandbox_session_create_seconds`` (histogram): a create, from the call to a running
  session (waiting for a start slot included);
- ``reroll_sandbox_session_exec_seconds`` and ``reroll_sandbox_session_fork_seconds``
  (histograms): a command from the call to its answer; a fork of N, all N;
- ``reroll_sandbox_sessions{state}`` (gauge): sessions by state;
- ``reroll_sandbox_session_failures_total{cause}`` (counter): ``spawn_error`` (a sandbox did not
  start), ``session_died`` (a session's sandbox ended on its own), ``unresponsive`` (its driver
  stopped answering), ``warm_died``, ``max_sessions`` (a create refused at the cap), ``cancelled``;
  and per command the limit it hit (``wall_time``, ``output``, ``memory``, ...).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter

from reroll.sandbox.result import ExecResult

STATES = ("starting", "running", "stopped", "closed", "failed")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SessionMetrics:
    """One registry per manager, so two managers in a process (tests) never share counters."""

    def __init__(self, counts: Callable[[], dict[str, int]], window: int = 100_000) -> None:
        """``counts``: sessions by state, read at each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        prefix = "reroll_sandbox_session"
        self._create = Histogram(f"{prefix}_create_seconds", "Session create latency",
                                 buckets=_BUCKETS, registry=self.registry)
        self._exec = Histogram(f"{prefix}_exec_seconds", "Command latency in a session",
                               buckets=_BUCKETS, registry=self.registry)
        self._fork = Histogram(f"{prefix}_fork_seconds", "Fork latency (all copies)",
                               buckets=_BUCKETS, registry=self.registry)
        self._failures = PromCounter(f"{prefix}_failures", "Failures by cause", ["cause"],
                                     registry=self.registry)
        states = Gauge("reroll_sandbox_sessions", "Sessions by state", ["state"],
                       registry=self.registry)
        for state in STATES:
            states.labels(state).set_function(lambda s=state: counts()[s])
        self.create_s: deque[float] = deque(maxlen=window)
        self.exec_s: deque[float] = deque(maxlen=window)
        self.fork_s: deque[float] = deque(maxlen=window)
        self.failures: Counter[str] = Counter()

    def created(self, seconds: float) -> None:
        self._create.observe(seconds)
        self.create_s.append(seconds)

    def forked(self, seconds: float) -> None:
        self._fork.observe(seconds)
        self.fork_s.append(seconds)

    def executed(self, result: ExecResult) -> None:
        self._exec.observe(result.total_s)
        self.exec_s.append(result.total_s)
        if result.limit is not None:
            self.failure(result.limit)

    def failure(self, cause: str) -> None:
        self.failures[cause] += 1
        self._failures.labels(cause).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
