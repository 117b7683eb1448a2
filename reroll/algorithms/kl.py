"""KL(pi_theta || pi_ref) estimators, the KL reward penalty and KL coefficient controllers.

Estimators follow J. Schulman, "Approximating KL divergence" (2020), with samples drawn from
pi_theta and log r = log pi_ref - log pi_theta:
    k1 = -log r                    (unbiased, high variance, can be negative)
    k2 = (log r)^2 / 2             (biased, low variance, >= 0)
    k3 = (r - 1) - log r           (unbiased, low variance, >= 0; verl's ``low_var_kl``)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import LOG_RATIO_CLAMP

# Numerical safety for k3: the log ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before
# exp, and k3 itself to at most K3_MAX (the same bounds as verl's low_var_kl). Both only bind
# when the two policies disagree by a factor of e^10 on a token.
K3_MAX = 10.0


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi_theta - log pi_ref, elementwise."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi_theta - log pi_ref)^2, elementwise."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(l) - l - 1 with l = clamp(log pi_ref - log pi_theta, +-20), clamped to <= 10."""
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(max=K3_MAX)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref).

    logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens under the policy and
    the reference model. estimator: "k1" | "k2" | "k3" (see the module docstring; k3 clamps
    its log ratio to +-20 and its value to <= 10 for numerical safety). Returns [B, T];
    reduce it with ``aggregate_loss`` for a KL loss term.
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; one of {list(KL_ESTIMATORS)}"
        ) from None
    return fn(logprobs, ref_logprobs)


def kl_penalty_rewards(token_rewards: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """KL as a per-token reward penalty: r'_t = r_t - beta * kl_t on valid tokens, 0 elsewhere.

    token_rewards, kl, mask: [B, T]. ``kl`` is usually ``kl_estimate(.., "k1")`` (detached).
    """
    out = token_rewards - beta * kl
    return torch.where(mask.bool(), out, torch.zeros_like(out))


@dataclass
class FixedKLController:
    """A constant KL coefficient (``value``); ``update`` is a no-op."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences".

    e = clip(current_kl / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    ``n_steps`` is the number of samples (or steps) since the last update.
    """

    value: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
