"""A vectorised async env: N copies of one environment stepped concurrently.

Each copy's `reset`/`step` runs through `reset_async`/`step_async` (the env's own async variant,
or a worker thread), so N slow I/O-bound steps take about as long as one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from reroll.envs.base import StepResult, reset_async, step_async


class AsyncVectorEnv:
    def __init__(self, make: Callable[[], Any], num_envs: int, step_timeout_s: float | None = None):
        self.envs = [make() for _ in range(num_envs)]
        self.step_timeout_s = step_timeout_s

    def __len__(self) -> int:
        return len(self.envs)

    async def reset(self, seeds: list[int]) -> list[tuple[str, dict[str, Any]]]:
        return await asyncio.gather(*(reset_async(env, seed, self.step_timeout_s)
                                      for env, seed in zip(self.envs, seeds, strict=True)))

    async def step(self, actions: list[str]) -> list[StepResult | BaseException]:
        """One step of every copy; a copy that raises or times out gives its `EnvError` in place
        of its result (the others are unaffected)."""
        return await asyncio.gather(*(step_async(env, action, self.step_timeout_s)
                                      for env, action in zip(self.envs, actions, strict=True)),
                                    return_exceptions=True)
