"""KL estimators, the KL reward penalty and the KL controllers."""

import math

import pytest
import torch

from reroll.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalty_rewards,
)

pytestmark = pytest.mark.unit


def test_estimators_by_hand():
    # pi_theta = 0.5, pi_ref = 0.25 on the sampled token: log(pi/ref) = ln 2
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    # k3 = r - 1 - ln r with r = ref/pi = 0.5: 0.5 - 1 + ln 2
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(ln2 - 0.5)
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_k3_clamped_for_safety():
    lp = torch.tensor([[-100.0, 0.0]])
    ref = torch.tensor([[0.0, -100.0]])
    out = kl_estimate(lp, ref, "k3")
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == 10.0  # exp(20) - 21 clamped to 10
    # exp(-20) + 20 - 1 = 19, also clamped to 10
    assert out[0, 1].item() == 10.0


def test_estimators_against_loop_reference():
    g = torch.Generator().manual_seed(0)
    lp, ref = -torch.rand(3, 4, generator=g) * 4, -torch.rand(3, 4, generator=g) * 4
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(lp, ref, est)
        for i in range(3):
            for t in range(4):
                d = float(lp[i, t] - ref[i, t])
                want = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[est]
                assert got[i, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_k1_and_k3_are_unbiased_monte_carlo():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), -1)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    true_kl = (p * (p / q).log()).sum().item()
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, ref = p.log()[idx], q.log()[idx]
    for est in ("k1", "k3"):
        assert kl_estimate(lp, ref, est).mean().item() == pytest.approx(true_kl, abs=0.01)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


def test_kl_penalty_rewards_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # r - 0.5 kl on valid tokens, 0 on the masked one
    want = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    torch.testing.assert_close(kl_penalty_rewards(r, kl, mask, 0.5), want)


def test_fixed_controller():
    c = FixedKLController(0.1)
    assert c.update(5.0, 100) == 0.1 and c.value == 0.1


def test_adaptive_controller_by_hand():
    c = AdaptiveKLController(value=0.2, target=6.0, horizon=10_000)
    # error = clip(9/6 - 1, -.2, .2) = 0.2 ; beta = 0.2 * (1 + 0.2 * 256 / 10000) = 0.20102400
    assert c.update(9.0, 256) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000))
    c = AdaptiveKLController(value=0.2, target=6.0, horizon=10_000)
    # error = 5.4/6 - 1 = -0.1 ; beta = 0.2 * (1 - 0.1 * 1000 / 10000) = 0.198
    assert c.update(5.4, 1000) == pytest.approx(0.198)
    assert c.value == pytest.approx(0.198)
