"""The RL objective, built once from the `algorithm:` config at start (`build`): a frozen
`Objective` record of the resolved callables (advantage estimator, policy loss, corrections,
the teacher's inputs) and the flags the step needs. The step functions (`pipelines/rl.py`) take
the Objective, never the config: this module (with `advantages.py`, the estimators by name) is
the only place that maps a config section to a function of `reroll.algorithms` and its keyword
arguments (`advantages.ESTIMATORS`, `POLICY_LOSSES`, the KL controller, AsyPPO's masks, the
ratio masks and TIS) or to a user's own estimator or policy loss (`name: custom`,
`pipelines/plugins.py`).

The loss closure that a `Strategy.train_step` calls per micro-batch (`make_rl_loss`) is the sum
of its terms: the policy loss (on the advantages), on-policy distillation's divergence (`mode:
dense`), the KL to the reference and the entropy bonus. On-policy distillation `pure`/`mixed`
enters through the advantages instead (`advantages.distill_advantages`).

Batch fields read here: see `reroll.data.batch.RLBatch` (required ones are always there; the
optional ones this module reads are set by the phases exactly when the Objective's flags say).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor

from reroll import algorithms
from reroll.algorithms import distillation
from reroll.config.algorithm import AlgorithmConfig, AsyPPOConfig, CorrectionConfig, KLConfig
from reroll.data.batch import model_kwargs
from reroll.models.logprobs import forward_logprobs
from reroll.models.routing import routed_forward, router_terms
from reroll.models.top_k import logprobs_at
from reroll.pipelines import plugins
from reroll.pipelines.advantages import ESTIMATORS, distill_advantages

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class KLTerm:
    """KL(policy || reference): a loss term (`in_loss`) or a per-token reward penalty."""

    coef: float
    """The configured (starting) coefficient; the controller holds the current one."""
    estimator: str
    in_loss: bool
    in_reward: bool


@dataclass(frozen=True)
class DistillTerm:
    """On-policy distillation, a term of the objective beside KL and entropy: what the step
    fetches from the teacher (`teacher_inputs`) and where its signal enters: the advantages
    (`mode: pure/mixed`, `advantage`) or the loss (`mode: dense`, `loss`)."""

    teacher_inputs: Callable[..., dict[str, Tensor]]
    """fn(teacher, batch, temperature) -> the batch fields it sets (`teacher_logprobs`, or
    `teacher_top_ids`/`teacher_top_logprobs`)."""
    advantage: Callable[[TensorDict, bool], dict[str, float]] | None
    """pure/mixed: fn(batch, has_old_logprobs) -> metrics, replacing or adding to `advantages`."""
    loss: Callable[..., tuple[Tensor, dict]] | None
    """dense: fn(student [B, T, k], micro, mask, agg) -> (divergence loss, metrics)."""
    task_coef: float
    """dense: weight of the task's policy loss beside the divergence (0: none)."""
    names: tuple[str | None, ...]
    """The teachers in routing order (`teacher_route` indexes them)."""

    @property
    def routed(self) -> bool:
        """Several teachers: each sample's teacher comes from its row's tag."""
        return self.names != (None,)


@dataclass(frozen=True)
class Objective:
    """Everything the RL step needs to know about the algorithm, resolved once (`build`)."""

    label: str
    """`advantage/policy_loss`, e.g. `grpo/ppo` (progress bar, finish line)."""
    group_size: int
    temperature: float
    """The sampling temperature: logprobs are taken at it."""
    max_new_tokens: int
    """The response length limit (the overlong penalty, `seq_mean_token_sum_norm`)."""
    estimate: Callable[..., tuple[Tensor, Tensor | None]] | None
    """fn(batch, group_size, token_kl or None, kl_coef) -> (advantages, returns or None); None
    when nothing reads an advantage (dense distillation without the task)."""
    reward_clip: tuple[float, float] | None
    whiten_advantages: bool
    advantage_clip: float | None
    policy_loss: Callable[..., tuple[Tensor, dict]] | None
    """fn(logprobs, old_logprobs, advantages, mask, micro, **agg) -> (loss, metrics); None when
    the loss has no policy term (dense distillation without the task)."""
    loss_agg: str
    counts_chunks: bool
    """The policy loss normalises by chunks (turns), not tokens (ipa_chunk)."""
    kl: KLTerm
    new_kl_controller: Callable[[], algorithms.FixedKLController | algorithms.AdaptiveKLController]
    entropy_coef: float
    old_policy_routing: bool
    """`routing_replay: old_policy` with pi_old computed: its routing is recorded and replayed."""
    router_coefs: tuple[float, float]
    """Mixture-of-experts: the weights of the router's load-balancing loss and z-loss in the
    policy loss (both are logged whatever they are)."""
    distill: DistillTerm | None
    correct: Callable[[TensorDict, Tensor | None], dict[str, float]] | None
    """Off-policy corrections (ratio masks, TIS) of a batch with `old_logprobs`; None: off."""
    sets_is_weights: bool
    """`correct` sets `is_weights` (truncated IS is on)."""
    asyppo: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, dict]] | None
    """AsyPPO's masks from the mini-critics' values; None with fewer than 2 critics."""
    has_critic: bool
    critic_warmup_steps: int
    keep_groups: Callable[[Tensor], Tensor] | None
    """Dynamic sampling: fn(task_rewards [B]) -> [B / group_size] bool; None: keep all."""
    overlong_filter: bool
    soft_penalty: tuple[int, float] | None
    """DAPO's soft overlong penalty (cache, penalty); None: off."""
    updates_per_batch: int
    epochs: int
    skip_zero_advantage: bool
    needs_old_logprobs: bool
    """pi_old is computed before the update: several updates (or passes) per batch, or something
    compares it with the behaviour or reference policy before the loss."""
    advantages_first: bool
    """The advantages can be estimated before the logprobs and values (they read no KL penalty,
    no critic value and no teacher, and no ratio mask will change the normalisers), so pi_old is
    needed only on the samples that `samples_with_gradient` keeps."""


def build(config: AlgorithmConfig, *, group_size: int = 1, temperature: float = 1.0,
          max_new_tokens: int = 1) -> Objective:
    """The Objective of `config`, for samples drawn `group_size` per prompt at `temperature`
    with at most `max_new_tokens` response tokens. A user's estimator or policy loss that cannot
    be imported, or whose signature does not fit, is a ConfigError naming its field."""
    adv, loss, d, kl = config.advantage, config.policy_loss, config.distill, config.kl
    dense = d is not None and d.dense
    estimate = None
    if not (dense and not d.with_task):
        estimate = (plugins.custom_estimator(adv, "algorithm.advantage") if adv.name == "custom"
                    else functools.partial(ESTIMATORS[adv.name], adv))
    policy_loss = None
    if not (dense and not d.with_task):
        policy_loss = (plugins.custom_policy_loss(loss, "algorithm.policy_loss")
                       if loss.name == "custom" else _builtin_policy_loss(loss))
    norm, corr, critic = config.normalize, config.correction, config.critic
    has_reference = kl.coef > 0  # the reference model exists only for a KL term
    ratio_or_tis = corr.tis is not None or corr.ratio_mask is not None
    needs_old = (config.updates_per_batch > 1 or config.epochs > 1
                 or loss.name == "decoupled_ppo" or ratio_or_tis
                 or (kl.in_reward and has_reference))
    sampling = config.dynamic_sampling
    overlong = config.overlong
    # Leaving out zero-advantage samples is exact only for losses of the form advantage x f(ratio),
    # which a user's loss need not be.
    skip = config.skip_zero_advantage and loss.name != "custom"
    return Objective(
        label=f"{adv.name}/{loss.name}", group_size=group_size, temperature=temperature,
        max_new_tokens=max_new_tokens, estimate=estimate, reward_clip=norm.reward_clip,
        whiten_advantages=norm.whiten_advantages, advantage_clip=norm.advantage_clip,
        policy_loss=policy_loss, loss_agg=config.loss_agg, counts_chunks=loss.name == "ipa_chunk",
        kl=KLTerm(kl.coef, kl.estimator, kl.in_loss, kl.in_reward),
        new_kl_controller=functools.partial(kl_controller, kl),
        entropy_coef=config.entropy_coef,
        old_policy_routing=config.routing_replay == "old_policy" and needs_old,
        router_coefs=(config.router_aux_loss_coef, config.router_z_loss_coef),
        distill=None if d is None else _distill_term(d),
        correct=functools.partial(apply_corrections, corr) if ratio_or_tis else None,
        sets_is_weights=corr.tis is not None,
        asyppo=(functools.partial(asyppo_masks, critic.asyppo)
                if critic is not None and critic.num_critics > 1 else None),
        has_critic=critic is not None,
        critic_warmup_steps=critic.warmup_steps if critic is not None else 0,
        keep_groups=None if sampling is None else functools.partial(
            algorithms.dynamic_sampling_keep, group_size=group_size,
            drop_all_equal=sampling.drop_all_equal, min_mean=sampling.min_mean,
            max_mean=sampling.max_mean, min_std=sampling.min_std, max_std=sampling.max_std,
            atol=sampling.atol),
        overlong_filter=overlong.filter,
        soft_penalty=(None if overlong.soft_penalty_cache is None
                      else (overlong.soft_penalty_cache, overlong.soft_penalty)),
        updates_per_batch=config.updates_per_batch, epochs=config.epochs,
        skip_zero_advantage=skip, needs_old_logprobs=needs_old,
        advantages_first=(skip and critic is None
                          and corr.ratio_mask is None and d is None
                          and not (kl.in_reward and has_reference)))


def _distill_term(d) -> DistillTerm:
    if d.dense:
        divergence = distillation.DIVERGENCES[d.divergence]
        if d.divergence == "jsd":
            divergence = functools.partial(divergence, beta=d.beta)
        return DistillTerm(teacher_inputs=functools.partial(_teacher_top_k, d.top_k),
                           advantage=None, task_coef=d.task_coef, names=tuple(d.names()),
                           loss=functools.partial(_dense_divergence, d.divergence, divergence))
    return DistillTerm(teacher_inputs=_teacher_logprobs, loss=None, task_coef=0.0,
                       advantage=functools.partial(distill_advantages, d.mode, d.coef,
                                                   d.baseline, tuple(d.names())),
                       names=tuple(d.names()))


def _teacher_logprobs(teacher, batch: TensorDict, temperature: float) -> dict[str, Tensor]:
    return {"teacher_logprobs": teacher.logprobs(batch, temperature)}


def _teacher_top_k(k: int, teacher, batch: TensorDict, temperature: float) -> dict[str, Tensor]:
    """The teacher's top-k next tokens and their logprobs at every response position."""
    top = teacher.top_k(batch, k, temperature)
    return {"teacher_top_ids": top["ids"], "teacher_top_logprobs": top["logprobs"]}

# ----------------------------------------------------------------------------- advantages


def estimate_advantages(obj: Objective, batch: TensorDict, *,
                        kl_coef: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """Advantages [B, T] (0 off the response) and returns [B, T] (token-level estimators) or None.

    Order: reward clip -> estimator (with the KL reward penalty `batch["token_kl"]` x `kl_coef`
    in `kl.mode: reward`) -> whitening -> advantage clip. The clip applies to every reward an
    estimator may read: the scalar `rewards` and each turn's `turn_rewards`.
    """
    mask = batch["response_mask"]
    if obj.reward_clip is not None:
        batch = batch.clone(recurse=False)
        for key in ("rewards", "turn_rewards"):
            batch[key] = algorithms.clip_rewards(batch[key], *obj.reward_clip)
    kl = batch["token_kl"] if obj.kl.in_reward and kl_coef > 0 else None
    advantages, returns = obj.estimate(batch, obj.group_size, kl, kl_coef)
    if obj.whiten_advantages:
        advantages = algorithms.whiten_advantages(advantages, mask)
    if obj.advantage_clip is not None:
        advantages = algorithms.clip_advantages(advantages, obj.advantage_clip)
    return advantages * mask, returns


# ----------------------------------------------------------------------------- policy losses


def _knobs(loss, *names: str) -> dict:
    return {name: getattr(loss, name) for name in names}


# name -> (fn, knobs(loss config, micro-batch) -> keyword arguments beyond the shared ones).
# `custom`: `plugins.custom_policy_loss`.
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
                  lambda c, m: _knobs(c, "clip_low", "clip_high") | {"turn_ids": m["turn_ids"]}),
}


def _builtin_policy_loss(loss) -> Callable:
    """fn(logprobs, old_logprobs, advantages, mask, micro, is_weights, **agg) -> (loss, metrics)."""
    fn, knobs = POLICY_LOSSES[loss.name]

    def policy_loss(logprobs, old, advantages, mask, micro, is_weights, **agg):
        return fn(logprobs, old, advantages, mask, **knobs(loss, micro), is_weights=is_weights,
                  **agg)

    return policy_loss


def make_rl_loss(obj: Objective, batch: TensorDict, *, kl_coef: float | None = None
                 ) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """The loss over one micro-batch, normalised by counts over the whole `batch`, so summing
    micro-batch losses gives the full-batch loss (and gradient). Its terms: the policy loss on
    the advantages (with `distill.mode: dense`, the divergence instead, and the policy loss x
    `task_coef` beside it when > 0), the KL to the reference (`kl_coef`: the controller's current
    value, default `kl.coef`) when it is in the loss, and the entropy bonus.

    Ratio masks and AsyPPO's masks zero a token's weight but leave it in the count (IcePop's
    1/sum|y_i|, AsyPPO's masked advantage): `normaliser_mask` is the loss mask before them."""
    count_mask = batch["normaliser_mask"]
    tokens = _normalisers(obj, count_mask)
    agg = {"agg": tokens["mode"], **{k: v for k, v in tokens.items() if k != "mode"}}
    policy_agg = dict(agg)
    if obj.counts_chunks:  # ipa_chunk: its token_mean normaliser counts chunks
        policy_agg["num_tokens"] = algorithms.chunk_count(batch["turn_ids"], count_mask)
    kl_coef = obj.kl.coef if kl_coef is None else kl_coef
    kl_in_loss = obj.kl.in_loss and kl_coef > 0
    dense = obj.distill.loss if obj.distill is not None else None
    whole = batch.batch_size[0]

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask, response = micro["loss_mask"], micro["response_mask"]
        extra = model_kwargs(micro, micro["input_ids"].device)  # images' pixel values...
        if dense is not None and extra:  # refused at start (validation); never drop them
            raise ValueError("dense distillation does not take image prompts yet")
        # routing replay (algorithm.routing_replay): the batch carries the routing to force
        record = micro.get("routed_experts", micro.get("old_routed_experts"))
        with routed_forward(model, record) as router_logits:
            if dense is not None:  # the student at the teacher's top-k ids and the sampled token
                ids = torch.cat([micro["teacher_top_ids"], micro["input_ids"][..., None]], -1)
                student, entropy = logprobs_at(model, micro["input_ids"],
                                               micro["attention_mask"], response, ids,
                                               obj.temperature)
                logprobs = student[..., -1]
            else:
                logprobs, entropy = forward_logprobs(
                    model, micro["input_ids"], micro["attention_mask"], obj.temperature,
                    with_entropy=True, response_mask=response,
                    entropy_grad=obj.entropy_coef > 0, model_inputs=extra)
        old = pi_old(obj, micro, logprobs)
        # Train/inference mismatch: how far the engine's sampling distribution is from the policy.
        metrics = {"actor/behaviour_kl_k3": algorithms.masked_mean(
                       algorithms.behaviour_kl_k3(old.detach(), micro["behaviour_logprobs"],
                                                  response), response),
                   "actor/entropy": algorithms.masked_mean(entropy.detach(), response)}
        loss = None
        if obj.policy_loss is not None:
            weights = micro["is_weights"] if obj.sets_is_weights else None
            loss, raw = obj.policy_loss(logprobs, old, micro["advantages"], mask, micro,
                                        weights, **policy_agg)
            metrics |= {f"actor/{k}": v for k, v in raw.items()}
        if dense is not None:
            divergence, parts = dense(student[..., :-1], micro, mask, agg)
            metrics |= parts
            if loss is None:
                loss = divergence
            else:  # task_coef > 0: the task's policy loss joins the divergence
                loss, parts = algorithms.dense_distill_with_task_loss(divergence, loss,
                                                                      obj.distill.task_coef)
                # Each part is this micro-batch's share of the batch's; the trainer averages
                # metrics weighted by micro-batch size, so scaled back they log the batch's.
                scale = whole / micro.batch_size[0]
                metrics |= {f"distill/{k}": v * scale for k, v in parts.items()}
        if kl_in_loss:
            kl = algorithms.kl_estimate(logprobs, micro["ref_logprobs"], obj.kl.estimator)
            loss = loss + kl_coef * algorithms.aggregate_loss(kl, mask, **tokens)
            metrics["actor/kl_ref"] = algorithms.masked_mean(kl.detach(), mask)
        if obj.entropy_coef > 0:
            bonus = algorithms.aggregate_loss(entropy, micro["entropy_mask"], **tokens)
            loss = loss - obj.entropy_coef * bonus
        if router_logits:
            loss = _with_router_terms(obj, model, router_logits, micro, loss, whole, metrics)
        if record is not None:  # the share of the micro-batch's tokens whose routing was forced
            metrics["actor/routing_replayed"] = algorithms.masked_mean(
                (record >= 0).all(-1).all(-1).float(), micro["attention_mask"].float())
        return loss, metrics

    return loss_fn


def _with_router_terms(obj: Objective, model: torch.nn.Module, router_logits: list[Tensor],
                       micro: TensorDict, loss: Tensor, whole: int, metrics: dict) -> Tensor:
    """Log the router's auxiliary and z-losses; add them at `obj.router_coefs`, each a mean over
    the micro-batch's tokens, weighted by its share of the batch (the micro-batch losses sum)."""
    aux, z = router_terms(model, router_logits, micro["attention_mask"])
    metrics["actor/router_aux_loss"], metrics["actor/router_z_loss"] = aux.detach(), z.detach()
    aux_coef, z_coef = obj.router_coefs
    if aux_coef > 0 or z_coef > 0:
        loss = loss + (aux_coef * aux + z_coef * z) * (micro.batch_size[0] / whole)
    return loss


def _dense_divergence(name: str, divergence: Callable, student: Tensor, micro: TensorDict,
                      mask: Tensor, agg: dict) -> tuple[Tensor, dict]:
    """`mode: dense` (GKD): the divergence between the teacher's top-k (`teacher_top_logprobs`
    [B, T, k]) and the student's distribution at its ids, at every loss token. The student's
    logprobs are gathered a chunk of positions at a time (`reroll.models.top_k`), never as
    [B, T, V]."""
    loss, raw = algorithms.dense_distill_loss(student, micro["teacher_top_logprobs"], mask,
                                              divergence, **agg)
    return loss, {f"distill/{name}": raw["divergence"]}


def pi_old(obj: Objective, micro: TensorDict, logprobs: Tensor) -> Tensor:
    """The micro-batch's stored old logprobs; without them the update is on-policy and pi_old is
    the current policy (`logprobs`, detached)."""
    return micro["old_logprobs"] if obj.needs_old_logprobs else logprobs.detach()


def samples_with_gradient(obj: Objective, batch: TensorDict, kl_coef: float,
                          multiple: int = 1) -> Tensor:
    """Indices of the samples the update must run on: with `skip_zero_advantage`, those whose
    advantage is non-zero on some loss token (the others' gradient is exactly 0), topped up with
    skipped ones to a non-zero multiple of `multiple` (the data-parallel ranks, which each need an
    equal share). Every sample when a KL term in the loss, an entropy bonus or a dense
    distillation divergence depends on them."""
    size = batch.batch_size[0]
    exact = not (obj.kl.in_loss and kl_coef > 0) and obj.entropy_coef == 0 \
        and not (obj.distill is not None and obj.distill.loss is not None)
    if not (obj.skip_zero_advantage and exact):
        return torch.arange(size)
    signal = ((batch["advantages"] != 0) & (batch["loss_mask"] > 0)).any(-1)
    keep, skip = signal.nonzero().squeeze(-1), (~signal).nonzero().squeeze(-1)
    wanted = min(size, max(multiple, -(-len(keep) // multiple) * multiple))
    return torch.cat([keep, skip[:wanted - len(keep)]]).sort().values


def _normalisers(obj: Objective, mask: Tensor) -> dict:
    num_tokens, num_seqs = algorithms.loss_normalisers(mask)
    return {"mode": obj.loss_agg, "num_tokens": num_tokens, "num_seqs": num_seqs,
            "max_len": obj.max_new_tokens}

# ----------------------------------------------------------------------------- KL, AsyPPO


def kl_controller(config: KLConfig) -> algorithms.FixedKLController | algorithms.AdaptiveKLController:
    """The controller that holds the current KL coefficient (`.value`)."""
    ctl = config.controller
    if ctl.name == "adaptive":
        return algorithms.AdaptiveKLController(config.coef, ctl.target, ctl.horizon)
    return algorithms.FixedKLController(config.coef)


def reward_kl(kl: KLTerm, old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token KL(pi_old || pi_ref) for the reward penalty, detached, 0 off the response."""
    value = algorithms.kl_estimate(old_logprobs, ref_logprobs, kl.estimator)
    return torch.where(mask.bool(), value, torch.zeros_like(value)).detach()


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


# ----------------------------------------------------------------------------- corrections


def apply_corrections(config: CorrectionConfig, batch: TensorDict,
                      rows: Tensor | None = None) -> dict[str, float]:
    """Ratio masks shrink `loss_mask` (and `entropy_mask` with it); truncated IS sets
    `is_weights`. Compares `old_logprobs` (pi_old) with `behaviour_logprobs` (mu, recorded by
    the engine) and logs the mismatch, over `rows` only when pi_old was computed on those only."""
    old, behaviour = batch["old_logprobs"], batch["behaviour_logprobs"]
    response, mask = batch["response_mask"], batch["loss_mask"]
    if rows is not None:
        computed = torch.zeros(response.shape[0], 1, dtype=response.dtype)
        computed[rows] = 1
        response = response * computed
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
        batch["entropy_mask"] = mask.clone()
    if config.tis is not None:
        weights = algorithms.TIS_LEVELS[config.tis.level](old, behaviour, mask, cap=config.tis.cap,
                                                          turn_ids=batch["turn_ids"])
        batch["is_weights"] = weights
        metrics["correction/tis_weight_mean"] = float(algorithms.masked_mean(
            weights, mask if rows is None else mask * response))
    return metrics


# ----------------------------------------------------------------------------- SFT


def sft_loss(batch: TensorDict) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """Token cross-entropy on response tokens, averaged over all response tokens of `batch`."""
    num_tokens, _ = algorithms.loss_normalisers(batch["response_mask"])

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"]
        logprobs, _ = forward_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                       response_mask=mask,
                                       model_inputs=model_kwargs(micro, micro["input_ids"].device))
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
