"""Sampling-side filters and reward shaping: overlong handling and dynamic sampling."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Drop truncated responses from the loss: mask [B, T], truncated bool [B] -> mask [B, T].

    Rows with ``truncated`` set become all 0 (DAPO's overlong filtering).
    """
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)


def dapo_overlong_penalty(
    lengths: Tensor, max_len: int, cache_len: int, *, penalty: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), added to the reward. lengths [B] -> [B].

        0                                   if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache * penalty   if L_max - L_cache < L <= L_max
        -penalty                            if L > L_max
    """
    if not 0 < cache_len <= max_len:
        raise ValueError("need 0 < cache_len <= max_len")
    lengths = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    start = max_len - cache_len
    ramp = (start - lengths) / cache_len * penalty
    out = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths > max_len, torch.full_like(ramp, -penalty), out)


def dynamic_sampling_keep(
    rewards: Tensor,
    group_size: int,
    *,
    drop_all_equal: bool = True,
    min_mean: float | None = None,
    max_mean: float | None = None,
    min_std: float | None = None,
    max_std: float | None = None,
    atol: float = 0.0,
    valid: Tensor | None = None,
) -> Tensor:
    """Group keep-mask for dynamic sampling: rewards [B] -> bool [B // group_size].

    A group is dropped when all its rewards are equal (|r - r_0| <= atol; DAPO), or when its mean
    or unbiased std lies outside [min_mean, max_mean] / [min_std, max_std] (ROLL's difficulty
    and std filters; bounds inclusive, None = unbounded). Groups of one have std 0.
    ``valid`` [B] bool: judge each group on its valid members only (infrastructure failures
    left out). Expand to responses with ``keep.repeat_interleave(group_size)``.
    """
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"batch of {rewards.shape[0]} is not a multiple of group_size={group_size}")
    g = rewards.reshape(-1, group_size).float()
    keep = torch.ones(g.shape[0], dtype=torch.bool, device=rewards.device)
    if valid is not None and not bool(valid.all()):
        w = valid.reshape(-1, group_size)
        first = torch.where(w, g, torch.inf).min(-1, keepdim=True).values  # a valid member's
        if drop_all_equal:
            keep &= ~(((g - first).abs() <= atol) | ~w).all(-1)
        mean = (g * w).sum(-1) / w.sum(-1).clamp_min(1)
        n = w.sum(-1)
        std = ((w * (g - mean[:, None]) ** 2).sum(-1) / (n - 1).clamp_min(1)).sqrt()
    else:
        if drop_all_equal:
            keep &= ~((g - g[:, :1]).abs() <= atol).all(-1)
        mean = g.mean(-1)
        std = g.std(-1) if group_size > 1 else torch.zeros_like(mean)
    for value, lo, hi in ((mean, min_mean, max_mean), (std, min_std, max_std)):
        if lo is not None:
            keep &= value >= lo
        if hi is not None:
            keep &= value <= hi
    return keep
