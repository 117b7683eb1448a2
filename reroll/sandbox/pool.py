"""`SandboxPool`: the sandbox manager — a concurrency limit, warm sandboxes, health, metrics.

    async with SandboxPool(concurrency=8) as pool:
        results = await asyncio.gather(*(pool.run(code, stdin=s) for s in inputs))
        pool.metrics()   # executions/s, queue wait and latency p50/p99, failures by cause

Warm sandboxes are started ahead of time and wait, idle, for a job. Each one runs exactly one job
and is then destroyed; a replacement starts in the background. Executions therefore never share
a process, a filesystem or a namespace, while the start-up (bubblewrap and the interpreter) is off
the request's path. A pool belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reroll.sandbox.limits import Limits, PoolConfig, SandboxConfig
from reroll.sandbox.metrics import PoolMetrics
from reroll.sandbox.process import SandboxProcess
from reroll.sandbox.result import ExecResult, SandboxError, SandboxLost
from reroll.sandbox.sandbox import Sandbox

logger = logging.getLogger(__name__)

_HEALTH_PROBE = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"


@dataclass(frozen=True)
class Health:
    ok: bool
    backend: str
    latency_s: float
    detail: str


def _destroy_idle(idle: deque[SandboxProcess]) -> None:
    """Finalizer: no warm sandbox outlives a pool that was not closed."""
    while idle:
        idle.popleft().destroy_now()


class SandboxPool:
    """Runs programs like `Sandbox.run`, at most ``concurrency`` at a time, on warm sandboxes."""

    def __init__(
        self,
        sandbox: Sandbox | SandboxConfig | None = None,
        config: PoolConfig | None = None,
        *,
        limits: Limits | None = None,
        concurrency: int | None = None,
        warm: int | None = None,
    ) -> None:
        self.sandbox = sandbox if isinstance(sandbox, Sandbox) else Sandbox(sandbox, limits)
        config = config or PoolConfig()
        updates = {k: v for k, v in (("concurrency", concurrency), ("warm", warm)) if v is not None}
        self.config = PoolConfig(**{**config.model_dump(), **updates}) if updates else config
        self.warm_target = (
            self.config.concurrency + 1 if self.config.warm is None else self.config.warm
        )
        self._idle: deque[SandboxProcess] = deque()
        self._spawning: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(self.config.concurrency)
        self._in_flight = 0
        self._closed = False
        self._metrics = PoolMetrics(self.config.latency_window)
        self._finalizer = weakref.finalize(self, _destroy_idle, self._idle)

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check that the backend works (raises `SandboxError` with the reason if not) and start
        the warm sandboxes."""
        health = await self.health_check()
        if not health.ok:
            raise SandboxError(f"sandbox health check failed: {health.detail}")
        self._replenish()

    async def close(self) -> None:
        """Stop starting sandboxes and destroy the idle ones. Running executions finish."""
        self._closed = True
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        while self._idle:
            await self._idle.popleft().destroy()

    async def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Same contract as `Sandbox.run`; waits for a free slot first."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        called_at = time.perf_counter()
        job = self.sandbox.job(code, argv=argv, files=files, stdin=stdin, limits=limits, env=env)
        async with self._slots:
            queue_s = time.perf_counter() - called_at
            self._in_flight += 1
            try:
                proc, warm = await self._acquire(job.limits.tmpfs_bytes)
                try:
                    result = await self.sandbox.execute(proc, job, called_at, queue_s, warm)
                except SandboxLost:
                    if not warm:
                        raise
                    self._metrics.record_failure("slot_died")  # died idle: retry on a fresh one
                    proc = await self.sandbox.start(job.limits.tmpfs_bytes)
                    result = await self.sandbox.execute(proc, job, called_at, queue_s, False)
            except SandboxError:
                self._metrics.record_failure("sandbox_error")
                raise
            finally:
                self._in_flight -= 1
                # Replacements start after the run, so their start-up does not delay this one.
                self._replenish()
        self._metrics.record(result)
        return result

    async def _acquire(self, tmpfs_bytes: int) -> tuple[SandboxProcess, bool]:
        """A warm sandbox of the right size if one is idle, else one started now."""
        keep: list[SandboxProcess] = []
        found = None
        while self._idle:
            proc = self._idle.popleft()
            if not proc.alive:
                self._metrics.record_failure("slot_died")
                await proc.destroy()
            elif proc.tmpfs_bytes != tmpfs_bytes:
                keep.append(proc)
            else:
                found = proc
                break
        self._idle.extend(keep)
        if found is not None:
            return found, True
        try:
            proc = await self.sandbox.start(tmpfs_bytes)
        except SandboxError:
            self._metrics.record_failure("spawn_error")
            raise
        self._metrics.record_spawn(proc.spawn_s)
        return proc, False

    def _replenish(self) -> None:
        while not self._closed and len(self._idle) + len(self._spawning) < self.warm_target:
            task = asyncio.get_running_loop().create_task(self._spawn_warm())
            self._spawning.add(task)
            task.add_done_callback(self._spawning.discard)

    async def _spawn_warm(self) -> None:
        try:
            proc = await self.sandbox.start()
        except SandboxError as exc:
            self._metrics.record_failure("spawn_error")
            logger.warning("could not start a warm sandbox: %s", exc)
            return
        self._metrics.record_spawn(proc.spawn_s)
        if self._closed:
            await proc.destroy()
        else:
            self._idle.append(proc)

    async def health_check(self) -> Health:
        """Run a probe program end to end and drop idle sandboxes that died."""
        for proc in [p for p in self._idle if not p.alive]:
            self._idle.remove(proc)
            self._metrics.record_failure("slot_died")
            await proc.destroy()
        backend = self.sandbox.backend.name
        started = time.perf_counter()
        try:
            result = await self.sandbox.run(_HEALTH_PROBE, stdin="20 22")
        except SandboxError as exc:
            return Health(False, backend, time.perf_counter() - started, str(exc))
        latency = time.perf_counter() - started
        if result.ok and result.stdout.strip() == "42":
            return Health(True, backend, latency, "ok")
        detail = f"probe exit {result.exit_code}, limit {result.limit}: {result.stderr[-500:]}"
        return Health(False, backend, latency, detail)

    def metrics(self) -> dict[str, float | int | dict[str, int]]:
        """Throughput, queue wait, latency p50/p99 (ms), failures by cause, pool occupancy."""
        snap = self._metrics.snapshot()
        snap.update(
            in_flight=self._in_flight, idle=len(self._idle), concurrency=self.config.concurrency
        )
        return snap

    @property
    def idle(self) -> int:
        return len(self._idle)
