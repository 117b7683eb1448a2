"""Reward functions (RewardFn) and the runner that isolates every call."""

from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.runner import FailureBounds, RewardRunner

__all__ = ["RewardFn", "RewardResult", "RewardRunner", "RewardSample", "build_reward",
           "build_runner"]


def _bytes(megabytes: int | None) -> int | None:
    return megabytes << 20 if megabytes else None


def build_reward(config, device: str = "cpu") -> RewardFn:
    """The RewardFn for a `reward:` config section (chosen by its `type`); `device`: where a
    reward model computes (`cpu` or `cuda:0`, resolved from `reward.device` above this layer)."""
    if config.type == "math":
        from reroll.rewards.math import MathRewardFn

        return MathRewardFn(config.format_weight, config.timeout_s, config.num_workers,
                            _bytes(config.memory_mb))
    if config.type == "code":
        from reroll.rewards.code import CodeReward, CodeRewardConfig

        return CodeReward(CodeRewardConfig(credit=config.credit, time_limit_s=config.time_limit_s,
                                           max_tests=config.max_tests))
    if config.type == "custom":
        from reroll.rewards.custom import CustomRewardFn

        return CustomRewardFn(config.function, config.timeout_s, config.num_workers,
                              _bytes(config.memory_mb))
    if config.type == "python":
        from reroll.rewards.python import python_reward, resolve_recorded

        return python_reward(config, resolve_recorded(config))
    if config.type == "model":
        from reroll.rewards.model import ModelRewardFn

        return ModelRewardFn(config.path, config.batch_size, config.max_wait_s,
                             config.max_tokens, config.system_prompt, device)
    if config.type == "judge":
        raise ValueError("reward.type judge needs an engine: the pipeline builds it "
                         "(reroll.pipelines.judge.build_judge)")
    if config.type == "rules":
        from reroll.rewards.rules import RulesRewardFn

        return RulesRewardFn(config.checks, config.field, config.credit, config.format_weight)
    raise ValueError(f"reward.type {config.type!r} has no implementation")


def build_runner(config, reward_fn: RewardFn | None = None) -> RewardRunner:
    """The reward of a `reward:` config section behind its RewardRunner (time limit, failures
    counted, failure-rate bounds); `reward_fn`, when given, is the reward itself (objects passed
    to `reroll.train`), the section then giving only the limits."""
    return RewardRunner(reward_fn or build_reward(config), config.timeout_s,
                        bounds=FailureBounds(config.max_failure_rate_step,
                                             config.max_failure_rate_run))
