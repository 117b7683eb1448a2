"""From a step's trajectories to the training batch: reward shaping, filters and off-policy
corrections, as the `algorithm:` config asks.

Keys this adds to the Batch of `reroll.data.batch.collate`:
- `scores` [B]: the task reward; `rewards` [B] becomes the shaped reward (overlong penalty), and
  so does `turn_rewards` [B, K] in multi-turn batches (each turn's own penalty).
- `loss_mask` [B, T]: the response tokens that enter the policy loss (overlong filter, ratio
  masks and AsyPPO's mask remove tokens from it; `response_mask` keeps every sampled token).
- `normaliser_mask` [B, T]: the tokens the loss normalisers count: `loss_mask` after the
  overlong filter, before the ratio and AsyPPO masks (which zero a token's weight only).
- `turn_ids` [B, T]: 0 on response tokens, -1 elsewhere (a single-turn response is one turn);
  multi-turn trajectories bring their own (see `reroll.data.batch`).
- `index_in_group` [B]: the response's position in its group (AsyPPO's critic shards).
- `is_weights` [B, T]: truncated importance-sampling weights, when `correction.tis` is on.
- `token_kl` [B, T]: KL(pi_old || pi_ref) per token, when `kl.mode` is `reward`.
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.algorithm import AlgorithmConfig, CorrectionConfig, DynamicSamplingConfig
from reroll.data.batch import Trajectory, collate
from reroll.pipelines.objective import single_turn_ids

log = logging.getLogger(__name__)


def collate_for_rl(trajectories: list[Trajectory], pad_token_id: int, config: AlgorithmConfig,
                   group_size: int, max_new_tokens: int) -> tuple[TensorDict, dict[str, float]]:
    """Collate, then shape the rewards and mark the loss tokens (overlong handling)."""
    batch, _ = collate(trajectories, pad_token_id)
    mask = batch["response_mask"]
    size = batch.batch_size[0]
    batch["scores"] = batch["rewards"].clone()
    if "turn_ids" not in batch.keys():
        batch["turn_ids"] = single_turn_ids(mask)
    batch["index_in_group"] = torch.arange(size) % group_size
    metrics = shape_rewards(batch, config, max_new_tokens)
    overlong = config.overlong
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    batch["loss_mask"] = algorithms.overlong_filter_mask(mask, truncated) if overlong.filter \
        else mask.clone()
    # The loss normalisers count these tokens: a truncated sample leaves the step (as a filtered
    # group does), while later masks (ratio masks, AsyPPO) only zero a token's weight.
    batch["normaliser_mask"] = batch["loss_mask"].clone()
    if overlong.filter:
        metrics["filter/overlong_dropped"] = float(truncated.sum())
    return batch, metrics


def shape_rewards(batch: TensorDict, config: AlgorithmConfig,
                  max_new_tokens: int) -> dict[str, float]:
    """DAPO's soft overlong penalty, on every reward an estimator may read: each turn's length
    against `max_new_tokens` (a turn's limit; a single-turn response is one turn) gives that
    turn's penalty, added to `turn_rewards` (multi-turn batches) and, summed, to `rewards`.
    (The reward clip is the estimator's first step, `objective.estimate_advantages`.)"""
    overlong = config.overlong
    if overlong.soft_penalty_cache is None:
        return {}
    turn_ids = batch["turn_ids"]
    K = int(turn_ids.max().clamp_min(0)) + 1
    if "turn_rewards" in batch.keys():
        K = max(K, batch["turn_rewards"].shape[1])
    lengths = algorithms.turn_sums(batch["response_mask"].float(), turn_ids, K)
    penalty = algorithms.dapo_overlong_penalty(lengths, max_new_tokens,
                                               overlong.soft_penalty_cache,
                                               penalty=overlong.soft_penalty)
    penalty = torch.where(algorithms.turn_valid(turn_ids, K), penalty, torch.zeros_like(penalty))
    if "turn_rewards" in batch.keys():
        turn_rewards = batch["turn_rewards"]
        batch["turn_rewards"] = turn_rewards + penalty[:, : turn_rewards.shape[1]]
    batch["rewards"] = batch["rewards"] + penalty.sum(-1)
    return {"train/overlong_penalty_mean": float(penalty.sum(-1).mean())}


def filter_groups(batch: TensorDict, config: DynamicSamplingConfig | None,
                  group_size: int) -> tuple[TensorDict, dict[str, float]]:
    """Dynamic sampling: keep only the groups that pass the filters (judged on the task reward).

    The dropped groups leave the step entirely, so batch-level statistics (Lite PPO's std,
    REINFORCE++'s whitening) and loss normalisers are over the kept groups, as in DAPO.
    """
    if config is None:
        return batch, {}
    keep = algorithms.dynamic_sampling_keep(
        batch["scores"], group_size, drop_all_equal=config.drop_all_equal,
        min_mean=config.min_mean, max_mean=config.max_mean, min_std=config.min_std,
        max_std=config.max_std, atol=config.atol)
    metrics = {"filter/groups_kept": float(keep.sum()),
               "filter/groups_dropped": float((~keep).sum())}
    return batch[keep.repeat_interleave(group_size)], metrics


def apply_corrections(batch: TensorDict, config: CorrectionConfig,
                      rows: torch.Tensor | None = None) -> dict[str, float]:
    """Ratio masks shrink `loss_mask`; truncated IS sets `is_weights`. Compares `old_logprobs`
    (pi_old) with `behaviour_logprobs` (mu, recorded by the engine) and logs the mismatch, over
    `rows` only when pi_old was computed on those only."""
    old, behaviour = batch["old_logprobs"], batch["behaviour_logprobs"]
    response, mask = batch["response_mask"], batch["loss_mask"]
    if rows is not None:
        scored = torch.zeros(response.shape[0], 1, dtype=response.dtype)
        scored[rows] = 1
        response = response * scored
    metrics = {f"correction/{k}": float(v)
               for k, v in algorithms.off_policy_metrics(old, behaviour, response).items()}
    ratio_mask = config.ratio_mask
    if ratio_mask is not None:
        before = float(mask.sum())
        if ratio_mask.level == "token":
            mask = algorithms.ratio_mask_token(old, behaviour, mask, low=ratio_mask.low,
                                               high=ratio_mask.high)
        else:
            mask = algorithms.ratio_mask_sequence(old, behaviour, mask, low=ratio_mask.low,
                                                  high=ratio_mask.high,
                                                  geometric=ratio_mask.geometric)
        metrics["correction/masked_frac"] = 1 - float(mask.sum()) / max(before, 1.0)
        batch["loss_mask"] = mask
    if config.tis is not None:
        weights = algorithms.TIS_LEVELS[config.tis.level](old, behaviour, mask, cap=config.tis.cap,
                                                          turn_ids=batch["turn_ids"])
        batch["is_weights"] = weights
        metrics["correction/tis_weight_mean"] = float(algorithms.masked_mean(
            weights, mask if rows is None else mask * response))
    return metrics


def announce_correction(config: AlgorithmConfig, off_policy_reasons: list[str]) -> str | None:
    """Say, once at start, how samples that can be off-policy are corrected: a warning when
    `correction: none` leaves them uncorrected, an info line when `auto` turned TIS on.
    Returns the message (None when the samples are on-policy)."""
    if not off_policy_reasons:
        return None
    why = "; ".join(off_policy_reasons)
    corr = config.correction
    if corr.tis is None and corr.ratio_mask is None and config.policy_loss.name != "decoupled_ppo":
        message = (f"algorithm.correction: none: the samples can be off-policy ({why}) and are "
                   f"trained without a behaviour-policy correction")
        log.warning(message)
        return message
    how = (f"truncated IS ({corr.tis.level}, cap {corr.tis.cap})" if corr.tis is not None else
           "ratio mask" if corr.ratio_mask is not None else "decoupled_ppo's behaviour weight")
    message = f"off-policy samples ({why}) are corrected by {how}"
    log.info(message)
    return message


def split_mini_batches(batch: TensorDict, updates: int) -> list[TensorDict]:
    """`updates` consecutive mini-batches of (nearly) equal size; fewer if the batch is smaller."""
    size = -(-batch.batch_size[0] // updates)
    return [batch[start : start + size] for start in range(0, batch.batch_size[0], size)]
