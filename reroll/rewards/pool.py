"""Run CPU-heavy reward code in worker processes, with a hard time limit per call.

Signal-based timeouts (math-verify's) only work in a process's main thread, so verifiers run in
a process pool rather than threads. A call that overruns its limit is not merely abandoned: the
pool is torn down (its processes killed) and rebuilt, so a hung verifier cannot pile up.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any


class CallTimeout(Exception):
    """The call ran past its time limit and its worker was killed."""


class ProcessPool:
    def __init__(self, num_workers: int = 1):
        self.num_workers = num_workers
        self._executor: ProcessPoolExecutor | None = None
        self.restarts = 0

    def _get(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # forkserver: never fork a process that already runs torch's threads.
            context = multiprocessing.get_context("forkserver")
            self._executor = ProcessPoolExecutor(self.num_workers, mp_context=context)
        return self._executor

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        executor = self._get()
        future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self._kill(executor)
            raise CallTimeout(f"no result within {timeout:g}s") from None
        except BrokenProcessPool:
            # Another call's timeout killed the pool under this one, or a worker died (segfault,
            # OOM): rebuild and report this call as a crash.
            self._kill(executor)
            raise

    def _kill(self, executor: ProcessPoolExecutor) -> None:
        if self._executor is not executor:
            return  # already replaced
        self._executor = None
        self.restarts += 1
        for process in list((executor._processes or {}).values()):
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
