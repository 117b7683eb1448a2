"""From a step's trajectories to the training batch: reward shaping, filters and off-policy
corrections, as the `algorithm:` config asks.

Keys this adds to the Batch of `reroll.data.batch.collate`:
- `scores` [B]: the task reward; `rewards` [B] becomes the shaped reward (overlong penalty).
- `loss_mask` [B, T]: the response tokens that enter the policy loss (overlong filter, ratio
  masks and AsyPPO's mask remove tokens from it; `response_mask` keeps every sampled token).
- `turn_ids` [B, T]: 0 on response tokens, -1 elsewhere (a single-turn response is one turn);
  multi-turn trajectories bring their own (see `reroll.data.batch`).
- `index_in_group` [B]: the response's position in its group (AsyPPO's critic shards).
- `is_weights` [B, T]: truncated importance-sampling weights, when `correction.tis` is on.
- `token_kl` [B, T]: KL(pi_old || pi_ref) per token, when `kl.mode` is `reward`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.algorithm import AlgorithmConfig, CorrectionConfig, DynamicSamplingConfig
from reroll.data.batch import Trajectory, collate
from reroll.pipelines.objective import single_turn_ids


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
    metrics: dict[str, float] = {}
    overlong = config.overlong
    if overlong.soft_penalty_cache is not None:
        penalty = algorithms.dapo_overlong_penalty(mask.sum(-1), max_new_tokens,
                                                   overlong.soft_penalty_cache,
                                                   penalty=overlong.soft_penalty)
        batch["rewards"] = batch["rewards"] + penalty
        metrics["train/overlong_penalty_mean"] = float(penalty.mean())
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    batch["loss_mask"] = algorithms.overlong_filter_mask(mask, truncated) if overlong.filter \
        else mask.clone()
    if overlong.filter:
        metrics["filter/overlong_dropped"] = float(truncated.sum())
    return batch, metrics


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


def split_mini_batches(batch: TensorDict, updates: int) -> list[TensorDict]:
    """`updates` consecutive mini-batches of (nearly) equal size; fewer if the batch is smaller."""
    size = -(-batch.batch_size[0] // updates)
    return [batch[start : start + size] for start in range(0, batch.batch_size[0], size)]
