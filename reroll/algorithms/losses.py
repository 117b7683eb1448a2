"""Policy-gradient losses and the entropy of a token distribution.

Every policy loss has the same call shape, so the config layer can swap them:

    loss, metrics = fn(logprobs, old_logprobs, advantages, mask, *, <its knobs>,
                       agg=..., num_tokens=None, num_seqs=None, max_len=None, is_weights=None)

Inputs are [B, T]: ``logprobs`` (log pi_theta of the sampled tokens, with grad),
``old_logprobs`` (log pi_old, the policy that the ratio is taken against; no grad),
``advantages`` (already broadcast to tokens), ``mask`` (1 on tokens in the loss) and
optional ``is_weights`` (detached off-policy weights, e.g. truncated IS of pi_old vs the
behaviour policy; see ``corrections.py``) that multiply the per-token loss. The per-token loss
(to MINIMISE) is reduced with :func:`~reroll.algorithms.aggregation.aggregate_loss`; pass
global ``num_tokens`` / ``num_seqs`` when splitting a batch into micro-batches.

Metrics are detached 0-dim tensors, averaged over the valid tokens of THIS call (micro-batch).
``approx_kl`` is the k1 estimate mean(log pi_old - log pi_theta) (verl's ``ppo_kl``);
``approx_kl_k3`` is the non-negative k3 estimate mean(r - 1 - log r), r = pi_theta / pi_old.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import LOG_RATIO_CLAMP, aggregate_loss, masked_mean, turn_sums, turns_to_tokens

Metrics = dict[str, float | Tensor]


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> Metrics:
    lr = log_ratio.detach()
    ratio = torch.exp(lr)
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "approx_kl": masked_mean(-lr, mask),
        "approx_kl_k3": masked_mean(ratio - 1.0 - lr, mask),
    }


def _reduce(
    per_token: Tensor, mask: Tensor, is_weights: Tensor | None, agg: str, num_tokens, num_seqs,
    max_len,
) -> Tensor:
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    return aggregate_loss(
        per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )


def _frac(cond: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(cond.detach().float(), mask)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman 2017), asymmetric clip (DAPO clip-higher), dual clip.

    rho = exp(logprobs - old_logprobs);  pg1 = -A rho;  pg2 = -A clip(rho, 1-clip_low, 1+clip_high)
    l = max(pg1, pg2)                            (= -min(rho A, clip(rho) A))
    dual clip (Ye et al. 2020, c = dual_clip > 1): where A < 0, l = min(l, -c A), i.e. the
    objective of a negative-advantage token is bounded below by c A however large rho gets.
    Loss = aggregate(l * is_weights).  All inputs [B, T].

    Metrics: clip_frac (valid tokens where pg2 > pg1, i.e. the clip is active), clip_frac_dual
    (A < 0 tokens where the dual bound binds), ratio_mean, approx_kl (k1), approx_kl_k3.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2)
    metrics = {"clip_frac": _frac(pg2 > pg1, mask)}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg3 = -advantages * dual_clip
        negative = advantages < 0
        metrics["clip_frac_dual"] = _frac(negative & (per_token > pg3), mask)
        per_token = torch.where(negative, torch.minimum(per_token, pg3), per_token)
    loss = _reduce(per_token, mask, is_weights, agg, num_tokens, num_seqs, max_len)
    return loss, metrics | _ratio_metrics(log_ratio, mask)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq_mean_token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025), token form (GSPO-token).

    s_i = exp( mean_{t valid} (log pi_theta - log pi_old) )          (sequence ratio)
    s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))             (value s_i, grad per token)
    l_it = max(-A_it s_it, -A_it clip(s_it, 1-clip_low, 1+clip_high)); log s_it clamped <= 10.
    With A_it = A_i and the default ``seq_mean_token_mean`` this equals sequence-level GSPO in
    value and gradient. Inputs [B, T]. Metrics: clip_frac (fraction of valid tokens, i.e. of
    sequences weighted by length, whose sequence ratio is clipped), seq_ratio_mean, + ratio ones.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    seq_log_ratio = masked_mean(log_ratio, mask, -1).detach()
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    pg1 = -advantages * s
    pg2 = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2)
    seq_valid = (mask.sum(-1) > 0).float()
    metrics = {
        "clip_frac": _frac(pg2 > pg1, mask),
        "seq_ratio_mean": masked_mean(torch.exp(seq_log_ratio), seq_valid),
    }
    loss = _reduce(per_token, mask, is_weights, agg, num_tokens, num_seqs, max_len)
    return loss, metrics | _ratio_metrics(log_ratio, mask)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, 2025).

    l_it = -sg( clip(rho_it, 1-clip_low, 1+clip_high) ) * A_it * log pi_theta(y_it)
    The IS weight is clipped and detached, so every token keeps its gradient. clip_low=None
    puts no lower bound on the weight (the paper's setting). Inputs [B, T].
    Metrics: clip_frac (valid tokens whose weight was clipped), ratio ones.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio).detach()
    low = None if clip_low is None else 1.0 - clip_low
    weight = ratio.clamp(low, 1.0 + clip_high)
    per_token = -weight * advantages * logprobs
    metrics = {"clip_frac": _frac(weight != ratio, mask)}
    loss = _reduce(per_token, mask, is_weights, agg, num_tokens, num_seqs, max_len)
    return loss, metrics | _ratio_metrics(log_ratio, mask)


def topr_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    sequence_ratio: bool = False,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025).

    A >= 0:  l_it = -A_it log pi_theta(y_it)                  (no importance weight)
    A <  0:  l_it = -sg(clip(rho, 0, 1)) A_it log pi_theta(y_it)
    rho is the token ratio, or with ``sequence_ratio=True`` the trajectory ratio
    exp(sum_t log rho_it) as in the paper. Inputs [B, T].
    Metrics: neg_frac (valid tokens with A < 0), clip_frac (A < 0 tokens with rho > 1), ratio ones.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    lr = log_ratio.detach()
    if sequence_ratio:
        seq = (lr * mask).sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        lr = seq.expand_as(lr)
    ratio = torch.exp(lr)
    negative = advantages < 0
    weight = torch.where(negative, ratio.clamp(0.0, 1.0), torch.ones_like(ratio))
    per_token = -weight * advantages * logprobs
    metrics = {"neg_frac": _frac(negative, mask), "clip_frac": _frac(negative & (ratio > 1), mask)}
    loss = _reduce(per_token, mask, is_weights, agg, num_tokens, num_seqs, max_len)
    return loss, metrics | _ratio_metrics(log_ratio, mask)


def reinforce_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """REINFORCE (Williams 1992): l_it = -A_it log pi_theta(y_it). Inputs [B, T].

    ``old_logprobs`` enters only the metrics; off-policy data should pass ``is_weights``.
    """
    per_token = -advantages * logprobs
    loss = _reduce(per_token, mask, is_weights, agg, num_tokens, num_seqs, max_len)
    return loss, _ratio_metrics(_log_ratio(logprobs, old_logprobs), mask)


def decoupled_ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behaviour_logprobs: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_cap: float | None = None,
    behaviour_cap_mode: str = "truncate",
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Decoupled PPO (Hilton et al. 2022; AReaL): clip against the proximal policy, weight by
    proximal / behaviour.

    ``old_logprobs`` are the PROXIMAL policy's (the trainer's weights at the start of the step),
    ``behaviour_logprobs`` the sampler's (mu). l = w * PPO-clip(pi_theta / pi_prox, A) with
    w = sg(pi_prox / mu). Above ``behaviour_cap`` (when given) ``behaviour_cap_mode`` "truncate"
    sets w = cap (truncated IS), "drop" sets w = 0 (AReaL's ``behav_imp_weight_cap`` filter); a
    dropped token still counts in the normaliser. Inputs [B, T].
    Metrics: those of :func:`ppo_clip_loss` plus behaviour_weight_mean and behaviour_capped_frac.
    """
    if behaviour_cap_mode not in ("truncate", "drop"):
        raise ValueError(f"behaviour_cap_mode must be truncate or drop, got {behaviour_cap_mode!r}")
    w = torch.exp(_log_ratio(old_logprobs, behaviour_logprobs)).detach()
    metrics_w: Metrics = {}
    if behaviour_cap is not None:
        over = w > behaviour_cap
        metrics_w["behaviour_capped_frac"] = _frac(over, mask)
        w = w.clamp(max=behaviour_cap) if behaviour_cap_mode == "truncate" else \
            torch.where(over, torch.zeros_like(w), w)
    metrics_w["behaviour_weight_mean"] = masked_mean(w, mask)
    if is_weights is not None:
        w = w * is_weights.detach()
    loss, metrics = ppo_clip_loss(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs,
        max_len=max_len, is_weights=w,
    )
    return loss, metrics | metrics_w


def ipa_chunk_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    turn_ids: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Chunk-level clipped surrogate for IPA ("Let It Flow", ROME 2025): ratio and loss per chunk.

    A chunk c is the policy tokens of one turn (``turn_ids`` [B, T], -1 outside chunks).
    s_c = exp( mean_{t in c} log rho_t )  (geometric-mean chunk ratio, GSPO-style token form:
    value s_c, gradient through each token), l_t = max(-A_t s_c, -A_t clip(s_c, 1-lo, 1+hi)),
    then divided by |c| so that every chunk weighs 1. With ``agg="token_mean"`` the normaliser
    ``num_tokens`` counts CHUNKS: it defaults to the number of chunks with a valid token in this
    batch (pass the global count, see ``chunk_count``), giving the mean over chunks of each
    chunk's token-mean loss. Inputs [B, T]. Metrics: clip_frac (token-weighted), ratio ones.
    """
    in_chunk = mask * (turn_ids >= 0)
    K = int(turn_ids.max().clamp_min(0)) + 1
    log_ratio = _log_ratio(logprobs, old_logprobs)
    length = turn_sums(in_chunk.to(log_ratio.dtype), turn_ids, K)
    chunk_lr = (turn_sums(log_ratio * in_chunk, turn_ids, K) / length.clamp_min(1)).detach()
    log_s = (logprobs - logprobs.detach() + turns_to_tokens(chunk_lr, turn_ids)).clamp(max=10.0)
    s = torch.exp(log_s)
    pg1 = -advantages * s
    pg2 = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(pg1, pg2) / turns_to_tokens(length, turn_ids).clamp_min(1)
    if num_tokens is None:
        num_tokens = chunk_count(turn_ids, in_chunk)
    loss = _reduce(per_token, in_chunk, is_weights, agg, num_tokens, num_seqs, max_len)
    metrics = {"clip_frac": _frac(pg2 > pg1, in_chunk)}
    return loss, metrics | _ratio_metrics(log_ratio, in_chunk)


def chunk_count(turn_ids: Tensor, mask: Tensor) -> float:
    """Number of (row, turn) chunks with at least one valid token; turn_ids, mask: [B, T]."""
    in_chunk = (mask > 0) & (turn_ids >= 0)
    K = int(turn_ids.max().clamp_min(0)) + 1
    return float((turn_sums(in_chunk.float(), turn_ids, K) > 0).sum())


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [B, T, V] -> [B, T].

    H = -sum_v p_v log p_v with log p = log_softmax(logits) (logsumexp, stable for large logits).
    Logits of -inf (masked vocabulary) give p = 0 and contribute 0, with finite gradients.
    """
    logp = torch.log_softmax(logits, dim=-1)
    p = torch.exp(logp)
    return -(p * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)
