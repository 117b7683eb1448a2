"""The records of a rollout: a prompt's group of samples, each sample's life
(queued -> running -> finished -> rewarded -> kept | filtered | aborted), and what a `collect`
returns. Records only (and each request's seed): the scheduler (`reroll.rollout.scheduler`) moves
them, the tail batcher and the async buffer read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow
from reroll.data.images import image_parts
from reroll.engines.base import Completion


class State(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    REWARDED = "rewarded"
    KEPT = "kept"
    FILTERED = "filtered"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sample:
    """One response of a group, possibly generated in several pieces (partial rollout)."""

    seed: int
    engine: int = 0
    state: State = State.QUEUED
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """The policy version that generated each token (they differ after a resumed request)."""
    finish_reason: str = "abort"
    request_id: str | None = None
    resumes: int = 0
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)
    response_text: str = ""
    history: list[State] = field(default_factory=lambda: [State.QUEUED])
    dropped: bool = False
    """A spare speculative sample that is no longer needed: it is aborted, never resumed."""
    routed_experts: torch.Tensor | None = None
    """The engine's routing record of prompt and response (`Completion.routed_experts`): the
    latest piece's, whose prompt holds the earlier pieces."""

    def move(self, state: State) -> None:
        self.state = state
        self.history.append(state)

    def add(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.token_versions += (completion.token_versions
                                or [completion.policy_version] * len(completion.token_ids))
        self.finish_reason = completion.finish_reason
        self.routed_experts = completion.routed_experts

    @property
    def oldest_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None


@dataclass
class Group:
    """The n samples of one prompt; `index` is its launch order within one `collect`."""

    index: int
    row: PromptRow
    prompt_ids: list[int]
    engine: int
    samples: list[Sample]
    kept: bool | None = None
    start_version: int = 0
    cancelled: bool = False
    model_inputs: dict = field(default_factory=dict)
    """The prompt's model inputs beyond `prompt_ids` (images...), sent with each request and
    kept on each trajectory ({}: tokens only)."""
    images: list = field(default_factory=list)
    """The prompt's images the model inputs were built from, sent with each request."""
    scorer: Any = None
    """The `RewardRunner` that scores this group's samples (None: the scheduler's own). A
    multi-domain run's groups carry their domain's."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def version(self) -> int:
        """The oldest policy version behind any of its tokens (staleness is measured from it)."""
        versions = [s.oldest_version for s in self.samples if s.oldest_version is not None]
        return min(versions, default=self.start_version)

    def trajectories(self, group_id: int, version: int | None = None) -> list[Trajectory]:
        return [Trajectory(
            prompt_ids=self.prompt_ids, response_ids=s.tokens, behaviour_logprobs=s.logprobs,
            finish_reason=s.finish_reason, group_id=group_id, prompt_text=self.row.prompt_text,
            response_text=s.response_text, answer=self.row.answer, reward=s.reward,
            reward_info=s.reward_info, policy_version=self.version if version is None else version,
            tag=self.row.tag, model_inputs=self.model_inputs or None,
            images=[part["image"] for part in image_parts(self.row.messages)] or None,
            routed_experts=s.routed_experts)
            for s in self.samples]

    def mark(self, state: State) -> int:
        """Move the samples whose life has not ended to `state`; returns how many moved."""
        moving = [s for s in self.samples if s.state not in ENDED]
        for s in moving:
            s.move(state)
        return len(moving)


ENDED = (State.KEPT, State.FILTERED, State.ABORTED)


@dataclass
class CollectResult:
    groups: list[Group]
    """The kept groups, in launch order."""
    unused_rows: list[PromptRow]
    """Rows launched after the last kept group (aborted or surplus): hand them back to the stream."""
    metrics: dict[str, float]
    dropped: list[Group] = field(default_factory=list)
    """The groups that failed `keep` before the batch was decided."""


KeepFn = Callable[[Group], bool]
SeedFn = Callable[[int], int]


def keep_all(group: Group) -> bool:
    return True


def request_seed(run_seed: int, step: int, index: int) -> int:
    """A distinct, reproducible sampling seed per (run, step, sample)."""
    return ((run_seed * 1_000_003 + step) * 65_537 + index) % (2**63)
