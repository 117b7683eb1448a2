"""Knowledge distillation losses on a teacher's top-k next-token distribution.

A teacher's full next-token distribution is V numbers per token (49k-152k for real vocabularies);
the teacher gives its k most likely token ids and their log-probabilities instead, and every loss
here compares the two models on k + 1 buckets: the teacher's k tokens, and one "tail" bucket
holding all the other tokens' probability (1 - the k probabilities, for each model). Bucketing
can only merge probability, so each divergence below is a lower bound of the full-vocabulary one,
exact when the tail is empty (k = V), and the gap shrinks as the teacher's tail mass does.

Shapes: `student_logprobs` [..., k] are the student's log-probabilities *of the teacher's top-k
ids* (gathered from its full log-softmax, so they carry gradients), `teacher_logprobs` [..., k];
every divergence returns one value per token [...]. Pure tensor functions; hand-checked in
tests/algorithms/test_distillation.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .aggregation import aggregate_loss, masked_mean

TAIL_FLOOR = 1e-12
"""Smallest tail probability (the top-k can hold all the mass up to float rounding)."""


def bucketed(logprobs: torch.Tensor) -> torch.Tensor:
    """[N, k] log-probabilities -> [N, k + 1] log-probabilities, the last bucket the rest:
    log(1 - sum_k p_k), floored at TAIL_FLOOR. The sum is taken in float64: a small tail is the
    difference of two numbers near 1."""
    tail = (1 - logprobs.double().exp().sum(-1)).clamp_min(TAIL_FLOOR).log().to(logprobs.dtype)
    return torch.cat([logprobs, tail[..., None]], -1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_i p_i (log p_i - log q_i) over the last dimension."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def forward_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token: mass-covering (the student spreads over every token the
    teacher finds likely); with one-hot teachers it is cross-entropy. Classic (Hinton) KD."""
    return _kl(bucketed(teacher_logprobs), bucketed(student_logprobs))


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) per token: mode-seeking (the student may drop teacher modes but is
    punished for mass where the teacher has little); MiniLLM's objective."""
    return _kl(bucketed(student_logprobs), bucketed(teacher_logprobs))


def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    beta: float = 0.5) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per token, with M = beta T + (1 - beta) S:
    JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M). beta = 0.5 is the symmetric JSD; it moves
    from forward-KL-like (beta -> 0, in gradient) to reverse-KL-like (beta -> 1)."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    log_t, log_s = bucketed(teacher_logprobs), bucketed(student_logprobs)
    log_m = torch.logsumexp(torch.stack([log_t + torch.log(torch.tensor(beta)),
                                         log_s + torch.log(torch.tensor(1 - beta))]), 0)
    return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": generalized_jsd}


def dense_distill_loss(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       mask: torch.Tensor, divergence: Callable[..., torch.Tensor],
                       agg: str = "token_mean", **normalisers) -> tuple[torch.Tensor, dict]:
    """GKD's on-policy loss (Agarwal et al. 2024, lambda = 1): on the student's own samples
    y ~ pi_S, the divergence between the teacher's and the student's next-token distributions
    at EVERY response position, L = agg_{i,t} D(pi_T(.|y_<t), pi_S(.|y_<t)) m_{i,t}, with D one
    of `DIVERGENCES` (k top teacher tokens + the tail bucket) and `agg` a loss aggregation
    (`aggregate_loss`; pass the whole batch's `normalisers` so micro-batch losses add up). The
    samples are constants: the gradient flows through the student's distribution at each
    position, never through the sampling (unlike the one-sample advantage above).
    Shapes: `student_logprobs`, `teacher_logprobs` [B, T, k] (the student's at the teacher's
    top-k ids), `mask` [B, T]. Returns (loss, {"divergence": the mean per-token value})."""
    per_token = divergence(student_logprobs, teacher_logprobs)
    loss = aggregate_loss(per_token, mask, agg, **normalisers)
    return loss, {"divergence": masked_mean(per_token.detach(), mask)}


def dense_distill_with_task_loss(divergence_loss: torch.Tensor, task_loss: torch.Tensor,
                                task_coef: float) -> tuple[torch.Tensor, dict]:
    """Dense distillation plus the task: L = L_div + task_coef * L_task, with `divergence_loss`
    the aggregated `dense_distill_loss` and `task_loss` the policy loss on the task reward's
    advantage (both scalars over the same batch, with the same normalisers, so micro-batch sums
    still add up). Returns (loss, {"divergence_loss", "task_loss"}: the two parts, unweighted)."""
    if task_coef < 0:
        raise ValueError(f"task_coef must be >= 0, got {task_coef}")
    loss = divergence_loss + task_coef * task_loss
    return loss, {"divergence_loss": divergence_loss.detach(), "task_loss": task_loss.detach()}


def on_policy_distill_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                                 mask: torch.Tensor, baseline: str = "none") -> torch.Tensor:
    """On-policy distillation's per-token advantage, A_t = log pi_T(y_t) - log pi_S(y_t) on the
    student's own sampled tokens (0 off `mask`): the negative of the single-sample estimate of the
    per-token reverse KL, so a policy-gradient step on it lowers KL(student || teacher) where the
    student actually goes (Agarwal et al., GKD; Thinking Machines' on-policy distillation).
    Shapes [B, T]; no gradient (advantages are constants).

    `baseline="mean"` subtracts the mean of A_t over the batch's `mask` tokens. E_{y~pi_S}[A_t]
    = -KL_t <= 0, so without it nearly every sampled token is pushed down and the step is
    carried by the spread of a one-sample estimate; a constant baseline leaves the expected
    gradient unchanged (E_{y~pi_S}[grad log pi_S(y)] = 0 at every position) and pushes up the
    tokens the teacher likes better than the student's average."""
    if baseline not in ("none", "mean"):
        raise ValueError(f"baseline must be 'none' or 'mean', got {baseline!r}")
    advantages = (teacher_logprobs - student_logprobs) * mask
    if baseline == "mean":
        mean = advantages.sum() / mask.sum().clamp_min(1)
        advantages = (advantages - mean) * mask
    return advantages.detach()
