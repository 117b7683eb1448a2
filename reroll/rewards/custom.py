"""A user's reward function, named by import path in the config (`reward.function: pkg.mod:fn`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.pool import ProcessPool


def resolve(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: the working directory imports
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward.function {path!r} cannot be imported: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module itself is broken: a syntax error, a raise
        raise ConfigError(f"reward.function {path!r}: importing {_where(module_name, e)} failed "
                          f"({type(e).__name__}: {e})") from None
    if not callable(target):
        raise ConfigError(f"reward.function {path!r} is not callable")
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


class CustomRewardFn:
    """Async functions run on the event loop; sync ones in worker processes (isolated, killable)."""

    def __init__(self, function: str, timeout_s: float, num_workers: int = 1):
        self.name = function
        self.fn = resolve(function)
        self.timeout_s = timeout_s
        self.pool = None if inspect.iscoroutinefunction(self.fn) else ProcessPool(num_workers)

    async def __call__(self, sample: RewardSample) -> RewardResult:
        if self.pool is None:
            return as_result(await self.fn(sample))
        return as_result(await self.pool.run(self.fn, sample, timeout=self.timeout_s))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
