"""Loss aggregation over tokens and sequences, and masked tensor helpers.

Every per-token loss in ``reroll.algorithms`` is reduced to a scalar by :func:`aggregate_loss`.
The normalisers (``num_tokens``, ``num_seqs``, ``max_len``) default to the counts of the batch
at hand; a trainer that splits a batch into micro-batches (or data-parallel shards) passes the
GLOBAL counts, computed once with :func:`loss_normalisers` over the full batch, so that the sum
of the micro-batch losses (and of their gradients) equals the full-batch loss.

Shapes: ``B`` sequences, ``T`` token positions; ``mask`` is 1 on tokens that enter the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Every log ratio (policy/old, old/behaviour, reference/policy) is clamped to +-this before exp,
so that a diverged token cannot give inf (as in verl); it binds only at a ratio beyond e^20."""

LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]


# ----------------------------------------------------------------------------- masked helpers


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) over ``dim`` (all dims when None); masked-out NaN/inf values are ignored."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1) over ``dim``; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of ``x`` (all dims), Bessel-corrected when ``unbiased``.

    Returns 0 when fewer than two (unbiased) or one (biased) entries are valid.
    """
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp_min(1), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid entries (unbiased var, as verl); 0 outside.

    With ``shift_mean=False`` the mean is added back: x' = (x - mean)/std + mean.
    """
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def loss_normalisers(mask: Tensor) -> tuple[float, float]:
    """Counts to pass as global normalisers: (valid tokens, sequences with >= 1 valid token).

    mask: [B, T]. Sum these over all micro-batches / shards of a step and pass the sums as
    ``num_tokens`` / ``num_seqs`` to :func:`aggregate_loss` and every policy loss.
    """
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())


# ----------------------------------------------------------------------------- aggregations


def _default_tokens(mask: Tensor, num_tokens: float | None) -> Tensor | float:
    return mask.sum().clamp_min(1) if num_tokens is None else num_tokens


def _default_seqs(mask: Tensor, num_seqs: float | None) -> Tensor | float:
    return (mask.sum(-1) > 0).sum().clamp_min(1) if num_seqs is None else num_seqs


def token_mean(per_token: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None):
    """sum_{i,t} l_it m_it / num_tokens (DAPO, Lite PPO). num_tokens defaults to sum(mask)."""
    return masked_sum(per_token, mask) / _default_tokens(mask, num_tokens)


def seq_mean_token_mean(
    per_token: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None
):
    """sum_i [ sum_t l_it m_it / sum_t m_it ] / num_seqs (original GRPO).

    A sequence with no valid token contributes 0. num_seqs defaults to the number of sequences
    with at least one valid token.
    """
    per_seq = masked_sum(per_token, mask, -1) / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / _default_seqs(mask, num_seqs)


def seq_mean_token_sum(
    per_token: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None
):
    """sum_i sum_t l_it m_it / num_seqs."""
    return masked_sum(per_token, mask) / _default_seqs(mask, num_seqs)


def seq_mean_token_sum_norm(
    per_token: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None
):
    """sum_i sum_t l_it m_it / max_len / num_seqs (Dr. GRPO: a constant length normaliser).

    ``max_len`` is required (the configured maximum response length, not this batch's T).
    """
    if max_len is None:
        raise ValueError("seq_mean_token_sum_norm needs max_len (the constant length normaliser)")
    return masked_sum(per_token, mask) / max_len / _default_seqs(mask, num_seqs)


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - token_mean:              sum_{i,t} l m / num_tokens
    - seq_mean_token_mean:     sum_i (sum_t l m / sum_t m) / num_seqs
    - seq_mean_token_sum:      sum_i sum_t l m / num_seqs
    - seq_mean_token_sum_norm: sum_i sum_t l m / max_len / num_seqs   (max_len required)

    ``num_tokens`` / ``num_seqs`` default to this batch's counts (valid tokens; sequences with at
    least one valid token). Pass global counts (see :func:`loss_normalisers`) so that summing the
    results over micro-batches / data-parallel shards equals the full-batch value. Sequences
    with zero valid tokens contribute 0, and masked-out NaN values never leak in.
    """
    try:
        fn = LOSS_AGGREGATIONS[mode]
    except KeyError:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; one of {list(LOSS_AGGREGATIONS)}"
        ) from None
    return fn(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


# ----------------------------------------------------------------------------- broadcasting


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Sequence values [B] -> [B, T], equal to values[i] on valid tokens and 0 elsewhere."""
    return values.unsqueeze(-1) * mask.to(values.dtype)


def turns_to_tokens(turn_values: Tensor, turn_ids: Tensor) -> Tensor:
    """Per-turn values [B, K] -> per-token [B, T] via ``turn_ids`` [B, T] (-1 -> 0).

    turn_ids holds, for each policy token, the index 0..K-1 of its turn, and -1 for padding and
    non-policy (prompt / environment) tokens.
    """
    idx = turn_ids.clamp_min(0).long()
    out = torch.gather(turn_values, 1, idx)
    return torch.where(turn_ids >= 0, out, torch.zeros_like(out))


def turn_rewards_to_tokens(turn_rewards: Tensor, turn_ids: Tensor) -> Tensor:
    """Place each turn's reward on that turn's last policy token: [B, K] -> [B, T], 0 elsewhere.

    The token-level form of per-turn rewards for token-level estimators (GAE, REINFORCE++), so a
    discount gamma < 1 sees when each reward came. Rewards of turns without a token are dropped
    (as `turn_valid` drops them for the turn-level estimators). A single-turn response (turn 0
    on every response token) gets its reward on its last token, as `scores_to_token_rewards`.
    """
    B, T = turn_ids.shape
    K = turn_rewards.shape[1]
    pos = torch.arange(T, device=turn_ids.device).expand(B, T)
    idx = torch.where(turn_ids >= 0, turn_ids, K).long()
    last = torch.full((B, K + 1), -1, dtype=torch.long, device=turn_ids.device)
    last = last.scatter_reduce(1, idx, torch.where(turn_ids >= 0, pos, -1), "amax")[:, :K]
    values = torch.where(last >= 0, turn_rewards, torch.zeros_like(turn_rewards))
    out = turn_rewards.new_zeros(B, T + 1)
    out = out.scatter_add(1, torch.where(last >= 0, last, T), values)
    return out[:, :T]


def turn_sums(per_token: Tensor, turn_ids: Tensor, num_turns: int) -> Tensor:
    """Sum of per-token values [B, T] within each turn -> [B, K] (K = num_turns)."""
    out = per_token.new_zeros(per_token.shape[0], num_turns + 1)
    idx = torch.where(turn_ids >= 0, turn_ids, num_turns).long()
    out = out.scatter_add(1, idx, torch.where(turn_ids >= 0, per_token, 0.0))
    return out[:, :num_turns]


def turn_valid(turn_ids: Tensor, num_turns: int) -> Tensor:
    """Bool [B, K]: turn k of row b has at least one policy token."""
    ones = (turn_ids >= 0).to(torch.float32)
    return turn_sums(ones, turn_ids, num_turns) > 0
