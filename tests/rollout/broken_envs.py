"""Environments that fail in the ways a user's env does (`env.id:
tests/rollout/broken_envs.py:Class`): each breaks every episode, or some of them."""

from __future__ import annotations

import asyncio
import itertools


class Healthy:
    """Two turns, reward 1 on the second: a working env to fail against."""

    def reset(self, seed=None):
        return "guess", {}

    def step(self, action):
        self.turn = getattr(self, "turn", 0) + 1
        return "again", float(self.turn == 2), self.turn == 2, False, {}


class ResetRaises(Healthy):
    def reset(self, seed=None):
        raise ConnectionError("sandbox unreachable")


class NonStringObservation(Healthy):
    def reset(self, seed=None):
        return {"board": [1, 2]}, {}


class WrongShape(Healthy):
    def step(self, action):
        return "again", 1.0  # two values, not five


class NaNReward(Healthy):
    def step(self, action):
        return "again", float("nan"), False, False, {}


class NeverReturns(Healthy):
    async def areset(self, seed=None):
        return "guess", {}

    async def astep(self, action):
        await asyncio.Event().wait()


class EveryOtherFails(Healthy):
    """Episodes 0, 2, 4, ... (in the order their envs are made) fail at reset."""

    made = itertools.count()

    def __init__(self):
        self.broken = next(EveryOtherFails.made) % 2 == 0

    def reset(self, seed=None):
        if self.broken:
            raise RuntimeError("lost the sandbox")
        return super().reset(seed)


class FlakyReset(Healthy):
    """The first `failures` resets of the process raise; later ones work."""

    failures = itertools.count()
    limit = 2

    def reset(self, seed=None):
        if next(FlakyReset.failures) < FlakyReset.limit:
            raise TimeoutError("env server busy")
        return super().reset(seed)
