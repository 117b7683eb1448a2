"""The advantage estimators by name (`ESTIMATORS`): each adapts the RL batch to its function
of `reroll.algorithms` (outcome estimators on one score per response, token-level ones on each
turn's reward at its last token, turn-level ones on the turns), with the KL reward penalty
where `kl.mode: reward` asks for it; and on-policy distillation's advantage
(`distill_advantages`). `reroll.pipelines.objective` picks one at start (`build`) and applies
it with the reward clip, whitening and advantage clip (`estimate_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable

from tensordict import TensorDict
from torch import Tensor

from reroll import algorithms


def _penalised_outcomes(rewards: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """Outcome estimators see a KL reward penalty as its sum over the response (as verl does)."""
    if kl is None:
        return rewards
    return rewards - kl_coef * algorithms.masked_sum(kl, mask, -1)


def _turn_inputs(batch: TensorDict, kl: Tensor | None, kl_coef: float) -> tuple[Tensor, Tensor]:
    """(turn_rewards [B, K], turn_ids [B, T]), a KL penalty summed over each turn's tokens. (A
    single-turn response is one turn holding its reward: `RLBatch`.)"""
    mask, turn_ids = batch["response_mask"], batch["turn_ids"]
    turn_rewards = batch["turn_rewards"].float()
    if kl is not None:
        turn_rewards = turn_rewards - kl_coef * algorithms.turn_sums(kl * mask, turn_ids,
                                                                     turn_rewards.shape[1])
    return turn_rewards, turn_ids


def _outcome(fn: Callable[..., Tensor]) -> Callable:
    """An estimator of one scalar per response: fn(config, outcomes [B], group_size, valid [B])
    (`valid`: the samples in the group and batch statistics, not infrastructure failures)."""
    def estimate(cfg, batch, group_size, kl, kl_coef):
        mask = batch["response_mask"]
        outcomes = _penalised_outcomes(batch["rewards"], mask, kl, kl_coef)
        per_sample = fn(cfg, outcomes, group_size, batch["valid"])
        return algorithms.broadcast_to_tokens(per_sample, mask), None
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
    baseline = algorithms.group_mean(token_rewards.sum(-1), group_size, batch["valid"])
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
    # Without environment states (`state_ids` -1), turn k of each episode of a group is one
    # anchor state.
    turn_rewards, turn_ids = _turn_inputs(batch, kl, kl_coef)
    return algorithms.gigpo_advantages(
        turn_rewards, turn_ids, batch["state_ids"], group_size, gamma=cfg.gamma,
        step_weight=cfg.step_weight, scale_by_std=cfg.scale_by_std, eps=cfg.eps,
        valid=batch["valid"])


def _ipa_chunk(cfg, batch, group_size, kl, kl_coef):
    turn_rewards, turn_ids = _turn_inputs(batch, kl, kl_coef)
    return algorithms.ipa_chunk_advantages(turn_rewards, turn_ids, gamma=cfg.gamma)


# name -> fn(advantage config, batch, group_size, token_kl or None, kl_coef)
#         -> (advantages [B, T], returns [B, T] or None). `custom`: `plugins.custom_estimator`.
ESTIMATORS: dict[str, Callable] = {
    "grpo": _outcome(lambda c, r, g, v: algorithms.normalize_rewards(
        r, g, mean_level=c.mean, std_level=c.std, eps=c.eps, valid=v)),
    "dr_grpo": _outcome(lambda c, r, g, v: algorithms.dr_grpo_advantages(r, g, v)),
    "lite_ppo": _outcome(lambda c, r, g, v: algorithms.lite_ppo_advantages(r, g, eps=c.eps,
                                                                           valid=v)),
    "rloo": _outcome(lambda c, r, g, v: algorithms.rloo_advantages(r, g, v)),
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
    "rebn": _rebn,
    "gigpo": _gigpo,
    "ipa_chunk": _ipa_chunk,
}



def distill_advantages(mode: str, coef: float, baseline: str, names: tuple[str | None, ...],
                       batch: TensorDict, has_old_logprobs: bool) -> dict[str, float]:
    """On-policy distillation (`pure`/`mixed`): the teacher's per-token advantage on the
    student's own tokens (log pi_T - log pi_old, less the batch mean with `baseline: mean`)
    replaces (`pure`) or joins (`mixed`, x `coef`) the task's. `distill/reverse_kl` is the mean
    of the raw log-ratio (and, with several teachers, of each one's on its samples)."""
    student = batch["old_logprobs"] if has_old_logprobs else batch["behaviour_logprobs"]
    mask = batch["response_mask"]
    advantage = algorithms.on_policy_distill_advantages(batch["teacher_logprobs"], student, mask,
                                                        baseline)
    batch["advantages"] = advantage if mode == "pure" else batch["advantages"] + coef * advantage
    log_ratio = (batch["teacher_logprobs"] - student) * mask  # before any baseline
    metrics = {"distill/reverse_kl": float(algorithms.masked_mean(-log_ratio, mask))}
    if names != (None,):
        for i, name in enumerate(names):
            rows = batch["teacher_route"] == i
            if bool(rows.any()):
                metrics[f"distill/reverse_kl/{name or 'default'}"] = float(
                    algorithms.masked_mean(-log_ratio[rows], mask[rows]))
    return metrics
