"""The `algorithm:` section: advantage estimator, policy loss, aggregation, KL and entropy.

Each choice is a typed union told apart by `name`; `reroll/pipelines/objective.py` maps a chosen
model to the pure functions of `reroll.algorithms`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reroll.config.base import Section, choice


class GRPOAdvantage(Section):
    """Group-normalised outcome reward (DeepSeekMath): (r - mean_group) / (std_group + eps)."""

    name: Literal["grpo"] = "grpo"
    scale_by_std: bool = True
    """Divide by the group std (False gives Dr. GRPO's mean-centred advantage)."""
    eps: float = Field(1e-6, gt=0)


AdvantageConfig = choice("name", "grpo", GRPOAdvantage)


class PPOLoss(Section):
    """PPO's clipped surrogate with separate low/high clip (DAPO's clip-higher) and optional dual clip."""

    name: Literal["ppo"] = "ppo"
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.2, ge=0, le=10)
    dual_clip: float | None = Field(None, gt=1)
    """For negative advantages also bound the loss by `dual_clip * |A|` (Ye et al. 2020); None: off."""


PolicyLossConfig = choice("name", "ppo", PPOLoss)


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of the KL(policy || reference) loss term. 0 turns it off and the reference model
    is not loaded at all."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator (Schulman's 'Approximating KL divergence')."""


class AlgorithmConfig(Section):
    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantage)
    """How rewards become per-token advantages; chosen by `name`."""
    policy_loss: PolicyLossConfig = Field(default_factory=PPOLoss)
    """The policy objective; chosen by `name`."""
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = "token_mean"
    """How per-token losses become one number; normalisers are global over the step's batch."""
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (entropy is always logged)."""
    updates_per_batch: int = Field(1, ge=1, le=16)
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches, one
    step each (PPO mini-batches). With 1 the update is exactly on-policy, so the old logprobs are
    the current ones and no extra forward pass is spent on them."""
