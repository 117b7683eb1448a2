"""Preference losses: the DPO family, reference-free SimPO and ORPO, and Bradley–Terry.

Every function takes per-pair sequence log-probabilities ([B] tensors, one entry per
(chosen, rejected) pair) and returns ``(loss, metrics)``: the loss is the SUM of the per-pair
losses divided by ``num_pairs`` (the whole batch's pair count when the batch is split into
micro-batches, so that the micro-batch losses add up to the batch mean; None: this call's B).
Metrics are detached means over this call's pairs.

Notation: ``pi_c``/``pi_r`` are log pi_theta(y|x) of the chosen/rejected response (summed over
its tokens unless a loss says otherwise), ``ref_c``/``ref_r`` the same under the frozen
reference policy. The implicit reward of DPO is ``r(y) = beta * (pi(y) - ref(y))``; a pair is
ranked correctly when ``r(y_c) > r(y_r)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

Metrics = dict[str, float | Tensor]


def _mean_loss(per_pair: Tensor, num_pairs: int | None) -> Tensor:
    return per_pair.sum() / (num_pairs if num_pairs is not None else per_pair.shape[0])


def _margin_metrics(chosen_reward: Tensor, rejected_reward: Tensor) -> Metrics:
    """Mean rewards, margin, and accuracy: the share of pairs ranked right, a tie counting half
    (a coin flip), so that a policy equal to its reference scores 0.5, not 0."""
    c, r = chosen_reward.detach(), rejected_reward.detach()
    accuracy = (c > r).float() + 0.5 * (c == r).float()
    return {"reward_chosen": c.mean(), "reward_rejected": r.mean(),
            "reward_margin": (c - r).mean(), "accuracy": accuracy.mean()}


def dpo_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor, *, beta: float,
             label_smoothing: float = 0.0, num_pairs: int | None = None
             ) -> tuple[Tensor, Metrics]:
    """DPO (Rafailov et al. 2023), sigmoid form, with conservative DPO's label smoothing.

        h    = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        loss = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)

    eps = ``label_smoothing`` is the assumed probability that a label is flipped (cDPO, Mitchell
    2023); eps = 0 is plain DPO. Inputs [B]; gradients flow through ``pi_c``, ``pi_r`` only.
    """
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    h = chosen - rejected
    per_pair = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return _mean_loss(per_pair, num_pairs), _margin_metrics(chosen, rejected)


def ipo_loss(pi_c: Tensor, pi_r: Tensor, ref_c: Tensor, ref_r: Tensor, *, beta: float,
             num_pairs: int | None = None) -> tuple[Tensor, Metrics]:
    """IPO (Azar et al. 2023): a squared loss that regresses the log-ratio margin to 1/(2 beta)
    instead of pushing it to infinity, so it does not overfit deterministic preferences.

        m    = (pi_c - ref_c) - (pi_r - ref_r)
        loss = (m - 1 / (2 * beta)) ** 2

    As TRL does, callers pass token-AVERAGED log-probabilities (the paper's sums make the target
    margin depend on length). Metrics report the rewards ``beta * (pi - ref)``. Inputs [B].
    """
    chosen, rejected = pi_c - ref_c, pi_r - ref_r
    per_pair = (chosen - rejected - 1 / (2 * beta)) ** 2
    return _mean_loss(per_pair, num_pairs), _margin_metrics(beta * chosen, beta * rejected)


def simpo_loss(avg_c: Tensor, avg_r: Tensor, *, beta: float, gamma: float,
               num_pairs: int | None = None) -> tuple[Tensor, Metrics]:
    """SimPO (Meng et al. 2024): reference-free; the reward is the length-normalised
    log-likelihood, and the chosen one must win by a target margin ``gamma``.

        h    = beta * avg_c - beta * avg_r - gamma
        loss = -log sigmoid(h)

    ``avg_c``/``avg_r`` [B] are token-averaged log pi_theta of each response.
    """
    chosen, rejected = beta * avg_c, beta * avg_r
    per_pair = -F.logsigmoid(chosen - rejected - gamma)
    return _mean_loss(per_pair, num_pairs), _margin_metrics(chosen, rejected)


def log_odds(avg_logprob: Tensor) -> Tensor:
    """log(p / (1 - p)) of p = exp(avg_logprob) (a probability in (0, 1]): computed as
    avg - log(1 - exp(avg)) with expm1 for accuracy; p = 1 is clamped to a large finite value."""
    return avg_logprob - torch.log(-torch.expm1(avg_logprob.clamp(max=-1e-6)))


def orpo_loss(avg_c: Tensor, avg_r: Tensor, nll_c: Tensor, *, lam: float,
              num_pairs: int | None = None) -> tuple[Tensor, Metrics]:
    """ORPO (Hong et al. 2024): reference-free; SFT on the chosen response plus an odds-ratio
    term that makes the chosen response's odds beat the rejected one's.

        loss = nll_c - lam * log sigmoid(log_odds(avg_c) - log_odds(avg_r))

    ``avg_c``/``avg_r`` [B] are token-averaged log pi_theta; ``nll_c`` [B] the chosen response's
    token-averaged negative log-likelihood (-avg_c for a plain SFT term). Metrics report the
    rewards ``lam * avg`` (as TRL) and ``log_odds_ratio``.
    """
    ratio = log_odds(avg_c) - log_odds(avg_r)
    per_pair = nll_c - lam * F.logsigmoid(ratio)
    metrics = _margin_metrics(lam * avg_c, lam * avg_r)
    metrics["log_odds_ratio"] = ratio.detach().mean()
    metrics["nll"] = nll_c.detach().mean()
    return _mean_loss(per_pair, num_pairs), metrics


def bradley_terry_loss(score_c: Tensor, score_r: Tensor, *, margin: Tensor | None = None,
                       center_coef: float = 0.0, num_pairs: int | None = None
                       ) -> tuple[Tensor, Metrics]:
    """The reward model's Bradley–Terry loss: P(chosen > rejected) = sigmoid(s_c - s_r).

        loss = -log sigmoid(s_c - s_r - margin) + center_coef * (s_c + s_r) ** 2

    ``score_c``/``score_r`` [B] are the scalar scores; ``margin`` [B] an optional required gap
    (Llama 2's margin loss); ``center_coef`` keeps the scores centred on 0 (as TRL's
    ``center_rewards_coefficient``), which a reward used inside RL likes.
    """
    gap = score_c - score_r - (margin if margin is not None else 0.0)
    per_pair = -F.logsigmoid(gap) + center_coef * (score_c + score_r) ** 2
    return _mean_loss(per_pair, num_pairs), _margin_metrics(score_c, score_r)
