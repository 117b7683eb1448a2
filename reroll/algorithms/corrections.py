"""Off-policy corrections for async training and train/inference mismatch.

Two policies are compared on the sampled tokens: the proximal policy pi_old (the trainer's
weights at the start of the step; ``old_logprobs``, recomputed by the trainer) and the behaviour
policy mu (the engine that sampled; ``behaviour_logprobs``, recorded at generation). All inputs
are [B, T] with ``mask`` [B, T]; outputs are detached.

- Truncated importance sampling (TIS): per-token weights w = min(pi_old / mu, cap) at token,
  turn, sequence or geometric level, passed as ``is_weights`` to any policy loss.
- Ratio-based masking (IcePop-style): drop tokens or whole sequences whose pi_old / mu lies
  outside [low, high]; returns a new mask.
Decoupled PPO is ``losses.decoupled_ppo_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .aggregation import LOG_RATIO_CLAMP, masked_mean, turn_sums, turns_to_tokens


def _token_log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    lr = (old_logprobs - behaviour_logprobs).detach()
    return torch.where(mask.bool(), lr, torch.zeros_like(lr))


def _weights(log_w: Tensor, mask: Tensor, cap: float | None) -> Tensor:
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if cap is not None:
        w = w.clamp(max=cap)
    return w * mask.to(w.dtype)


def tis_token_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float | None = 2.0,
    turn_ids: Tensor | None = None,
) -> Tensor:
    """w_t = min(pi_old(y_t) / mu(y_t), cap); [B, T], 0 on invalid tokens. cap=None: no truncation."""
    return _weights(_token_log_ratio(old_logprobs, behaviour_logprobs, mask), mask, cap)


def tis_sequence_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float | None = 2.0,
    turn_ids: Tensor | None = None,
) -> Tensor:
    """w_i = min(prod_t pi_old / mu, cap) = min(exp(sum_t log ratio), cap), on every valid token."""
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask)
    return _weights(lr.sum(-1, keepdim=True).expand_as(lr), mask, cap)


def tis_geometric_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float | None = 2.0,
    turn_ids: Tensor | None = None,
) -> Tensor:
    """w_i = min(exp(mean_t log ratio), cap): the geometric mean of the token ratios of seq i."""
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask)
    mean = masked_mean(lr, mask, -1).unsqueeze(-1)
    return _weights(mean.expand_as(lr), mask, cap)


def tis_turn_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float | None = 2.0,
    turn_ids: Tensor | None = None,
) -> Tensor:
    """w_k = min(exp(sum_{t in turn k} log ratio), cap) on the tokens of turn k (segment level).

    ``turn_ids`` [B, T] is required (0..K-1 per policy token, -1 elsewhere).
    """
    if turn_ids is None:
        raise ValueError("tis_turn_weights needs turn_ids")
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask)
    K = int(turn_ids.max().clamp_min(0)) + 1
    per_turn = turns_to_tokens(turn_sums(lr, turn_ids, K), turn_ids)
    return _weights(per_turn, mask * (turn_ids >= 0), cap)


TIS_LEVELS: dict[str, Callable[..., Tensor]] = {
    "token": tis_token_weights,
    "turn": tis_turn_weights,
    "sequence": tis_sequence_weights,
    "geometric": tis_geometric_weights,
}


def ratio_mask_token(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, low: float = 0.5,
    high: float = 5.0,
) -> Tensor:
    """IcePop-style token mask: keep token t iff low <= pi_old / mu <= high. Returns mask * keep."""
    ratio = torch.exp(_token_log_ratio(old_logprobs, behaviour_logprobs, mask))
    keep = (ratio >= low) & (ratio <= high)
    return mask * keep.to(mask.dtype)


def ratio_mask_sequence(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, low: float = 0.5,
    high: float = 2.0, geometric: bool = True,
) -> Tensor:
    """Sequence mask: keep sequence i iff low <= r_i <= high, where r_i is the geometric mean of
    its token ratios exp(mean_t log ratio) (``geometric=True``) or their product. mask * keep."""
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask)
    seq_lr = masked_mean(lr, mask, -1) if geometric else lr.sum(-1)
    ratio = torch.exp(seq_lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = (ratio >= low) & (ratio <= high)
    return mask * keep.unsqueeze(-1).to(mask.dtype)


def behaviour_kl_k3(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(mu || pi_old) on tokens sampled from mu: [B, T], 0 off mask.

    The tokens come from mu, so Schulman's k3 takes r = pi_old / mu (not mu / pi_old):
    k3 = r - 1 - log r, whose mean under mu is E_mu[-log r] = KL(mu || pi_old) (E_mu[r] = 1).
    The one definition behind `off_policy_metrics` and the actor's `behaviour_kl_k3`.
    """
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask).clamp(-LOG_RATIO_CLAMP,
                                                                        LOG_RATIO_CLAMP)
    return (torch.exp(lr) - 1 - lr) * mask.to(lr.dtype)


def off_policy_metrics(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Mismatch diagnostics over valid tokens: ratio mean / max, k1 and k3 KL(mu || pi_old)."""
    lr = _token_log_ratio(old_logprobs, behaviour_logprobs, mask)
    ratio = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    big = torch.where(mask.bool(), ratio, torch.zeros_like(ratio))
    return {
        "behaviour_ratio_mean": masked_mean(ratio, mask),
        "behaviour_ratio_max": big.max() if big.numel() else big.new_zeros(()),
        "behaviour_kl_k1": masked_mean(-lr, mask),
        "behaviour_kl_k3": masked_mean(behaviour_kl_k3(old_logprobs, behaviour_logprobs, mask),
                                       mask),
    }
