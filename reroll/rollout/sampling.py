"""Turn prompts into scored trajectories: a group of n requests per prompt, each reward computed
as soon as its completion finishes (so reward work overlaps generation)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow
from reroll.engines.base import Engine, SamplingParams
from reroll.rewards.runner import RewardRunner
from reroll.rollout.groups import request_seed
from reroll.rollout.scheduler import RolloutScheduler
from reroll.rollout.stream import encode_prompt


@dataclass
class RolloutJob:
    """What a rollout needs: the engine that samples, the rewards that score, how to sample."""

    engine: Engine
    rewards: RewardRunner
    tokenizer: object
    params: SamplingParams
    max_prompt_tokens: int


def rollout(job: RolloutJob, rows: list[PromptRow], group_size: int, run_seed: int,
            step: int, version: int = -1) -> list[Trajectory]:
    """`group_size` scored trajectories per row, in row-major order (a group is contiguous).
    `version` >= 0 overrides the policy version recorded on the trajectories."""
    scheduler = RolloutScheduler([job.engine], job.rewards, job.tokenizer)
    result = asyncio.run(scheduler.collect(
        iter(rows), lambda row: encode_prompt(job.tokenizer, row, job.max_prompt_tokens),
        len(rows), group_size, job.params, lambda i: request_seed(run_seed, step, i)))
    return [t for g, group in enumerate(result.groups)
            for t in group.trajectories(g, None if version < 0 else version)]
