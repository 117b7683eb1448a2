"""From the `algorithm:` config to calls of the pure functions in `reroll.algorithms`.

The config picks functions by name (a typed union); this module is the only place that maps a
config section to a function and its keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from reroll import algorithms
from reroll.config.schema import AlgorithmConfig
from reroll.models.logprobs import forward_logprobs


def compute_advantages(config: AlgorithmConfig, rewards: torch.Tensor, group_size: int,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """Scalar rewards [B] -> per-token advantages [B, L] on response tokens."""
    adv = config.advantage
    if adv.name == "grpo":
        per_sample = algorithms.grpo_advantages(rewards, group_size, scale_by_std=adv.scale_by_std,
                                                eps=adv.eps)
    else:
        raise ValueError(f"algorithm.advantage.name {adv.name!r} has no implementation")
    return algorithms.broadcast_to_tokens(per_sample, response_mask)


def policy_loss_fn(config: AlgorithmConfig) -> Callable:
    loss = config.policy_loss
    if loss.name == "ppo":
        def ppo(logprobs, old, adv, mask, **agg):
            return algorithms.ppo_clip_loss(logprobs, old, adv, mask, clip_low=loss.clip_low,
                                            clip_high=loss.clip_high, dual_clip=loss.dual_clip,
                                            **agg)
        return ppo
    raise ValueError(f"algorithm.policy_loss.name {loss.name!r} has no implementation")


def make_rl_loss(config: AlgorithmConfig, batch: TensorDict, temperature: float,
                 max_response_len: int) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """The loss over one micro-batch, normalised by counts over the whole `batch`, so summing
    micro-batch losses gives the full-batch loss (and gradient)."""
    num_tokens, num_seqs = algorithms.loss_normalisers(batch["response_mask"])
    agg = {"agg": config.loss_agg, "num_tokens": num_tokens, "num_seqs": num_seqs,
           "max_len": max_response_len}
    policy_loss = policy_loss_fn(config)

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"]
        logprobs, entropy = forward_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                             temperature, with_entropy=True)
        # Without stored old logprobs the update is on-policy: pi_old is the current policy.
        old = micro["old_logprobs"] if "old_logprobs" in micro.keys() else logprobs.detach()
        loss, raw = policy_loss(logprobs, old, micro["advantages"], mask, **agg)
        metrics = {f"actor/{k}": float(v) for k, v in raw.items()}
        # Train/inference mismatch: how far the engine's sampling distribution is from the policy.
        mismatch = old.detach() - micro["behaviour_logprobs"]
        metrics["actor/behaviour_kl_k3"] = float(algorithms.masked_mean(
            torch.exp(-mismatch) - 1 + mismatch, mask))
        metrics["actor/entropy"] = float(algorithms.masked_mean(entropy.detach(), mask))
        if config.kl.coef > 0:
            kl = algorithms.kl_estimate(logprobs, micro["ref_logprobs"], config.kl.estimator)
            loss = loss + config.kl.coef * algorithms.aggregate_loss(kl, mask, **_mode(agg))
            metrics["actor/kl_ref"] = float(algorithms.masked_mean(kl.detach(), mask))
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * algorithms.aggregate_loss(entropy, mask, **_mode(agg))
        return loss, metrics

    return loss_fn


def _mode(agg: dict) -> dict:
    return {"mode": agg["agg"], **{k: v for k, v in agg.items() if k != "agg"}}


def sft_loss(batch: TensorDict) -> Callable[[torch.nn.Module, TensorDict], tuple]:
    """Token cross-entropy on response tokens, averaged over all response tokens of `batch`."""
    num_tokens, _ = algorithms.loss_normalisers(batch["response_mask"])

    def loss_fn(model: torch.nn.Module, micro: TensorDict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"]
        logprobs, _ = forward_logprobs(model, micro["input_ids"], micro["attention_mask"])
        loss = algorithms.aggregate_loss(-logprobs, mask, "token_mean", num_tokens=num_tokens)
        return loss, {"sft/nll": float(algorithms.masked_mean(-logprobs.detach(), mask))}

    return loss_fn
