"""Isolate every reward call: a time limit, crashes contained, failures counted.

A failing call scores `failure_score` (0 by default) and is recorded in the sample's info and in
the metrics `reward/errors` and `reward/timeouts`; training goes on. A score that is not a finite
number (NaN, +-inf) is a failure too: it would otherwise turn the loss, and then every weight,
into NaN. A run whose calls keep failing is stopped (`check_failure_rate`) rather than trained
on failure scores.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from reroll.config.errors import RunStopped
from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.pool import CallTimeout

log = logging.getLogger(__name__)

FLOAT32_MAX = 3.4028234663852886e38
"""Rewards are float32 in the batch: a larger score would become inf there."""


@dataclass
class RewardCounters:
    calls: int = 0
    errors: int = 0
    """Failed calls other than time-outs (exceptions, crashed workers, non-finite scores)."""
    timeouts: int = 0
    nonfinite: int = 0
    """Calls whose score was NaN or infinite (also counted in `errors`)."""
    memory_errors: int = 0
    """Calls that ran out of the reward worker's memory cap (also counted in `errors`)."""

    def failed(self) -> int:
        return self.errors + self.timeouts


@dataclass(frozen=True)
class FailureBounds:
    """When a failing reward stops the run: the share of failed calls (errors + time-outs) at
    which the run stops, over one step and over the whole run."""

    step: float = 1.0
    run: float = 0.5
    min_calls: int = 1
    """Fewer calls than this (a step with almost no samples) are not judged."""


class RewardRunner:
    def __init__(self, reward_fn: RewardFn, timeout_s: float, failure_score: float = 0.0,
                 bounds: FailureBounds | None = None):
        self.reward_fn = reward_fn
        # A reward that bounds each call itself (a process pool that kills its worker, counting
        # only the call, not the wait for a free worker) needs no second limit; for the others
        # (a reward model's or a judge's batch, a trip to a reward actor) this one is the
        # limit, the wait included, as `reward.timeout_s` says.
        self.limit_s = None if getattr(reward_fn, "times_itself", False) else timeout_s
        self.failure_score = failure_score
        self.bounds = bounds or FailureBounds()
        self.counters = RewardCounters()
        self.last_error = ""
        """The latest failed call's error, quoted when the failures stop the run."""
        self._checked = RewardCounters()  # the counters at the last check: the step's window

    async def reward(self, sample: RewardSample) -> RewardResult:
        """The reward of one sample: the reward function's result, or `failure_score` with the
        error in its info when the call failed, timed out or gave a non-finite score."""
        self.counters.calls += 1
        try:
            call = self.reward_fn(sample)
            result = await (call if self.limit_s is None
                            else asyncio.wait_for(call, self.limit_s))
            return self._finite(result)
        except (TimeoutError, CallTimeout) as e:
            self.counters.timeouts += 1
            self.last_error = f"timeout: {e or 'no result'}"
            return RewardResult(self.failure_score, {"error": self.last_error})
        except Exception as e:  # noqa: BLE001 - a broken reward must not stop training
            self.counters.errors += 1
            self.counters.memory_errors += isinstance(e, MemoryError)
            log.warning("reward %s failed: %s: %s", self.reward_fn.name, type(e).__name__, e)
            self.last_error = f"{type(e).__name__}: {e}"
            return RewardResult(self.failure_score, {"error": self.last_error})

    def _finite(self, result: RewardResult) -> RewardResult:
        """A NaN or infinite score (or one past float32's range) is a failed call (counted,
        scored `failure_score`)."""
        try:
            finite = math.isfinite(result.score) and abs(result.score) <= FLOAT32_MAX
        except TypeError:
            finite = False
        if finite:
            return result
        self.counters.errors += 1
        self.counters.nonfinite += 1
        self.last_error = f"non-finite score: {result.score!r}"
        log.warning("reward %s returned a non-finite score (%r)", self.reward_fn.name,
                    result.score)
        return RewardResult(self.failure_score,
                            {**result.info, "error": f"non-finite score: {result.score!r}"})

    def metrics(self) -> dict[str, float]:
        """Cumulative counts since the start of the run, and the reward workers' queueing."""
        c = self.counters
        metrics = {"reward/errors": float(c.errors), "reward/timeouts": float(c.timeouts),
                   "reward/nonfinite": float(c.nonfinite),
                   "reward/memory_errors": float(c.memory_errors)}
        queue = getattr(self.reward_fn, "queue_metrics", None)
        return metrics | (queue() if queue is not None else {})

    def check_failure_rate(self, step: int) -> None:
        """Stop the run (RunStopped) when the share of failed reward calls since the last check
        (one step, with its evaluation) or since the start reaches its bound."""
        c, last, b = self.counters, self._checked, self.bounds
        self._checked = RewardCounters(**vars(c))
        windows = (("step", c.calls - last.calls, c.failed() - last.failed(), b.step),
                   ("run so far", c.calls, c.failed(), b.run))
        for name, calls, failed, bound in windows:
            if calls >= b.min_calls and failed / calls >= bound:
                raise RunStopped(
                    f"step {step}: reward {self.reward_fn.name!r} failed on {failed} of {calls} "
                    f"calls this {name} ({failed / calls:.0%}; {c.errors} errors, {c.timeouts} "
                    f"time-outs, {c.nonfinite} non-finite scores since the start), at or past "
                    f"the bound of {bound:.0%} (reward.max_failure_rate_"
                    f"{'step' if name == 'step' else 'run'}); the last: "
                    f"{self.last_error[:300] or 'in the run log'}")

    def counter_state(self) -> dict:
        """The counts a checkpoint keeps: the runner's, and the reward's own (a judge's
        requests, a reward model's batches) where it offers `counter_state()`."""
        own = getattr(self.reward_fn, "counter_state", None)
        return dict(vars(self.counters)) | ({"reward_fn": own()} if own is not None else {})

    def load_counters(self, state: dict) -> None:
        """Continue the counts of a resumed run (the next step's window starts here)."""
        state = dict(state)
        own = state.pop("reward_fn", None)
        if own is not None and hasattr(self.reward_fn, "load_counter_state"):
            self.reward_fn.load_counter_state(own)
        vars(self.counters).update(state)
        self._checked = RewardCounters(**vars(self.counters))

    def close(self) -> None:
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()
