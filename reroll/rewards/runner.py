"""Isolate every reward call: a time limit, crashes contained, failures counted.

A failing call scores `failure_score` (0 by default) and is recorded in the sample's info and in
the metrics `reward/errors` and `reward/timeouts`; training goes on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.pool import CallTimeout

log = logging.getLogger(__name__)


@dataclass
class RewardCounters:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0


class RewardRunner:
    def __init__(self, reward_fn: RewardFn, timeout_s: float, failure_score: float = 0.0):
        self.reward_fn = reward_fn
        # The reward may enforce its own limit (killing its worker); this outer one is the backstop.
        self.timeout_s = timeout_s + 2.0
        self.failure_score = failure_score
        self.counters = RewardCounters()

    async def score(self, sample: RewardSample) -> RewardResult:
        self.counters.calls += 1
        try:
            return await asyncio.wait_for(self.reward_fn(sample), self.timeout_s)
        except (TimeoutError, CallTimeout) as e:
            self.counters.timeouts += 1
            return RewardResult(self.failure_score, {"error": f"timeout: {e or 'no result'}"})
        except Exception as e:  # noqa: BLE001 - a broken reward must not stop training
            self.counters.errors += 1
            log.warning("reward %s failed: %s: %s", self.reward_fn.name, type(e).__name__, e)
            return RewardResult(self.failure_score, {"error": f"{type(e).__name__}: {e}"})

    def metrics(self) -> dict[str, float]:
        """Cumulative counts since the start of the run."""
        return {"reward/errors": float(self.counters.errors),
                "reward/timeouts": float(self.counters.timeouts)}

    def close(self) -> None:
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()
