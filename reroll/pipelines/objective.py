"""From the `algorithm:` config to calls of the pure functions in `reroll.algorithms`.

The config picks functions by name (a typed union); this module is the only place that maps a
config section to a function and its keyword arguments: advantage estimators (`ESTIMATORS`),
policy losses (`POLICY_LOSSES`), the KL controller, AsyPPO's masks, and the loss closure that a
`Strategy.train_step` calls per micro-batch; and, once at start, the line saying how samples
that can be off-policy are corrected (`announce_correction`).

Batch keys read here (all [B, T] unless noted; see `reroll.data.batch`): `rewards` [B] (shaped),
`response_mask`, `loss_mask` (tokens in the policy loss; defaults to `response_mask`),
`group_ids` [B], `values` (gae), `token_kl` (KL as a reward penalty), `turn_ids`, `turn_rewards`
[B, K] and `state_ids` [B, K] (multi-turn), `old_logprobs`, `behaviour_logprobs`, `ref_logprobs`,
`is_weights`, `entropy_mask`, `advantages`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import Tensor

from reroll import algorithms
from reroll.algorithms import distillation
from reroll.config.algorithm import AlgorithmConfig, AsyPPOConfig, KLConfig
from reroll.models.logprobs import forward_logprobs
from reroll.models.top_k import logprobs_at

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- advantages


def single_turn_ids(response_mask: Tensor) -> Tensor:
    """turn_ids of single-turn samples: 0 on response tokens, -1 elsewhere. [B, T] long."""
    return torch.where(response_mask > 0, 0, -1).long()


def _penalised_outcomes(rewards: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """Outcome estimators see a KL reward penalty as its sum over the response (as verl does)."""
    if kl is None:
        return rewards
    return rewards - kl_coef * algorithms.masked_sum(kl, mask, -1)


def _turn_inputs(batch: TensorDict, kl: Tensor | None, kl_coef: float) -> tuple[Tensor, Tensor]:
    """(turn_rewards [B, K], turn_ids [B, T]). Without `turn_rewards` the scalar reward goes on
    each row's last turn; a KL penalty is summed over each turn's tokens."""
    mask = batch["response_mask"]
    keys = batch.keys()
    turn_ids = batch["turn_ids"] if "turn_ids" in keys else single_turn_ids(mask)
    K = int(turn_ids.max().clamp_min(0)) + 1
    if "turn_rewards" in keys:
        turn_rewards = batch["turn_rewards"].float()
    else:
        last = turn_ids.max(-1).values.clamp_min(0)
        turn_rewards = torch.zeros(mask.shape[0], K).scatter(1, last[:, None],
                                                             batch["rewards"][:, None].float())
    if kl is not None:
        turn_rewards = turn_rewards - kl_coef * algorithms.turn_sums(kl * mask, turn_ids, K)
    return turn_rewards, turn_ids


def _outcome(fn: Callable[..., Tensor]) -> Callable:
    def estimate(cfg, batch, group_size, kl, kl_coef):
        mask = batch["response_mask"]
        outcomes = _penalised_outcomes(batch["rewards"], mask, kl, kl_coef)
        return algorithms.broadcast_to_tokens(fn(cfg, outcomes, group_size), mask), None
    return estimate


def _token_rewards(batch: TensorDict) -> Tensor:
    """[B, T]: each turn's reward on its turn's last token (a single-turn response: its reward on
    its last token), so token-level estimators keep the timing of per-turn rewards."""
    turn_rewards, turn_ids = _turn_inputs(batch, None, 0.0)
    return algorithms.turn_rewards_to_tokens(turn_rewards, turn_ids)


def _reinforce_pp(cfg, batch, group_size, kl, kl_coef):
    return algorithms.reinforce_pp_token_advantages(
        _token_rewards(batch), batch["response_mask"], kl=kl, kl_coef=kl_coef, gamma=cfg.gamma,
        eps=cfg.eps)


def _reinforce_pp_baseline(cfg, batch, group_size, kl, kl_coef):
    """The group mean of the episode returns is subtracted on each response's last token."""
    mask, token_rewards = batch["response_mask"], _token_rewards(batch)
    baseline = algorithms.group_mean(token_rewards.sum(-1), group_size)
    token_rewards = token_rewards - algorithms.scores_to_token_rewards(baseline, mask)
    return algorithms.reinforce_pp_token_advantages(token_rewards, mask, kl=kl, kl_coef=kl_coef,
                                                    gamma=cfg.gamma, eps=cfg.eps)


def _gae(cfg, batch, group_size, kl, kl_coef):
    mask = batch["response_mask"]
    token_rewards = _token_rewards(batch)
    if kl is not None:
        token_rewards = algorithms.kl_penalty_rewards(token_rewards, kl, mask, kl_coef)
    advantages, returns = algorithms.gae_advantages(token_rewards, batch["values"], mask,
                                                    gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten:
        advantages = algorithms.whiten_advantages(advantages, mask)
    return advantages, returns


def _rebn(cfg, batch, group_size, kl, kl_coef):
    turn_rewards, turn_ids = _turn_inputs(batch, kl, kl_coef)
    return algorithms.rebn_advantages(turn_rewards, turn_ids, gamma=cfg.gamma, eps=cfg.eps)


def _gigpo(cfg, batch, group_size, kl, kl_coef):
    turn_rewards, turn_ids = _turn_inputs(batch, kl, kl_coef)
    if "state_ids" in batch.keys():
        state_ids = batch["state_ids"]
    else:  # no environment states: turn k of each episode of a group is one anchor state
        state_ids = torch.arange(turn_rewards.shape[1]).expand_as(turn_rewards)
    return algorithms.gigpo_advantages(
        turn_rewards, turn_ids, state_ids, group_size, gamma=cfg.gamma,
        step_weight=cfg.step_weight, scale_by_std=cfg.scale_by_std, eps=cfg.eps)


def _ipa_chunk(cfg, batch, group_size, kl, kl_coef):
    turn_rewards, turn_ids = _turn_inputs(batch, kl, kl_coef)
    return algorithms.ipa_chunk_advantages(turn_rewards, turn_ids, gamma=cfg.gamma)


# name -> fn(advantage config, batch, group_size, token_kl or None, kl_coef)
#         -> (advantages [B, T], returns [B, T] or None)
ESTIMATORS: dict[str, Callable] = {
    "grpo": _outcome(lambda c, r, g: algorithms.normalize_rewards(
        r, g, mean_level=c.mean, std_level=c.std, eps=c.eps)),
    "dr_grpo": _outcome(lambda c, r, g: algorithms.dr_grpo_advantages(r, g)),
    "lite_ppo": _outcome(lambda c, r, g: algorithms.lite_ppo_advantages(r, g, eps=c.eps)),
    "rloo": _outcome(lambda c, r, g: algorithms.rloo_advantages(r, g)),
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
    "rebn": _rebn,
    "gigpo": _gigpo,
    "ipa_chunk": _ipa_chunk,
}


def estimate_advantages(config: AlgorithmConfig, batch: TensorDict, group_size: int, *,
                        kl_coef: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """Advantages [B, T] (0 off the response) and returns [B, T] (token-level estimators) or None.

    Order: reward clip -> estimator (with the KL reward penalty `batch["token_kl"]` x `kl_coef`
    when present) -> whitening -> advantage clip. The clip applies to every reward an estimator
    may read: the scalar `rewards` and, in multi-turn batches, each turn's `turn_rewards`.
    """
    norm = config.normalize
    mask = batch["response_mask"]
    if norm.reward_clip is not None:
        batch = batch.clone(recurse=False)
        for key in ("rewards", "turn_rewards"):
            if key in batch.keys():
                batch[key] = algorithms.clip_rewards(batch[key], *norm.reward_clip)
    kl = batch["token_kl"] if "token_kl" in batch.keys() and kl_coef > 0 else None
    advantages, returns = ESTIMATORS[config.advantage.name](config.advantage, batch, group_size,
                                                            kl, kl_coef)
    if norm.whiten_advantages:
        advantages = algorithms.whiten_advantages(advantages, mask)
    if norm.advantage_clip is not None:
        advantages = algorithms.clip_advantages(advantages, norm.advantage_clip)
    return advantages * mask, returns


def compute_advantages(config: AlgorithmConfig, rewards: Tensor, group_size: int,
                       response_mask: Tensor) -> Tensor:
    """Scalar rewards [B] -> per-token advantages [B, L] on response tokens (estimators that need
    nothing but the rewards; see `estimate_advantages` for the rest)."""
    batch = TensorDict({"rewards": rewards, "response_mask": response_mask},
                       batch_size=[rewards.shape[0]])
    return estimate_advantages(config, batch, group_size)[0]


# ----------------------------------------------------------------------------- policy losses


def _knobs(loss, *names: str) -> dict:
    return {name: getattr(loss, name) for name in names}


# name -> fn(loss config, micro-batch) -> keyword arguments beyond the shared ones
POLICY_LOSSES: dict[str, tuple[Callable, Callable[..., dict]]] = {
    "ppo": (algorithms.ppo_clip_loss,
            lambda c, m: _knobs(c, "clip_low", "clip_high", "dual_clip")),
    "gspo": (algorithms.gspo_loss, lambda c, m: _knobs(c, "clip_low", "clip_high")),
    "cispo": (algorithms.cispo_loss, lambda c, m: _knobs(c, "clip_low", "clip_high")),
    "topr": (algorithms.topr_loss, lambda c, m: _knobs(c, "sequence_ratio")),
    "reinforce": (algorithms.reinforce_loss, lambda c, m: {}),
    "decoupled_ppo": (algorithms.decoupled_ppo_loss,
                      lambda c, m: _knobs(c, "clip_low", "clip_high", "dual_clip", "behaviour_cap",
                                           "behaviour_cap_mode")
                      | {"behaviour_logprobs": m["behaviour_logprobs"]}),
    "ipa_chunk": (algorithms.ipa_chunk_loss,
                  lambda c, m: _knobs(c, "clip_low", "clip_high") | {"turn_ids": _turn_ids(m)}),
}


def _turn_ids(micro: TensorDict) -> Tensor:
    keys = micro.keys()
    return micro["turn_ids"] if "turn_ids" in keys else single_turn_ids(micro["response_mask"])


def policy_loss_fn(config: AlgorithmConfig) -> Callable:
    """fn(logprobs, old_logprobs, advantages, mask, micro, **agg) -> (loss, metrics)."""
    loss = config.policy_loss
    fn, knobs = POLICY_LOSSES[loss.name]

    def policy_loss(logprobs, old, advantages, mask, micro, **agg):
        weights = micro["is_weights"] if "is_weights" in micro.keys() else None
        return fn(logprobs, old, advantages, mask, **knobs(loss, micro), is_weights=weights, **agg)

    return policy_loss


def needs_old_logprobs(config: AlgorithmConfig) -> bool:
    """Whether pi_old must be computed before the update: several updates (or passes) per batch, or something
    that compares it with the behaviour or reference policy before the loss."""
    return (config.updates_per_batch > 1 or config.epochs > 1
            or config.policy_loss.name == "decoupled_ppo"
            or config.correction.tis is not None or config.correction.ratio_mask is not None
            or (config.kl.in_reward and config.kl.coef > 0))


def make_rl_loss(config: AlgorithmConfig, batch: TensorDict, temperature: float,
                 max_response_len: int, *, kl_coef: float | None = None
                 ) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """The loss over one micro-batch, normalised by counts over the whole `batch`, so summing
    micro-batch losses gives the full-batch loss (and gradient). `kl_coef` is the controller's
    current value (default `config.kl.coef`). With `distill.mode: dense` it is the dense
    distillation loss instead (`make_dense_distill_loss`)."""
    if config.distill is not None and config.distill.dense:
        return make_dense_distill_loss(config, batch, temperature, max_response_len,
                                       kl_coef=kl_coef)
    loss_key = "loss_mask" if "loss_mask" in batch.keys() else "response_mask"
    entropy_key = "entropy_mask" if "entropy_mask" in batch.keys() else loss_key
    # Ratio masks and AsyPPO's masks zero a token's weight but leave it in the count (IcePop's
    # 1/sum|y_i|, AsyPPO's masked advantage); `normaliser_mask` is the loss mask before them.
    has_count = "normaliser_mask" in batch.keys()
    count_mask = batch["normaliser_mask"] if has_count else batch[loss_key]
    tokens = _normalisers(config, count_mask, max_response_len)
    entropy_norm = _normalisers(config, count_mask if has_count else batch[entropy_key],
                                max_response_len)
    policy = policy_loss_args(config, batch, count_mask, tokens)
    policy_loss = policy_loss_fn(config)
    kl_coef = config.kl.coef if kl_coef is None else kl_coef
    kl_in_loss = config.kl.in_loss and kl_coef > 0

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask, response = micro[loss_key], micro["response_mask"]
        logprobs, entropy = forward_logprobs(
            model, micro["input_ids"], micro["attention_mask"], temperature, with_entropy=True,
            response_mask=response, entropy_grad=config.entropy_coef > 0)
        old = pi_old(micro, logprobs)
        loss, raw = policy_loss(logprobs, old, micro["advantages"], mask, micro, **policy)
        metrics = {f"actor/{k}": v for k, v in raw.items()}
        # Train/inference mismatch: how far the engine's sampling distribution is from the policy.
        metrics["actor/behaviour_kl_k3"] = algorithms.masked_mean(
            algorithms.behaviour_kl_k3(old.detach(), micro["behaviour_logprobs"], response),
            response)
        metrics["actor/entropy"] = algorithms.masked_mean(entropy.detach(), response)
        if kl_in_loss:
            kl = algorithms.kl_estimate(logprobs, micro["ref_logprobs"], config.kl.estimator)
            loss = loss + kl_coef * algorithms.aggregate_loss(kl, mask, **tokens)
            metrics["actor/kl_ref"] = algorithms.masked_mean(kl.detach(), mask)
        if config.entropy_coef > 0:
            bonus = algorithms.aggregate_loss(entropy, micro[entropy_key], **entropy_norm)
            loss = loss - config.entropy_coef * bonus
        return loss, metrics

    return loss_fn


def policy_loss_args(config: AlgorithmConfig, batch: TensorDict, count_mask: Tensor,
                     tokens: dict) -> dict:
    """The aggregation keywords of `policy_loss_fn(config)` over the whole `batch` (`tokens`:
    `_normalisers`), with ipa_chunk's count of chunks as its token_mean normaliser."""
    policy = {"agg": tokens["mode"], **{k: v for k, v in tokens.items() if k != "mode"}}
    if config.policy_loss.name == "ipa_chunk":
        policy["num_tokens"] = algorithms.chunk_count(_turn_ids(batch), count_mask)
    return policy


def pi_old(micro: TensorDict, logprobs: Tensor) -> Tensor:
    """The micro-batch's stored old logprobs; without them the update is on-policy and pi_old is
    the current policy (`logprobs`, detached)."""
    return micro["old_logprobs"] if "old_logprobs" in micro.keys() else logprobs.detach()


def make_dense_distill_loss(config: AlgorithmConfig, batch: TensorDict, temperature: float,
                            max_response_len: int, *, kl_coef: float | None = None
                            ) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """On-policy distillation, `mode: dense` (GKD): the chosen divergence between the teacher's
    top-k (`teacher_top_ids`, `teacher_top_logprobs` [B, T, k]) and the student's distribution
    at every loss token, aggregated by `loss_agg` over the whole `batch`, plus the KL-to-reference
    term when `kl` is in the loss. The student's logprobs are gathered at the teacher's ids (and
    the sampled token, for the KL and the train/inference mismatch) a chunk of positions at a
    time (`reroll.models.top_k`), never as [B, T, V]. With `task_coef` > 0 the policy loss on
    the task's `advantages` (at the sampled tokens, as `make_rl_loss` computes it) is added,
    times `task_coef`."""
    d = config.distill
    divergence = distillation.DIVERGENCES[d.divergence]
    if d.divergence == "jsd":
        divergence = functools.partial(divergence, beta=d.beta)
    loss_key = "loss_mask" if "loss_mask" in batch.keys() else "response_mask"
    count_mask = batch["normaliser_mask"] if "normaliser_mask" in batch.keys() else batch[loss_key]
    tokens = _normalisers(config, count_mask, max_response_len)
    agg = {"agg": tokens["mode"], **{k: v for k, v in tokens.items() if k != "mode"}}
    kl_coef = config.kl.coef if kl_coef is None else kl_coef
    kl_in_loss = config.kl.in_loss and kl_coef > 0
    policy = policy_loss_args(config, batch, count_mask, tokens) if d.with_task else {}
    policy_loss = policy_loss_fn(config) if d.with_task else None

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask, response = micro[loss_key], micro["response_mask"]
        ids = torch.cat([micro["teacher_top_ids"], micro["input_ids"][..., None]], -1)
        student, entropy = logprobs_at(model, micro["input_ids"], micro["attention_mask"],
                                       response, ids, temperature)
        loss, raw = algorithms.dense_distill_loss(student[..., :-1], micro["teacher_top_logprobs"],
                                                  mask, divergence, **agg)
        sampled = student[..., -1]
        metrics = {f"distill/{d.divergence}": raw["divergence"],
                   "actor/entropy": algorithms.masked_mean(entropy, response),
                   "actor/behaviour_kl_k3": algorithms.masked_mean(
                       algorithms.behaviour_kl_k3(sampled.detach(), micro["behaviour_logprobs"],
                                                  response), response)}
        if policy_loss is not None:  # task_coef > 0: the task's policy loss joins the divergence
            task, raw = policy_loss(sampled, pi_old(micro, sampled), micro["advantages"], mask,
                                    micro, **policy)
            loss, parts = algorithms.dense_distill_with_task_loss(loss, task, d.task_coef)
            # Each part is this micro-batch's share of the batch's; the trainer averages metrics
            # weighted by micro-batch size, so scaled back they log the batch's two parts.
            whole = batch.batch_size[0] / micro.batch_size[0]
            metrics |= {f"distill/{k}": v * whole for k, v in parts.items()}
            metrics |= {f"actor/{k}": v for k, v in raw.items()}
        if kl_in_loss:
            kl = algorithms.kl_estimate(sampled, micro["ref_logprobs"], config.kl.estimator)
            loss = loss + kl_coef * algorithms.aggregate_loss(kl, mask, **tokens)
            metrics["actor/kl_ref"] = algorithms.masked_mean(kl.detach(), mask)
        return loss, metrics

    return loss_fn


def advantages_before_logprobs(config: AlgorithmConfig, has_reference: bool) -> bool:
    """Whether the advantages can be estimated before the logprobs and values (they read no KL
    penalty and no critic value, and no ratio mask will change the normalisers), so pi_old is
    needed only on the samples that `samples_with_gradient` keeps."""
    return (config.skip_zero_advantage and config.critic is None
            and config.correction.ratio_mask is None
            and not (config.kl.in_reward and has_reference))


def samples_with_gradient(config: AlgorithmConfig, batch: TensorDict, kl_coef: float,
                          multiple: int = 1) -> Tensor:
    """Indices of the samples the update must run on: with `skip_zero_advantage`, those whose
    advantage is non-zero on some loss token (the others' gradient is exactly 0), topped up with
    skipped ones to a non-zero multiple of `multiple` (the data-parallel ranks, which each need an
    equal share). Every sample when a KL term in the loss or an entropy bonus depends on them."""
    size = batch.batch_size[0]
    exact = not (config.kl.in_loss and kl_coef > 0) and config.entropy_coef == 0 \
        and not (config.distill is not None and config.distill.dense)  # (no advantage there)
    if not (config.skip_zero_advantage and exact):
        return torch.arange(size)
    loss_key = "loss_mask" if "loss_mask" in batch.keys() else "response_mask"
    signal = ((batch["advantages"] != 0) & (batch[loss_key] > 0)).any(-1)
    keep, skip = signal.nonzero().squeeze(-1), (~signal).nonzero().squeeze(-1)
    wanted = min(size, max(multiple, -(-len(keep) // multiple) * multiple))
    return torch.cat([keep, skip[:wanted - len(keep)]]).sort().values


def _normalisers(config: AlgorithmConfig, mask: Tensor, max_len: int) -> dict:
    num_tokens, num_seqs = algorithms.loss_normalisers(mask)
    return {"mode": config.loss_agg, "num_tokens": num_tokens, "num_seqs": num_seqs,
            "max_len": max_len}


# ----------------------------------------------------------------------------- KL, AsyPPO


def kl_controller(config: KLConfig) -> algorithms.FixedKLController | algorithms.AdaptiveKLController:
    """The controller that holds the current KL coefficient (`.value`)."""
    ctl = config.controller
    if ctl.name == "adaptive":
        return algorithms.AdaptiveKLController(config.coef, ctl.target, ctl.horizon)
    return algorithms.FixedKLController(config.coef)


def reward_kl(config: KLConfig, old_logprobs: Tensor, ref_logprobs: Tensor,
              mask: Tensor) -> Tensor:
    """Per-token KL(pi_old || pi_ref) for the reward penalty, detached, 0 off the response."""
    kl = algorithms.kl_estimate(old_logprobs, ref_logprobs, config.estimator)
    return torch.where(mask.bool(), kl, torch.zeros_like(kl)).detach()


def asyppo_masks(config: AsyPPOConfig, critic_values: Tensor, loss_mask: Tensor,
                 response_mask: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
    """AsyPPO: (policy-loss mask, entropy-bonus mask, metrics) from M critics' values [M, B, T].

    Tokens where the critics agree most (std below the `advantage_mask_quantile` of the batch's
    stds) leave the policy loss; those where they diverge most (above `entropy_mask_quantile`)
    leave the entropy bonus.
    """
    std = algorithms.critic_disagreement(critic_values)
    low = algorithms.masked_quantile(std, response_mask, config.advantage_mask_quantile)
    high = algorithms.masked_quantile(std, response_mask, config.entropy_mask_quantile)
    policy_mask = loss_mask
    if config.advantage_mask_quantile > 0:
        policy_mask = algorithms.asyppo_advantage_mask(std, loss_mask, low)
    entropy_mask = loss_mask
    if config.entropy_mask_quantile < 1:
        entropy_mask = algorithms.asyppo_entropy_mask(std, loss_mask, high)
    kept = float(loss_mask.sum().clamp_min(1))
    return policy_mask, entropy_mask, {
        "critic/disagreement_mean": float(algorithms.masked_mean(std, response_mask)),
        "critic/advantage_masked_frac": 1 - float(policy_mask.sum()) / kept,
        "critic/entropy_masked_frac": 1 - float(entropy_mask.sum()) / kept,
    }


# ----------------------------------------------------------------------------- SFT


def sft_loss(batch: TensorDict) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """Token cross-entropy on response tokens, averaged over all response tokens of `batch`."""
    num_tokens, _ = algorithms.loss_normalisers(batch["response_mask"])

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"]
        logprobs, _ = forward_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                       response_mask=mask)
        loss = algorithms.aggregate_loss(-logprobs, mask, "token_mean", num_tokens=num_tokens)
        return loss, {"sft/nll": algorithms.masked_mean(-logprobs.detach(), mask)}

    return loss_fn


# ----------------------------------------------------------------------------- at start


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
