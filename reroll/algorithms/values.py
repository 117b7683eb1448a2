"""Critic loss and the AsyPPO mini-critic ensemble helpers.

Shapes: values, old_values, returns, mask [B, T]; an ensemble of M critics is stacked as
[M, B, T].
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate_loss, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.2,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float | Tensor]]:
    """Clipped value loss (PPO): l = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

    Without ``clip_range`` (None): l = 0.5 (V - R)^2. Reduced with ``aggregate_loss``.
    Metrics: clip_frac (valid tokens where the clipped term is the larger), values_mean,
    returns_mean, mse (mean (V - R)^2), all detached, over the valid tokens of this call.
    """
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token = unclipped
        clipped_active = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clip - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = 0.5 * aggregate_loss(
        per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )
    metrics = {
        "clip_frac": masked_mean(clipped_active.float(), mask),
        "values_mean": masked_mean(values.detach(), mask),
        "returns_mean": masked_mean(returns, mask),
        "mse": masked_mean(unclipped.detach(), mask),
    }
    return loss, metrics


def critic_ensemble_mean(values: Tensor) -> Tensor:
    """AsyPPO value estimate: mean over the M mini-critics. [M, B, T] -> [B, T]."""
    return values.mean(0)


def critic_disagreement(values: Tensor) -> Tensor:
    """Inter-critic std (population, over M): [M, B, T] -> [B, T]. For M = 2: |V1 - V2| / 2."""
    return values.std(0, unbiased=False)


def masked_quantile(x: Tensor, mask: Tensor, q: float) -> Tensor:
    """The q-quantile (linear interpolation) of the valid entries of ``x``; 0 if none."""
    vals = x[mask.bool()]
    if vals.numel() == 0:
        return x.new_zeros(())
    return torch.quantile(vals.float(), q).to(x.dtype)


def asyppo_advantage_mask(critic_std: Tensor, mask: Tensor, threshold: float | Tensor) -> Tensor:
    """AsyPPO (Liu et al. 2025): drop tokens where the critics AGREE from the policy loss.

    Returns mask * (critic_std >= threshold): states with std below the threshold add little
    learning signal. ``threshold`` may be a quantile of the valid stds (``masked_quantile``,
    e.g. q = 0.2 masks the 20% most agreed-on tokens). [B, T].
    """
    return mask * (critic_std >= threshold).to(mask.dtype)


def asyppo_entropy_mask(critic_std: Tensor, mask: Tensor, threshold: float | Tensor) -> Tensor:
    """AsyPPO: drop tokens where the critics DIVERGE from the entropy bonus.

    Returns mask * (critic_std <= threshold) (e.g. threshold = ``masked_quantile(std, mask,
    0.8)`` removes the 20% highest-disagreement tokens). [B, T].
    """
    return mask * (critic_std <= threshold).to(mask.dtype)
