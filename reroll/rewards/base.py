"""The reward contract: a RewardFn scores one finished sample.

Every call is isolated by the caller (`rewards.runner.RewardRunner`): it has a timeout, and a crash,
a time-out or a NaN/inf score becomes a recorded failure (`reward/errors`, `reward/timeouts`), never
a hung run or a NaN loss. A RewardFn that bounds each call itself (a process pool that kills its
worker) says so with `times_itself = True`; the runner then adds no limit of its own, which would
also count the wait for a free worker. It may offer `queue_metrics()` (that wait, per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class RewardSample:
    """What a reward function sees of one finished completion."""

    prompt: str
    response: str
    answer: str | None = None
    """The dataset's reference answer (or test cases, serialised), if any."""
    finish_reason: str = "stop"
    """"stop" (EOS/stop string), "length" (hit max new tokens) or "abort"."""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    score: float
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form details (parsed answer, tests passed, ...), recorded with the rollout."""


@runtime_checkable
class RewardFn(Protocol):
    """`async __call__(sample) -> RewardResult`. Implementations must be picklable when they are
    run in a process pool (CPU-heavy verifiers such as math-verify)."""

    name: str

    async def __call__(self, sample: RewardSample) -> RewardResult: ...
