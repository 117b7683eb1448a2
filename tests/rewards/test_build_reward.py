"""One builder for every reward (issue 44): `rewards.build_reward` matches on the typed `reward:`
union, so every type a config can name is built there, and a model-backed reward gets what sits
above the rewards layer (its device, a judge's engine) injected."""

from __future__ import annotations

import ast
import asyncio
import inspect
import typing

import pytest

from reroll import rewards
from reroll.config.rewards import JudgeReward, MathReward, RewardConfig
from reroll.rewards import build_reward
from reroll.rewards.base import RewardSample
from reroll.rewards.judge import JudgeRewardFn

pytestmark = pytest.mark.unit


def union_members(annotated) -> set[str]:
    union = typing.get_args(annotated)[0]
    return {typing.get_args(member)[0].__name__ for member in typing.get_args(union)}


def test_every_reward_type_of_the_config_has_a_case_in_the_builder():
    tree = ast.parse(inspect.getsource(rewards.build_reward))
    cases = {node.pattern.cls.id for node in ast.walk(tree)
             if isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchClass)}
    assert union_members(RewardConfig) == cases


def test_a_judge_is_built_over_the_engine_it_is_given():
    """The judge's engine is injected: the built reward asks it, parses the verdict with the
    section's parser, and closes it with the reward."""
    seen, closed = [], []

    async def generate(prompt: str, attempt: int) -> str:
        seen.append(prompt)
        return "yes" if "Response: 42\n" in prompt else "no"

    def engine(config):
        assert isinstance(config, JudgeReward)
        return generate, lambda: closed.append(True)

    section = JudgeReward(model="unused", choices={"yes": 1.0, "no": 0.0})
    fn = build_reward(section, judge_engine=engine)
    assert isinstance(fn, JudgeRewardFn)
    async def score(response):
        return (await fn(RewardSample("What is 6*7?", response, "42"))).score

    assert asyncio.run(score("42")) == 1.0 and asyncio.run(score("41")) == 0.0
    assert len(seen) == 2
    fn.close()
    assert closed == [True]


def test_a_judge_without_its_engine_says_what_to_pass():
    with pytest.raises(ValueError, match="judge_engine"):
        build_reward(JudgeReward(model="unused"))


def test_a_rule_based_reward_needs_nothing_injected():
    fn = build_reward(MathReward())
    assert type(fn).__name__ == "MathRewardFn"
    fn.close()
