"""Reward functions (RewardFn) and the runner that isolates every call."""

from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.runner import RewardRunner

__all__ = ["RewardFn", "RewardResult", "RewardRunner", "RewardSample", "build_reward"]


def build_reward(config) -> RewardFn:
    """The RewardFn for a `reward:` config section (chosen by its `type`)."""
    from reroll.rewards.math import MathRewardFn

    if config.type == "math":
        return MathRewardFn(config.format_weight, config.timeout_s, config.num_workers)
    raise ValueError(f"reward.type {config.type!r} has no implementation")
