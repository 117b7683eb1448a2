"""Turn prompts into scored trajectories: a group of n requests per prompt, each reward computed
as soon as its completion finishes (so reward work overlaps generation)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptRow
from reroll.engines.base import Engine, Request, SamplingParams
from reroll.rewards.base import RewardSample
from reroll.rewards.runner import RewardRunner


def encode_prompt(tokenizer, row: PromptRow, max_tokens: int) -> list[int]:
    """Chat-templated prompt ids, ending with the assistant turn's header."""
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if len(ids) > max_tokens:
        raise ConfigError(f"{row.source}: the prompt is {len(ids)} tokens after the chat template, "
                          f"over data.max_prompt_tokens={max_tokens}")
    return ids


def request_seed(run_seed: int, step: int, index: int) -> int:
    """A distinct, reproducible sampling seed per (run, step, sample)."""
    return ((run_seed * 1_000_003 + step) * 65_537 + index) % (2**63)


@dataclass
class RolloutJob:
    """What a rollout needs: the engine that samples, the rewards that score, how to sample."""

    engine: Engine
    rewards: RewardRunner
    tokenizer: object
    params: SamplingParams
    max_prompt_tokens: int


async def _one(job: RolloutJob, row: PromptRow, prompt_ids: list[int], seed: int,
               group_id: int, version: int) -> Trajectory:
    completion = await job.engine.generate(Request(prompt_ids, job.params, seed=seed))
    response_text = job.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    result = await job.rewards.score(RewardSample(
        prompt=row.prompt_text, response=response_text, answer=row.answer,
        finish_reason=completion.finish_reason, metadata=row.metadata))
    return Trajectory(
        prompt_ids=prompt_ids, response_ids=completion.token_ids,
        behaviour_logprobs=completion.logprobs, finish_reason=completion.finish_reason,
        group_id=group_id, prompt_text=row.prompt_text, response_text=response_text,
        answer=row.answer, reward=result.score, reward_info=result.info,
        policy_version=completion.policy_version if version < 0 else version)


def rollout(job: RolloutJob, rows: list[PromptRow], group_size: int, run_seed: int,
            step: int, version: int = -1) -> list[Trajectory]:
    """`group_size` scored trajectories per row, in row-major order (a group is contiguous)."""

    async def run() -> list[Trajectory]:
        tasks = []
        for g, row in enumerate(rows):
            prompt_ids = encode_prompt(job.tokenizer, row, job.max_prompt_tokens)
            for k in range(group_size):
                seed = request_seed(run_seed, step, g * group_size + k)
                tasks.append(_one(job, row, prompt_ids, seed, g, version))
        return await asyncio.gather(*tasks)

    return asyncio.run(run())
