"""Reward functions (RewardFn), the one builder of a `reward:` section's RewardFn, and the runner
that isolates every call."""

from collections.abc import Callable

from reroll.config.rewards import (
    CodeReward,
    CustomReward,
    JudgeReward,
    MathReward,
    ModelReward,
    PythonReward,
    RewardSection,
    RulesReward,
)
from reroll.rewards.base import RewardFn, RewardResult, RewardSample
from reroll.rewards.judge import Generate
from reroll.rewards.runner import FailureBounds, RewardRunner

__all__ = ["RewardFn", "RewardResult", "RewardRunner", "RewardSample", "build_reward",
           "build_runner"]


def _bytes(megabytes: int | None) -> int | None:
    return megabytes << 20 if megabytes else None


JudgeEngine = Callable[["JudgeReward"], tuple[Generate, Callable[[], None]]]
"""What a judge reward is given from above this layer: its section -> (`generate`, close), the
judge model served by an engine (engines sit above rewards)."""


def build_reward(config: RewardSection, device: str = "cpu",
                 judge_engine: JudgeEngine | None = None) -> RewardFn:
    """The RewardFn of a `reward:` config section, matched on its type. Model-backed rewards get
    what they cannot build here injected: `device`, where a reward model computes (`cpu` or
    `cuda:0`, `reward.device` resolved in the process that builds it); `judge_engine`, the
    judge's engine (`reroll.pipelines.judge.judge_engine`)."""
    match config:
        case MathReward():
            from reroll.rewards.math import MathRewardFn

            return MathRewardFn(config.format_weight, config.timeout_s, config.num_workers,
                                _bytes(config.memory_mb))
        case CodeReward():
            from reroll.rewards.code import CodeRewardConfig, CodeRewardFn

            return CodeRewardFn(CodeRewardConfig(credit=config.credit,
                                                 time_limit_s=config.time_limit_s,
                                                 max_tests=config.max_tests))
        case CustomReward():
            from reroll.rewards.custom import CustomRewardFn

            return CustomRewardFn(config.function, config.timeout_s, config.num_workers,
                                  _bytes(config.memory_mb))
        case PythonReward():
            from reroll.rewards.python import python_reward, resolve_recorded

            return python_reward(config, resolve_recorded(config))
        case ModelReward():
            from reroll.rewards.model import ModelRewardFn

            return ModelRewardFn(config.path, config.batch_size, config.max_wait_s,
                                 config.max_tokens, config.system_prompt, device)
        case JudgeReward():
            from reroll.rewards.judge import JudgeRewardFn, judge_parser

            if judge_engine is None:
                raise ValueError("reward.type judge needs its engine: pass `judge_engine` "
                                 "(reroll.pipelines.judge.judge_engine)")
            generate, close = judge_engine(config)
            return JudgeRewardFn(generate, config.template, judge_parser(config),
                                 config.retries, config.cache, close=close)
        case RulesReward():
            from reroll.rewards.rules import RulesRewardFn

            return RulesRewardFn(config.checks, config.field, config.credit,
                                 config.format_weight)
    raise ValueError(f"reward.type {config.type!r} has no implementation")


def build_runner(config, reward_fn: RewardFn | None = None) -> RewardRunner:
    """The reward of a `reward:` config section behind its RewardRunner (time limit, failures
    counted, failure-rate bounds); `reward_fn`, when given, is the reward itself (objects passed
    to `reroll.train`), the section then giving only the limits."""
    return RewardRunner(reward_fn or build_reward(config), config.timeout_s,
                        bounds=FailureBounds(config.max_failure_rate_step,
                                             config.max_failure_rate_run))
