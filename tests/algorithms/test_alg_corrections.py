"""Off-policy corrections: truncated IS weights, ratio masks, mismatch metrics."""

import math

import pytest
import torch

from reroll.algorithms import (
    TIS_LEVELS,
    off_policy_metrics,
    ratio_mask_sequence,
    ratio_mask_token,
    tis_geometric_weights,
    tis_sequence_weights,
    tis_token_weights,
    tis_turn_weights,
)

pytestmark = pytest.mark.unit

L = math.log


def _hand():
    # pi_old / mu per token: row 0 (2, 0.5, 3), row 1 (1.5, 4, masked 100)
    ratios = torch.tensor([[2.0, 0.5, 3.0], [1.5, 4.0, 100.0]])
    behaviour = torch.full((2, 3), -2.0)
    old = behaviour + ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, behaviour, mask


def test_token_weights_by_hand():
    old, mu, mask = _hand()
    # min(ratio, 2.5), 0 on the masked token
    want = torch.tensor([[2.0, 0.5, 2.5], [1.5, 2.5, 0.0]])
    torch.testing.assert_close(tis_token_weights(old, mu, mask, cap=2.5), want)
    torch.testing.assert_close(tis_token_weights(old, mu, mask, cap=None)[0, 2], torch.tensor(3.0))


def test_sequence_and_geometric_weights_by_hand():
    old, mu, mask = _hand()
    # products: row 0 2*0.5*3 = 3 -> capped at 2 ; row 1 1.5*4 = 6 -> 2
    seq = tis_sequence_weights(old, mu, mask, cap=2.0)
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]))
    seq = tis_sequence_weights(old, mu, mask, cap=10.0)
    torch.testing.assert_close(seq, torch.tensor([[3.0, 3.0, 3.0], [6.0, 6.0, 0.0]]))
    # geometric means: row 0 3^(1/3) = 1.44225 ; row 1 sqrt(6) = 2.44949 -> capped at 2
    geo = tis_geometric_weights(old, mu, mask, cap=2.0)
    a = 3 ** (1 / 3)
    torch.testing.assert_close(geo, torch.tensor([[a, a, a], [2.0, 2.0, 0.0]]))


def test_turn_weights_by_hand():
    old, mu, mask = _hand()
    # row 0: turn 0 = tokens 0,1 (2 * 0.5 = 1), turn 1 = token 2 (3 -> cap 2.5)
    # row 1: token 0 is an env token (-1), turn 0 = token 1 (4 -> 2.5)
    turn_ids = torch.tensor([[0, 0, 1], [-1, 0, -1]])
    w = tis_turn_weights(old, mu, mask, cap=2.5, turn_ids=turn_ids)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 2.5], [0.0, 2.5, 0.0]]))
    with pytest.raises(ValueError):
        tis_turn_weights(old, mu, mask)


def test_ratio_masks_by_hand():
    old, mu, mask = _hand()
    # token: keep 0.5 <= ratio <= 3 -> drops the 4 ; the masked token stays 0
    want = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(ratio_mask_token(old, mu, mask, low=0.5, high=3.0), want)
    # sequence, geometric: 1.442 kept, 2.449 dropped with high = 2
    want = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(ratio_mask_sequence(old, mu, mask, low=0.5, high=2.0), want)
    # sequence, product: 3 and 6 ; with [0.5, 4] only row 0 is kept
    got = ratio_mask_sequence(old, mu, mask, low=0.5, high=4.0, geometric=False)
    torch.testing.assert_close(got, want)


def test_off_policy_metrics_by_hand():
    old, mu, mask = _hand()
    m = off_policy_metrics(old, mu, mask)
    rs = [2.0, 0.5, 3.0, 1.5, 4.0]
    assert float(m["behaviour_ratio_mean"]) == pytest.approx(sum(rs) / 5)
    assert float(m["behaviour_ratio_max"]) == pytest.approx(4.0)
    assert float(m["behaviour_kl_k1"]) == pytest.approx(-sum(L(r) for r in rs) / 5, abs=1e-6)
    assert float(m["behaviour_kl_k3"]) == pytest.approx(sum(r - 1 - L(r) for r in rs) / 5, abs=1e-5)


def _slow_weights(old, mu, mask, turn_ids, level, cap):
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[i, t] > 0]
        lrs = {t: float(old[i, t] - mu[i, t]) for t in idx}
        for t in idx:
            if level == "token":
                lw = lrs[t]
            elif level == "sequence":
                lw = sum(lrs.values())
            elif level == "geometric":
                lw = sum(lrs.values()) / len(idx)
            else:
                if turn_ids[i, t] < 0:
                    continue
                lw = sum(v for s, v in lrs.items() if turn_ids[i, s] == turn_ids[i, t])
            out[i, t] = min(math.exp(lw), cap)
    return out


@pytest.mark.parametrize("seed,B,T", [(0, 3, 5), (1, 5, 8), (2, 2, 12)])
@pytest.mark.parametrize("level", list(TIS_LEVELS))
def test_weights_match_loop_reference(seed, B, T, level):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = mu + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    turn_ids = torch.randint(-1, 3, (B, T), generator=g)
    got = TIS_LEVELS[level](old, mu, mask, cap=1.3, turn_ids=turn_ids)
    torch.testing.assert_close(got, _slow_weights(old, mu, mask, turn_ids, level, 1.3))
    keep = ratio_mask_token(old, mu, mask, low=0.8, high=1.25)
    r = torch.exp(old - mu)
    torch.testing.assert_close(keep, mask * ((r >= 0.8) & (r <= 1.25)).double())


def test_behaviour_kl_k3_on_tokens_sampled_from_mu_is_kl_mu_pi_old():
    # 200k tokens sampled from mu; the estimator must take r = pi_old / mu (mu / pi_old gave
    # 0.248 where the true KL is 0.277 in the reproduction).
    from reroll.algorithms import behaviour_kl_k3

    g = torch.Generator().manual_seed(0)
    log_mu = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    log_pi = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    true_kl = float((log_mu.exp() * (log_mu - log_pi)).sum())
    tokens = torch.multinomial(log_mu.exp(), 200_000, replacement=True, generator=g)
    mu, old = log_mu[tokens].reshape(400, 500), log_pi[tokens].reshape(400, 500)
    mask = torch.ones_like(mu)
    k3 = float(behaviour_kl_k3(old, mu, mask).mean())
    inverted = float((torch.exp(mu - old) - 1 - (mu - old)).mean())
    assert true_kl > 0.1 and abs(inverted - true_kl) > 0.02  # the two definitions differ here
    assert k3 == pytest.approx(true_kl, abs=0.01)
    assert float(off_policy_metrics(old, mu, mask)["behaviour_kl_k3"]) == pytest.approx(k3)
    # 0 off the mask
    assert float(behaviour_kl_k3(old, mu, torch.zeros_like(mu)).abs().sum()) == 0.0
