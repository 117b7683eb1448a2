"""Advantage estimators for single-turn (outcome-reward) RL and token-level returns.

Conventions. ``rewards`` [B] holds one scalar per response, ordered so that consecutive blocks
of ``group_size`` are the responses to one prompt. Outcome estimators return [B] (broadcast
with ``broadcast_to_tokens``); token-level estimators take ``mask`` [B, T] and return
``(advantages, returns)``, both [B, T] and 0 on invalid tokens. Standard deviations are
unbiased (Bessel, ``torch.std``) as in verl and TRL; a group of one response gets advantage 0.
Multi-turn estimators (rebn, gigpo, ipa_chunk) take per-turn rewards [B, K] and ``turn_ids``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .aggregation import masked_whiten, turn_valid, turns_to_tokens

NormLevel = Literal["group", "batch", "none"]


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"batch of {rewards.shape[0]} is not a multiple of group_size={group_size}")
    return rewards.reshape(-1, group_size)


# ----------------------------------------------------------------------------- normalisation


def _masked(valid: Tensor | None) -> bool:
    """Whether `valid` [B] leaves out any sample (None or all True: every sample counts)."""
    return valid is not None and not bool(valid.all())


def group_mean(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """Mean of each group, repeated to [B]. With ``valid`` [B] bool, over the group's valid
    members only (0 for a group without one)."""
    g = _groups(rewards, group_size)
    if not _masked(valid):
        return g.mean(-1, keepdim=True).expand_as(g).reshape(-1)
    w = _groups(valid.to(rewards.dtype), group_size)
    mean = (g * w).sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp_min(1)
    return mean.expand_as(g).reshape(-1)


def group_std(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """Unbiased std of each group, repeated to [B]; 0 for groups of size 1. With ``valid``,
    over the group's valid members only (0 for a group with fewer than two)."""
    g = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    if not _masked(valid):
        return g.std(-1, keepdim=True).expand_as(g).reshape(-1)
    w = _groups(valid.to(rewards.dtype), group_size)
    n = w.sum(-1, keepdim=True)
    mean = (g * w).sum(-1, keepdim=True) / n.clamp_min(1)
    var = (w * (g - mean) ** 2).sum(-1, keepdim=True) / (n - 1).clamp_min(1)
    return var.sqrt().expand_as(g).reshape(-1)


def _batch_std(rewards: Tensor, valid: Tensor | None) -> Tensor:
    kept = rewards[valid] if _masked(valid) else rewards
    return kept.std() if kept.numel() > 1 else rewards.new_zeros(())


def normalize_rewards(
    rewards: Tensor,
    group_size: int,
    *,
    mean_level: NormLevel = "group",
    std_level: NormLevel = "group",
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """(r - mean) / (std + eps), each statistic taken over the group, the batch, or not at all.

    rewards: [B] -> [B]. mean: group mean | batch mean | 0. std (of the raw rewards, unbiased,
    independent of the mean level as in ROLL's ``reward_norm``): group std | batch std | none
    (no division). grpo = (group, group), dr_grpo = (group, none), lite_ppo = (group, batch).
    A group of size 1 (with a group mean) gives 0. ``valid`` [B] bool: samples outside every
    statistic (an infrastructure failure), whose own advantage is 0.
    """
    levels = ("group", "batch", "none")
    if mean_level not in levels or std_level not in levels:
        raise ValueError(f"mean_level/std_level must be in {levels}")
    if mean_level == "group":
        centred = rewards - group_mean(rewards, group_size, valid)
    elif mean_level == "batch":
        centred = rewards - (rewards[valid] if _masked(valid) else rewards).mean()
    else:
        centred = rewards
    if std_level == "group":
        out = centred / (group_std(rewards, group_size, valid) + eps)
    elif std_level == "batch":
        out = centred / (_batch_std(rewards, valid) + eps)
    else:
        out = centred
    return out * valid.to(out.dtype) if _masked(valid) else out


def clip_rewards(rewards: Tensor, low: float, high: float) -> Tensor:
    """Elementwise clamp of rewards to [low, high]."""
    return rewards.clamp(low, high)


def clip_advantages(advantages: Tensor, max_abs: float) -> Tensor:
    """Elementwise clamp of advantages to [-max_abs, max_abs] (ROLL's ``advantage_clip``)."""
    return advantages.clamp(-max_abs, max_abs)


def whiten_advantages(
    advantages: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Whiten over all valid tokens of the batch: (A - mean) / sqrt(var + eps), 0 outside mask.

    advantages, mask: [B, T]. Unbiased variance. ``shift_mean=False`` keeps the mean.
    """
    return masked_whiten(advantages, mask, shift_mean=shift_mean, eps=eps)


# ----------------------------------------------------------------------------- outcome estimators


def grpo_advantages(
    rewards: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """GRPO (DeepSeekMath, Shao et al. 2024): A_i = (r_i - mean_g r) / (std_g r + eps).

    rewards: [B], consecutive blocks of ``group_size`` form a group -> [B]. std is the
    unbiased (Bessel-corrected) group std, as torch.std in verl / TRL. With
    ``scale_by_std=False``: A_i = r_i - mean_g r (Dr. GRPO). Groups of size 1 give 0.
    ``valid``: as in :func:`normalize_rewards`.
    """
    return normalize_rewards(
        rewards, group_size, mean_level="group", std_level="group" if scale_by_std else "none",
        eps=eps, valid=valid,
    )


def dr_grpo_advantages(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """Dr. GRPO ("Understanding R1-Zero-like training", Liu et al. 2025): A_i = r_i - mean_g r.

    rewards [B] -> [B]. Pair with ``seq_mean_token_sum_norm`` aggregation.
    """
    return normalize_rewards(rewards, group_size, mean_level="group", std_level="none",
                             valid=valid)


def lite_ppo_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6,
                        valid: Tensor | None = None) -> Tensor:
    """Lite PPO ("Tricks or Traps?", Liu et al. 2025): A_i = (r_i - mean_g r) / (std_batch r + eps).

    Group mean, batch std of the rewards (unbiased). rewards [B] -> [B]. Pair with token_mean.
    """
    return normalize_rewards(rewards, group_size, mean_level="group", std_level="batch", eps=eps,
                             valid=valid)


def rloo_advantages(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g r).

    rewards [B] -> [B]. Groups of size 1 give 0. With ``valid`` [B] bool, n and the mean are
    over the group's valid members; an invalid sample, or one without a valid sibling, gets 0.
    """
    g = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    w = torch.ones_like(g) if not _masked(valid) else _groups(valid.to(g.dtype), group_size)
    others = w.sum(-1, keepdim=True) - w  # valid siblings of each member
    loo_mean = ((g * w).sum(-1, keepdim=True) - g * w) / others.clamp_min(1)
    return ((g - loo_mean) * w * (others > 0)).reshape(-1)




# ----------------------------------------------------------------------------- token-level


def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each response's scalar score [B] on its last valid token -> [B, T] (0 elsewhere).

    Rows with no valid token get no reward.
    """
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, -1).max(-1).values  # [B], -1 if empty
    onehot = (pos == last.unsqueeze(-1)) & (last.unsqueeze(-1) >= 0)
    return onehot.to(scores.dtype) * scores.unsqueeze(-1)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{k >= t, k valid} gamma^(#valid tokens strictly between t and k) r_k.

    token_rewards, mask: [B, T] -> [B, T] (0 on invalid tokens). Invalid tokens are skipped:
    discounting counts valid tokens only (interleaved environment tokens do not discount).
    """
    valid = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        new = token_rewards[:, t] + gamma * running
        running = valid[:, t] * new + (1 - valid[:, t]) * running
        out[:, t] = valid[:, t] * running
    return out


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016), as used by PPO: returns (advantages, returns), [B, T] each.

    Over the valid tokens of a row (invalid ones are skipped, so environment tokens inside a
    multi-turn response neither discount nor bootstrap), with V after the last valid token = 0:
        delta_t = r_t + gamma V_{t+1} - V_t ;  A_t = delta_t + gamma lam A_{t+1} ;  R_t = A_t + V_t
    token_rewards, values, mask: [B, T]. Not whitened; see ``whiten_advantages``.
    """
    valid = mask.to(values.dtype)
    values = values.detach() * valid
    B, T = values.shape
    adv = torch.zeros_like(values)
    next_value = values.new_zeros(B)
    next_adv = values.new_zeros(B)
    for t in range(T - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = valid[:, t] * a + (1 - valid[:, t]) * next_adv
        next_value = valid[:, t] * values[:, t] + (1 - valid[:, t]) * next_value
        adv[:, t] = valid[:, t] * a
    return adv, (adv + values) * valid


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al. 2025): token returns with a KL reward penalty, batch-normalised.

    r_t = rewards_i [t = last valid token] - kl_coef * kl_t ;  G_t = sum_{k>=t} gamma^(k-t) r_k
    A = whiten(G) over all valid tokens of the batch (unbiased var).
    rewards [B]; mask, kl [B, T] (kl per token, e.g. k1 of policy vs reference, detached).
    Returns (advantages, returns) [B, T], returns = G.
    """
    return reinforce_pp_token_advantages(scores_to_token_rewards(rewards, mask), mask, kl=kl,
                                         kl_coef=kl_coef, gamma=gamma, eps=eps)


def reinforce_pp_token_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ from token rewards [B, T] (e.g. each turn's reward on its last token):
    r_t - kl_coef * kl_t, discounted returns G over the valid tokens, A = whiten(G) over the batch.
    Returns (advantages, returns = G), [B, T]."""
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl.detach() * mask.to(token_rewards.dtype)
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=eps), returns


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean of the rewards, then REINFORCE++.

    r'_i = r_i - mean_g r ; then as :func:`reinforce_pp_advantages` (token returns with the
    KL penalty, whitened over all valid tokens of the batch). rewards [B]; mask, kl [B, T].
    ``valid`` [B]: samples outside the group means (and, with no token in ``mask``, the rest).
    """
    centred = rewards - group_mean(rewards, group_size, valid)
    return reinforce_pp_advantages(centred, mask, kl=kl, kl_coef=kl_coef, gamma=gamma, eps=eps)




# ----------------------------------------------------------------------------- multi-turn
#
# Multi-turn inputs: turn_rewards [B, K] (reward of turn k of episode b) and turn_ids [B, T]
# (0..K-1 for each policy token, -1 for padding and non-policy tokens). A turn is valid when
# it has at least one policy token; rewards of invalid turns are ignored.


def rebn_advantages(
    turn_rewards: Tensor, turn_ids: Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """ReBN, Return Batch Normalisation (GEM, Liu et al. 2025).

    G_k = sum_{j >= k, valid} gamma^(j-k) r_j  (per episode, over its valid turns)
    A_k = (G_k - mean G) / sqrt(var G + eps), statistics over all valid turns of the batch
    (unbiased var). Every token of turn k gets A_k. Returns (advantages, returns) [B, T],
    returns = G_k on the tokens of turn k.
    """
    valid = turn_valid(turn_ids, turn_rewards.shape[1])
    G = discounted_returns(turn_rewards, valid, gamma)
    A = masked_whiten(G, valid, eps=eps)
    return turns_to_tokens(A, turn_ids), turns_to_tokens(G, turn_ids)


def _segment_stats(values: Tensor, seg: Tensor, n_seg: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-segment (mean, unbiased std, count) of 1-D ``values`` with segment ids ``seg``."""
    count = values.new_zeros(n_seg).index_add(0, seg, torch.ones_like(values))
    mean = values.new_zeros(n_seg).index_add(0, seg, values) / count
    sq = values.new_zeros(n_seg).index_add(0, seg, (values - mean[seg]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return mean, std, count


def gigpo_advantages(
    turn_rewards: Tensor,
    turn_ids: Tensor,
    state_ids: Tensor,
    group_size: int,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GiGPO, Group-in-Group Policy Optimization (Feng et al. 2025).

    Episode level: R_b = sum_k r_bk (valid turns);  A^E_b = GRPO of R over its episode group.
    Step level: G_bk = discounted return from turn k (gamma); the turns of one episode group that
    share an anchor state (equal ``state_ids``) form a step group; A^S_bk = (G_bk - mean) / (std +
    eps) over that step group (no std division when ``scale_by_std`` is False); a step group of
    one turn gets A^S = 0. A_bk = A^E_b + step_weight * A^S_bk, broadcast to the turn's tokens.
    turn_rewards, state_ids: [B, K] (state_ids: int ids of the observation before turn k, e.g. a
    hash; only compared for equality); turn_ids: [B, T]. Episodes are consecutive blocks of
    ``group_size``. Unbiased stds. Returns (advantages, returns) [B, T], returns = G.
    ``valid`` [B] bool: episodes outside the episode-level statistics (an infrastructure
    failure; with no valid turn it is outside the step groups already).
    """
    B, K = turn_rewards.shape
    episodes = valid
    valid = turn_valid(turn_ids, K)
    episode_return = torch.where(valid, turn_rewards, 0.0).sum(-1)
    a_episode = grpo_advantages(episode_return, group_size, scale_by_std=scale_by_std, eps=eps,
                                valid=episodes)
    G = discounted_returns(turn_rewards, valid, gamma)

    group = (torch.arange(B, device=turn_rewards.device) // group_size).unsqueeze(-1).expand(B, K)
    keys = torch.stack([group[valid], state_ids.to(group.device)[valid].long()], -1)
    a_step = torch.zeros_like(G)
    if keys.numel() > 0:
        _, seg = torch.unique(keys, dim=0, return_inverse=True)
        g_valid = G[valid]
        mean, std, count = _segment_stats(g_valid, seg, int(seg.max()) + 1)
        centred = g_valid - mean[seg]
        step = centred / (std[seg] + eps) if scale_by_std else centred
        a_step[valid] = torch.where(count[seg] > 1, step, torch.zeros_like(step))
    A = a_episode.unsqueeze(-1) + step_weight * a_step
    return turns_to_tokens(A * valid, turn_ids), turns_to_tokens(G, turn_ids)


def ipa_chunk_advantages(
    turn_rewards: Tensor, turn_ids: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """IPA chunk-level returns ("Let It Flow", ROME, 2025): credit per interaction chunk.

    A chunk is the model's tokens in one turn. A_k = G_k = sum_{j >= k, valid} gamma^(j-k) r_j,
    constant over the chunk's tokens (no per-token discounting inside a chunk). Pair with the
    chunk-level ratio and chunk-normalised loss of ``losses.ipa_chunk_loss``; normalise with
    ``whiten_advantages`` if wanted. Returns (advantages, returns) [B, T], equal.
    """
    valid = turn_valid(turn_ids, turn_rewards.shape[1])
    G = turns_to_tokens(discounted_returns(turn_rewards, valid, gamma), turn_ids)
    return G, G
