"""Preference losses against values computed by hand, and micro-batch invariance."""

import math

import pytest
import torch

from reroll.algorithms.preference import (
    bradley_terry_loss,
    dpo_loss,
    ipo_loss,
    log_odds,
    orpo_loss,
    simpo_loss,
)

pytestmark = pytest.mark.unit


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_sigmoid_by_hand():
    # pair 1: chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1 -> h = 0.5 * 2 = 1
    # pair 2: chosen log-ratio 0, rejected 1 -> h = 0.5 * -1 = -0.5
    loss, m = dpo_loss(t(-1, -4), t(-3, -2), t(-2, -4), t(-2, -3), beta=0.5)
    assert float(loss) == pytest.approx((-logsig(1.0) - logsig(-0.5)) / 2)
    assert float(m["accuracy"]) == 0.5
    assert float(m["reward_margin"]) == pytest.approx((1.0 - 0.5) / 2)
    assert float(m["reward_chosen"]) == pytest.approx((0.5 + 0.0) / 2)


def test_conservative_dpo_smooths_the_label():
    loss, _ = dpo_loss(t(-1), t(-3), t(-2), t(-2), beta=0.5, label_smoothing=0.1)
    assert float(loss) == pytest.approx(-0.9 * logsig(1.0) - 0.1 * logsig(-1.0))
    # eps = 0.5: the label says nothing; the loss is flat at h = 0
    pi_c = t(-1.0).requires_grad_()
    dpo_loss(pi_c, t(-1.0), t(-1.0), t(-1.0), beta=1.0, label_smoothing=0.5)[0].backward()
    assert float(pi_c.grad) == pytest.approx(0.0)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pi_c, pi_r = t(-2.0).requires_grad_(), t(-2.0).requires_grad_()
    dpo_loss(pi_c, pi_r, t(-2.0), t(-2.0), beta=0.1)[0].backward()
    # d/dh -log sigmoid(h) at 0 = -1/2, times beta
    assert float(pi_c.grad) == pytest.approx(-0.05)
    assert float(pi_r.grad) == pytest.approx(0.05)


def test_ipo_by_hand():
    # margin m = (−1 − −2) − (−3 − −2) = 2; target 1/(2*0.25) = 2 -> zero loss
    loss, m = ipo_loss(t(-1), t(-3), t(-2), t(-2), beta=0.25)
    assert float(loss) == pytest.approx(0.0)
    assert float(m["reward_margin"]) == pytest.approx(0.5)
    loss, _ = ipo_loss(t(-1), t(-3), t(-2), t(-2), beta=0.5)  # target 1: (2 - 1)^2
    assert float(loss) == pytest.approx(1.0)


def test_simpo_by_hand():
    loss, m = simpo_loss(t(-0.5), t(-1.5), beta=2.0, gamma=0.5)
    assert float(loss) == pytest.approx(-logsig(2.0 * -0.5 - 2.0 * -1.5 - 0.5))
    assert float(m["accuracy"]) == 1.0


def test_orpo_by_hand():
    p_c, p_r = 0.5, 0.2
    odds = math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r))
    avg_c, avg_r = t(math.log(p_c)), t(math.log(p_r))
    loss, m = orpo_loss(avg_c, avg_r, -avg_c, lam=0.1)
    assert float(loss) == pytest.approx(-math.log(p_c) - 0.1 * logsig(odds))
    assert float(m["log_odds_ratio"]) == pytest.approx(odds)
    assert math.isfinite(float(log_odds(t(0.0))))  # p = 1: clamped, not inf


def test_bradley_terry_by_hand():
    loss, m = bradley_terry_loss(t(1.0, 0.0), t(0.0, 2.0))
    assert float(loss) == pytest.approx((-logsig(1.0) - logsig(-2.0)) / 2)
    assert float(m["accuracy"]) == 0.5
    loss, _ = bradley_terry_loss(t(1.0), t(0.0), margin=t(0.5), center_coef=0.01)
    assert float(loss) == pytest.approx(-logsig(0.5) + 0.01 * 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_micro_batches_add_up_to_the_batch_loss(seed):
    gen = torch.Generator().manual_seed(seed)
    pi_c, pi_r, ref_c, ref_r = (-torch.rand(6, generator=gen, dtype=torch.float64) * 5
                                for _ in range(4))
    whole, _ = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.3, label_smoothing=0.05)
    parts = sum(dpo_loss(pi_c[s], pi_r[s], ref_c[s], ref_r[s], beta=0.3, label_smoothing=0.05,
                         num_pairs=6)[0] for s in (slice(0, 2), slice(2, 5), slice(5, 6)))
    assert float(parts) == pytest.approx(float(whole))
