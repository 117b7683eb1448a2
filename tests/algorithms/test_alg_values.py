"""Value loss (clipped) and AsyPPO mini-critic helpers."""

import pytest
import torch

from reroll.algorithms import (
    LOSS_AGGREGATIONS,
    asyppo_advantage_mask,
    asyppo_entropy_mask,
    critic_disagreement,
    critic_ensemble_mean,
    loss_normalisers,
    masked_quantile,
    value_loss,
)

pytestmark = pytest.mark.unit


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask, clip_range=0.2)
    # token 0: unclipped (1-0)^2 = 1 ; V clipped to 0.7 -> 0.49 ; max = 1 (unclipped)
    # token 1: (0-1)^2 = 1 ; clip(0, -0.2, 0.2) = 0 -> 1 ; max 1 ; token 2 masked
    # 0.5 * (1 + 1) / 2 = 0.5
    assert loss.item() == pytest.approx(0.5)
    assert float(m["clip_frac"]) == 0.0
    assert float(m["mse"]) == pytest.approx(1.0)
    loss.backward()
    # d/dV 0.5 (V - R)^2 / 2 = (V - R) / 2
    torch.testing.assert_close(values.grad, torch.tensor([[0.5, -0.5, 0.0]]))


def test_value_loss_clip_active_by_hand():
    values = torch.tensor([[1.0]], requires_grad=True)
    old = torch.tensor([[0.0]])
    returns = torch.tensor([[2.0]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 1), clip_range=0.5)
    # unclipped (1-2)^2 = 1 ; clipped V = 0.5 -> (0.5-2)^2 = 2.25 ; 0.5 * 2.25 = 1.125, no grad
    assert loss.item() == pytest.approx(1.125)
    assert float(m["clip_frac"]) == 1.0
    loss.backward()
    assert values.grad.item() == 0.0
    loss, _ = value_loss(values, old, returns, torch.ones(1, 1), clip_range=None)
    assert loss.item() == pytest.approx(0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_loss_matches_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    v, old, R = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    mask[0, 0] = 1.0
    got, _ = value_loss(v, old, R, mask, clip_range=0.3)
    total, n = 0.0, 0
    for i in range(4):
        for t in range(6):
            if mask[i, t] > 0:
                vc = min(max(float(v[i, t]), float(old[i, t]) - 0.3), float(old[i, t]) + 0.3)
                total += 0.5 * max((float(v[i, t] - R[i, t])) ** 2, (vc - float(R[i, t])) ** 2)
                n += 1
    assert got.item() == pytest.approx(total / n)


@pytest.mark.parametrize("mode", list(LOSS_AGGREGATIONS))
def test_value_loss_micro_batch_invariance(mode):
    g = torch.Generator().manual_seed(3)
    v, old, R = (torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    n_tok, n_seq = loss_normalisers(mask)
    kw = {"clip_range": 0.2, "agg": mode, "num_tokens": n_tok, "num_seqs": n_seq, "max_len": 7}
    full_v = v.clone().requires_grad_(True)
    full, _ = value_loss(full_v, old, R, mask, **kw)
    full.backward()
    part_v = v.clone().requires_grad_(True)
    total = sum(value_loss(part_v[s], old[s], R[s], mask[s], **kw)[0]
                for s in (slice(0, 3), slice(3, 6)))
    total.backward()
    assert total.item() == pytest.approx(full.item())
    torch.testing.assert_close(part_v.grad, full_v.grad)


def test_asyppo_helpers_by_hand():
    # two critics on 4 tokens
    values = torch.tensor([[[1.0, 2.0, 0.0, 5.0]], [[1.0, 4.0, 1.0, 5.0]]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(critic_ensemble_mean(values), torch.tensor([[1.0, 3.0, 0.5, 5.0]]))
    # population std over 2 critics = |V1 - V2| / 2 -> 0, 1, 0.5, 0
    std = critic_disagreement(values)
    torch.testing.assert_close(std, torch.tensor([[0.0, 1.0, 0.5, 0.0]]))
    # advantage mask drops agreed tokens (std < 0.5); entropy mask drops divergent (std > 0.5)
    torch.testing.assert_close(asyppo_advantage_mask(std, mask, 0.5), torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(asyppo_entropy_mask(std, mask, 0.5), torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    # quantiles of the valid stds (0, 1, 0.5): median 0.5, 0.25-quantile 0.25
    assert masked_quantile(std, mask, 0.5).item() == pytest.approx(0.5)
    assert masked_quantile(std, mask, 0.25).item() == pytest.approx(0.25)
    assert masked_quantile(std, torch.zeros_like(mask), 0.5).item() == 0.0
