"""A user's reward function, named by import path in the config (`reward.function: pkg.mod:fn`)
or passed as a Python object (`reroll.train(..., reward_funcs=[fn])`)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.pool import CallTimeout, ProcessPool

BLOCKED_GRACE_S = 0.5
"""How long past its limit an async call may go before its loop is taken for blocked."""


def resolve(path: str, field: str = "reward.function") -> Callable:
    module_name, _, attr = path.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: the working directory imports
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field} {path!r} cannot be imported: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module itself is broken: a syntax error, a raise
        raise ConfigError(f"{field} {path!r}: importing {_where(module_name, e)} failed "
                          f"({type(e).__name__}: {e})") from None
    if not callable(target):
        raise ConfigError(f"{field} {path!r} is not callable")
    return target


def _where(module_name: str, error: Exception) -> str:
    """`file:line` of a syntax error, else the module's file."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else module_name


def as_result(value: float | RewardResult) -> RewardResult:
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RewardResult(float(value))
    raise TypeError(f"a reward function must return a number or RewardResult, got {type(value).__name__}")


class LoopThread:
    """An event loop in a daemon thread for async reward functions.

    An `async def` that blocks (time.sleep, CPU work) blocks the loop it runs on; on the run's own
    loop that would stall generation and every other call, past any `asyncio.wait_for`. Here the
    caller's loop only waits on a future, so it can give up at the limit. A loop still blocked
    `BLOCKED_GRACE_S` after a call's limit is abandoned (it stops once the blocking call returns)
    and a fresh one takes the next calls."""

    def __init__(self) -> None:
        self.loop = self._start()

    @staticmethod
    def _start() -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()

        def run() -> None:
            loop.run_forever()
            loop.close()

        threading.Thread(target=run, name="reroll-async-reward", daemon=True).start()
        return loop

    async def run(self, fn: Callable, sample: RewardSample, timeout: float):
        loop = self.loop
        inner = asyncio.run_coroutine_threadsafe(asyncio.wait_for(fn(sample), timeout), loop)
        result = asyncio.wrap_future(inner)
        done, _ = await asyncio.wait({result}, timeout=timeout + BLOCKED_GRACE_S)
        if done:
            return result.result()  # a time-out the loop itself noticed raises TimeoutError
        inner.cancel()
        result.cancel()
        if loop is self.loop:  # the loop did not even get to time the call out: it is blocked
            self.loop = self._start()
            loop.call_soon_threadsafe(loop.stop)
        raise CallTimeout(f"no result within {timeout:g}s (the reward blocked its event loop)")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class ByValue:
    """A function sent to the reward worker processes pickled with cloudpickle: a lambda, a
    closure or a function of a script run as `__main__` cannot be pickled by name (plain pickle)
    for a process that never imported them. Pickled once, here; each call's frame carries the
    bytes (keep such functions light: a closure over a large object is sent with every call)."""

    def __init__(self, fn: Callable, name: str):
        import cloudpickle

        try:
            self.payload = cloudpickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - anything unpicklable it holds (a lock, a socket)
            raise ConfigError(f"{name}: cannot be sent to the reward worker "
                              f"processes ({type(e).__name__}: {e}); make it `async def` (it "
                              f"then runs in this process) or drop what it holds") from None

    def __call__(self, *args):
        import cloudpickle

        return cloudpickle.loads(self.payload)(*args)


class CustomRewardFn:
    """Async functions run on an event loop of their own (in a thread); sync ones in worker
    processes (isolated, killable, memory-capped). Both are held to `timeout_s` per call."""

    times_itself = True
    """Every call is bounded here (the pool's limit counts the call, not the wait for a worker)."""

    def __init__(self, function: str | Callable, timeout_s: float, num_workers: int = 1,
                 memory_bytes: int | None = None, name: str | None = None):
        """`function`: an import path, or the function itself (`name` then names it)."""
        self.name = name or str(function)
        self.fn = resolve(function) if isinstance(function, str) else function
        self.timeout_s = timeout_s
        if inspect.iscoroutinefunction(self.fn):
            self.pool, self.loop = None, LoopThread()
        else:
            self.pool, self.loop = ProcessPool(num_workers, memory_bytes=memory_bytes), None
            if not isinstance(function, str):  # a lambda or a script's function: by value
                self.fn = ByValue(self.fn, self.name)
            self.queue_metrics = self.pool.queue_metrics

    async def __call__(self, sample: RewardSample) -> RewardResult:
        if self.pool is None:
            return as_result(await self.loop.run(self.fn, sample, self.timeout_s))
        return as_result(await self.pool.run(self.fn, sample, timeout=self.timeout_s))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.loop is not None:
            self.loop.close()
