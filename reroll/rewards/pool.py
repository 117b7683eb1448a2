"""Run CPU-heavy reward code in worker processes, with a hard time limit per call.

Signal-based timeouts (math-verify's) only work in a process's main thread, so verifiers run in
worker processes rather than threads. Workers are plain `python -m reroll.rewards.worker`
subprocesses: unlike multiprocessing's spawn/forkserver they never re-import the user's main
script (a script without an `if __name__ == "__main__"` guard would otherwise break every call),
and unlike fork they do not inherit torch's threads. A call that overruns its limit kills its
worker, which is replaced; the other workers keep going.

The limit counts the call alone: the time a call waits for a free worker is measured apart
(`queue_metrics`, `time/reward_queue_s_mean`). With `memory_bytes`, each worker's memory is capped
(RLIMIT_DATA, see `worker.cap_memory`): an allocation past it raises `MemoryError` in the reward code, which comes
back as the call's error, and the worker is replaced.
"""

from __future__ import annotations

import asyncio
import importlib
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct("!Q")


class CallTimeout(Exception):
    """The call ran past its time limit and its worker was killed."""


class WorkerCrashed(Exception):
    """The worker process died during the call (segfault, out of memory, os._exit)."""


def write_frame(stream, payload: bytes) -> None:
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream) -> bytes | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return stream.read(size)


WARM_UP_TIMEOUT_S = 120.0
"""How long a new worker may take to run its warm-up call (imports, mostly)."""


class Worker:
    """One worker process. `warm_up` (fn, args) is sent at once, so the process imports what
    the calls will need while the caller does other work; its reply is read before the first
    call's."""

    def __init__(self, warm_up: tuple[Callable[..., Any], tuple] | None = None,
                 memory_bytes: int | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reroll.rewards.worker", str(memory_bytes or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        write_frame(self.process.stdin, pickle.dumps(list(sys.path)))
        self.warming_up = warm_up is not None
        self.fresh = True
        if warm_up is not None:
            write_frame(self.process.stdin, pickle.dumps(warm_up))

    def call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
        """`fn(*args)` within `timeout` seconds. A new worker's start-up and the import of `fn`'s
        module are not the call's: they are waited for first (`WARM_UP_TIMEOUT_S`)."""
        if self.warming_up:
            self.warming_up = False
            self._settle()
        if self.fresh:
            self.fresh = False
            module = getattr(fn, "__module__", None)
            if module:
                write_frame(self.process.stdin,
                            pickle.dumps((importlib.import_module, (module,))))
                self._settle()
        write_frame(self.process.stdin, pickle.dumps((fn, args)))
        return self._reply(timeout)

    def _settle(self) -> None:
        """Wait for a preparatory call's reply; its own error is not the call's."""
        try:
            self._reply(WARM_UP_TIMEOUT_S)
        except (CallTimeout, WorkerCrashed):
            raise  # the worker is gone: this call fails, and the pool replaces it
        except Exception:  # noqa: BLE001 - the call itself will tell
            pass

    def _reply(self, timeout: float) -> Any:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise CallTimeout(f"no result within {timeout:g}s")
        frame = read_frame(self.process.stdout)
        if frame is None:
            self.kill()
            raise WorkerCrashed(f"reward worker exited with code {self.process.poll()}")
        ok, value = pickle.loads(frame)
        if not ok:
            if isinstance(value, MemoryError):
                self.kill()  # a process that ran out of memory may be left half-broken
            raise value
        return value

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Workers keep no state, so they are killed: an orderly exit would spend ~0.2 s tearing
        down what the reward code imported."""
        if self.alive():
            self.kill()


class ProcessPool:
    """`await pool.run(fn, *args, timeout=s)` runs `fn(*args)` in one of `num_workers` processes.
    `fn` must be importable by module path (a top-level function). With `warm_up` (fn, args),
    every worker starts now and runs that call first (to import a verifier's libraries while
    the model loads, not during the first step); otherwise workers start on demand."""

    def __init__(self, num_workers: int = 1,
                 warm_up: tuple[Callable[..., Any], tuple] | None = None,
                 memory_bytes: int | None = None):
        self.num_workers = num_workers
        self.warm_up = warm_up
        self.memory_bytes = memory_bytes
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self.restarts = 0
        self.queue_s, self.calls = 0.0, 0  # since the last `queue_metrics`
        if warm_up is not None:
            for _ in range(num_workers):
                self._idle.put(self._new_worker())
            self._started = num_workers

    def _acquire(self) -> Worker:
        with self._lock:
            if self._idle.empty() and self._started < self.num_workers:
                self._started += 1
                return self._new_worker()
        return self._idle.get()

    def _new_worker(self) -> Worker:
        return Worker(self.warm_up, self.memory_bytes)

    def _release(self, worker: Worker) -> None:
        if not worker.alive():
            with self._lock:
                self.restarts += 1
            worker = self._new_worker()
        self._idle.put(worker)

    def _call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
        """`timeout` starts when a worker takes the call, not while the call waits for one."""
        queued = time.perf_counter()
        worker = self._acquire()
        with self._lock:
            self.queue_s += time.perf_counter() - queued
            self.calls += 1
        try:
            return worker.call(fn, args, timeout)
        finally:
            self._release(worker)

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        return await asyncio.to_thread(self._call, fn, args, timeout)

    def queue_metrics(self) -> dict[str, float]:
        """Mean seconds the calls since the last report waited for a free worker."""
        with self._lock:
            mean = self.queue_s / self.calls if self.calls else 0.0
            self.queue_s, self.calls = 0.0, 0
        return {"time/reward_queue_s_mean": mean}

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get().close()
