"""Reward functions (RewardFn) and the runner that isolates every call."""

from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.runner import RewardRunner

__all__ = ["RewardFn", "RewardResult", "RewardRunner", "RewardSample", "build_reward"]


def build_reward(config) -> RewardFn:
    """The RewardFn for a `reward:` config section (chosen by its `type`)."""
    if config.type == "math":
        from reroll.rewards.math import MathRewardFn

        return MathRewardFn(config.format_weight, config.timeout_s, config.num_workers)
    if config.type == "code":
        from reroll.rewards.code import CodeReward, CodeRewardConfig

        return CodeReward(CodeRewardConfig(credit=config.credit, time_limit_s=config.time_limit_s,
                                           max_tests=config.max_tests))
    if config.type == "custom":
        from reroll.rewards.custom import CustomRewardFn

        return CustomRewardFn(config.function, config.timeout_s, config.num_workers)
    raise ValueError(f"reward.type {config.type!r} has no implementation")
