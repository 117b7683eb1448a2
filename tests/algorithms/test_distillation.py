"""The distillation divergences on hand-computed two-bucket cases, their properties on random
ones (zero at equality, non-negative, bucketing never overstates the full divergence), and the
on-policy distillation advantage."""

import math

import pytest
import torch

from reroll.algorithms.distillation import (
    bucketed,
    dense_distill_loss,
    dense_distill_with_task_loss,
    forward_kl,
    generalized_jsd,
    on_policy_distill_advantages,
    reverse_kl,
)

pytestmark = pytest.mark.unit

# One top-k token: teacher 0.5 (tail 0.5), student 0.25 (tail 0.75).
TEACHER = torch.tensor([[math.log(0.5)]])
STUDENT = torch.tensor([[math.log(0.25)]])


def test_the_tail_bucket_holds_the_rest():
    assert bucketed(torch.log(torch.tensor([[0.2, 0.3]]))).exp().tolist()[0] == \
        pytest.approx([0.2, 0.3, 0.5])


def test_forward_kl_by_hand():
    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 (0.693147 - 0.405465)
    assert float(forward_kl(STUDENT, TEACHER)) == pytest.approx(0.143841, abs=1e-6)


def test_reverse_kl_by_hand():
    # 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099
    assert float(reverse_kl(STUDENT, TEACHER)) == pytest.approx(0.130812, abs=1e-6)


def test_jsd_by_hand():
    # M = (0.375, 0.625); KL(T||M) = 0.032269, KL(S||M) = 0.035375; half of each
    assert float(generalized_jsd(STUDENT, TEACHER, 0.5)) == pytest.approx(0.033822, abs=1e-6)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(STUDENT, TEACHER, 1.0)


def test_dense_loss_by_hand():
    # Positions (masked, (T 0.5, S 0.25), (T 0.5, S 0.5)): forward KL 0.143841 (above) and 0;
    # the masked position's values (teacher 0.9, student 0.1) never count.
    student = torch.log(torch.tensor([[[0.1], [0.25], [0.5]]])).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.9], [0.5], [0.5]]]))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, metrics = dense_distill_loss(student, teacher, mask, forward_kl)
    assert float(loss.detach()) == pytest.approx(0.143841 / 2, abs=1e-6)
    assert float(metrics["divergence"]) == pytest.approx(0.143841 / 2, abs=1e-6)
    # the batch's normaliser (4 tokens over all micro-batches), not this micro-batch's 2
    loss, _ = dense_distill_loss(student, teacher, mask, forward_kl, num_tokens=4)
    assert float(loss.detach()) == pytest.approx(0.143841 / 4, abs=1e-6)
    loss.backward()
    # d/dlog s [-(0.5 log s + 0.5 log(1 - s))] / 4 at s = 0.25: (-0.5 + 0.5 * 0.25 / 0.75) / 4
    assert student.grad[0, :, 0].tolist() == pytest.approx([0.0, -1 / 12, 0.0], abs=1e-6)
    reverse, _ = dense_distill_loss(student, teacher, mask, reverse_kl, agg="seq_mean_token_sum")
    assert float(reverse.detach()) == pytest.approx(0.130812, abs=1e-6)


def test_dense_loss_plus_the_task_loss_by_hand():
    """loss = divergence + task_coef x the PPO loss on the task advantage. The divergence part is
    the example above (0.143841 / 2 over two tokens); the policy at pi_old (ratio 1) makes the
    PPO loss -mean(A) over the same tokens: -(1.0 + -0.5) / 2 = -0.25; with task_coef 0.4 the
    total is 0.0719205 - 0.1 = -0.0280795, and the gradient is the parts' weighted sum."""
    from reroll.algorithms import ppo_clip_loss

    student = torch.log(torch.tensor([[[0.1], [0.25], [0.5]]])).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.9], [0.5], [0.5]]]))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    sampled = torch.log(torch.tensor([[0.3, 0.6, 0.7]])).requires_grad_()
    advantages = torch.tensor([[9.0, 1.0, -0.5]])  # the masked 9.0 never counts
    divergence, _ = dense_distill_loss(student, teacher, mask, forward_kl)
    task, _ = ppo_clip_loss(sampled, sampled.detach(), advantages, mask)
    assert float(task.detach()) == pytest.approx(-0.25, abs=1e-6)
    loss, parts = dense_distill_with_task_loss(divergence, task, 0.4)
    assert float(loss.detach()) == pytest.approx(0.143841 / 2 - 0.4 * 0.25, abs=1e-6)
    assert float(parts["divergence_loss"]) == pytest.approx(0.143841 / 2, abs=1e-6)
    assert float(parts["task_loss"]) == pytest.approx(-0.25, abs=1e-6)
    loss.backward()
    # d/d sampled of 0.4 x -(A ratio) / 2 = -0.2 A per unmasked token; the divergence's -1/6
    assert sampled.grad[0].tolist() == pytest.approx([0.0, -0.2, 0.1], abs=1e-6)
    assert student.grad[0, :, 0].tolist() == pytest.approx([0.0, -1 / 6, 0.0], abs=1e-6)
    alone, parts = dense_distill_with_task_loss(divergence.detach(), task.detach(), 0.0)
    assert float(alone) == pytest.approx(0.143841 / 2, abs=1e-6)
    with pytest.raises(ValueError, match="task_coef"):
        dense_distill_with_task_loss(divergence, task, -1.0)


def full_and_topk(seed: int, k: int, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    t_full = torch.log_softmax(3 * torch.randn(4, vocab, generator=g, dtype=torch.float64), -1)
    s_full = torch.log_softmax(3 * torch.randn(4, vocab, generator=g, dtype=torch.float64), -1)
    ids = t_full.topk(k, -1).indices
    return t_full, s_full, t_full.gather(-1, ids), s_full.gather(-1, ids)


@pytest.mark.parametrize("k", [1, 5, 49])
def test_bucketing_never_overstates_and_is_exact_with_the_whole_vocabulary(k):
    t_full, s_full, t_k, s_k = full_and_topk(0, k)
    full_forward = (t_full.exp() * (t_full - s_full)).sum(-1)
    full_reverse = (s_full.exp() * (s_full - t_full)).sum(-1)
    assert (forward_kl(s_k, t_k) <= full_forward + 1e-9).all()
    assert (reverse_kl(s_k, t_k) <= full_reverse + 1e-9).all()
    _, _, t_all, s_all = full_and_topk(0, 50)
    assert forward_kl(s_all, t_all) == pytest.approx(full_forward, abs=1e-4)


@pytest.mark.parametrize("divergence", [forward_kl, reverse_kl, generalized_jsd])
def test_zero_at_equality_positive_elsewhere_and_differentiable(divergence):
    _, _, t_k, s_k = full_and_topk(1, 5)
    assert divergence(t_k, t_k) == pytest.approx(torch.zeros(4), abs=1e-6)
    student = s_k.clone().requires_grad_(True)
    value = divergence(student, t_k)
    assert (value > 0).all()
    value.sum().backward()
    assert student.grad is not None and torch.isfinite(student.grad).all()


def test_on_policy_advantage_is_the_teacher_minus_the_student_on_sampled_tokens():
    teacher = torch.tensor([[-0.1, -2.0, -1.0]])
    student = torch.tensor([[-0.5, -0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert on_policy_distill_advantages(teacher, student, mask).tolist() == \
        [pytest.approx([0.4, -1.5, 0.0])]


def test_the_mean_baseline_centres_the_advantage_on_the_masked_tokens():
    # Raw A on the masked tokens: 0.4, -1.5 (row 1) and -0.4 (row 2); mean -0.5.
    teacher = torch.tensor([[-0.1, -2.0, -1.0], [-1.0, 0.0, 0.0]])
    student = torch.tensor([[-0.5, -0.5, -3.0], [-0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    centred = on_policy_distill_advantages(teacher, student, mask, "mean")
    assert centred.tolist() == [pytest.approx([0.9, -1.0, 0.0]), pytest.approx([0.1, 0.0, 0.0])]
    with pytest.raises(ValueError, match="baseline must be"):
        on_policy_distill_advantages(teacher, student, mask, "median")
