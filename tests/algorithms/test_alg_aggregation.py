"""Loss aggregation: hand-computed values, a loop reference, and micro-batch invariance."""

import math

import pytest
import torch

from reroll.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    broadcast_to_tokens,
    loss_normalisers,
    masked_mean,
    masked_var,
    masked_whiten,
    turn_rewards_to_tokens,
    turn_sums,
    turn_valid,
    turns_to_tokens,
)

pytestmark = pytest.mark.unit

MODES = list(LOSS_AGGREGATIONS)


def _hand_batch():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    return per_token, mask


def test_token_mean_by_hand():
    per_token, mask = _hand_batch()
    # valid tokens 1, 2, 4 -> (1 + 2 + 4) / 3
    assert aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_mean_by_hand():
    per_token, mask = _hand_batch()
    # seq 0: (1 + 2) / 2 = 1.5 ; seq 1: 4 / 1 = 4 ; mean over 2 seqs = 2.75
    assert aggregate_loss(per_token, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)


def test_seq_mean_token_sum_by_hand():
    per_token, mask = _hand_batch()
    # seq sums 3 and 4 -> (3 + 4) / 2 = 3.5
    assert aggregate_loss(per_token, mask, "seq_mean_token_sum").item() == pytest.approx(3.5)


def test_seq_mean_token_sum_norm_by_hand():
    per_token, mask = _hand_batch()
    # (3 + 4) / max_len 4 / 2 seqs = 0.875
    out = aggregate_loss(per_token, mask, "seq_mean_token_sum_norm", max_len=4)
    assert out.item() == pytest.approx(0.875)
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, "seq_mean_token_sum_norm")


def test_explicit_normalisers_by_hand():
    per_token, mask = _hand_batch()
    # global counts given by the caller: 7 / 10 tokens, 7 / 5 seqs, (1.5 + 4) / 5
    assert aggregate_loss(per_token, mask, "token_mean", num_tokens=10).item() == pytest.approx(0.7)
    assert aggregate_loss(per_token, mask, "seq_mean_token_sum", num_seqs=5).item() == pytest.approx(1.4)
    assert aggregate_loss(per_token, mask, "seq_mean_token_mean", num_seqs=5).item() == pytest.approx(1.1)


def test_empty_sequence_contributes_zero_and_no_nan():
    per_token, mask = _hand_batch()
    per_token = torch.cat([per_token, torch.tensor([[float("nan"), 8.0, 9.0]])])
    mask = torch.cat([mask, torch.zeros(1, 3)])
    # the empty row is neither counted nor allowed to leak NaN: same values as the 2-row batch
    assert aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(per_token, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    assert aggregate_loss(per_token, mask, "seq_mean_token_sum").item() == pytest.approx(3.5)
    empty = aggregate_loss(per_token, torch.zeros_like(mask), "seq_mean_token_mean")
    assert empty.item() == 0.0
    assert loss_normalisers(mask) == (3.0, 2.0)


def test_unknown_mode_raises():
    per_token, mask = _hand_batch()
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, "sum")


def _slow_aggregate(per_token, mask, mode, num_tokens=None, num_seqs=None, max_len=None):
    rows = [
        [float(per_token[i, t]) for t in range(mask.shape[1]) if mask[i, t] > 0]
        for i in range(mask.shape[0])
    ]
    n_tok = num_tokens if num_tokens is not None else max(sum(len(r) for r in rows), 1)
    n_seq = num_seqs if num_seqs is not None else max(sum(1 for r in rows if r), 1)
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / n_tok
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seq
    if mode == "seq_mean_token_sum":
        return sum(sum(r) for r in rows) / n_seq
    return sum(sum(r) for r in rows) / max_len / n_seq


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed,B,T", [(0, 3, 5), (1, 6, 2), (2, 4, 9)])
def test_matches_loop_reference(mode, seed, B, T):
    g = torch.Generator().manual_seed(seed)
    per_token = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.4).double()
    mask[0] = 0.0  # always one empty row
    got = aggregate_loss(per_token, mask, mode, max_len=T + 3).item()
    assert got == pytest.approx(_slow_aggregate(per_token, mask, mode, max_len=T + 3))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed,split", [(0, 1), (1, 3), (2, 5)])
def test_micro_batch_invariance(mode, seed, split):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    base = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[2] = 0.0
    n_tok, n_seq = loss_normalisers(mask)
    kw = {"num_tokens": n_tok, "num_seqs": n_seq, "max_len": 10}

    full_x = base.clone().requires_grad_(True)
    full = aggregate_loss(full_x**2, mask, mode, **kw)
    full.backward()

    part_x = base.clone().requires_grad_(True)
    total = sum(
        aggregate_loss(part_x[sl] ** 2, mask[sl], mode, **kw)
        for sl in (slice(0, split), slice(split, B))
    )
    total.backward()
    assert total.item() == pytest.approx(full.item())
    torch.testing.assert_close(part_x.grad, full_x.grad)
    # and the full batch with default normalisers equals the full batch with its own counts
    assert aggregate_loss(base, mask, mode, max_len=10).item() == pytest.approx(
        aggregate_loss(base, mask, mode, **kw).item()
    )


def test_masked_helpers_by_hand():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    # mean of 1 and 3 = 2 ; unbiased var = ((1-2)^2 + (3-2)^2) / 1 = 2 ; biased = 1
    assert masked_mean(x, m).item() == 2.0
    assert masked_var(x, m).item() == 2.0
    assert masked_var(x, m, unbiased=False).item() == 1.0
    w = masked_whiten(x, m, eps=0.0)
    # (1-2)/sqrt(2), (3-2)/sqrt(2), 0 outside the mask
    torch.testing.assert_close(w, torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]]))


def test_turn_helpers_by_hand():
    # row 0: turn 0 on tokens 0-1, env token, turn 1 on token 3 ; row 1: only turn 0
    turn_ids = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    per_token = torch.tensor([[1.0, 2.0, 50.0, 4.0], [7.0, 9.0, 9.0, 9.0]])
    torch.testing.assert_close(turn_sums(per_token, turn_ids, 2), torch.tensor([[3.0, 4.0], [7.0, 0.0]]))
    assert turn_valid(turn_ids, 2).tolist() == [[True, True], [True, False]]
    tv = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    expected = torch.tensor([[10.0, 10.0, 0.0, 20.0], [30.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(turns_to_tokens(tv, turn_ids), expected)
    bt = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    torch.testing.assert_close(bt, torch.tensor([[2.0, 0.0], [-1.0, -1.0]]))


def test_turn_rewards_to_tokens_by_hand():
    # row 0: turn 0 = positions 0, 1; env token 2; turn 1 = positions 3, 4 -> rewards on 1 and 4
    # row 1: one turn ending at position 2; its turn 1 has no token, so its reward is dropped
    turn_ids = torch.tensor([[0, 0, -1, 1, 1], [0, 0, 0, -1, -1]])
    turn_rewards = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    want = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0], [0.0, 0.0, 3.0, 0.0, 0.0]])
    torch.testing.assert_close(turn_rewards_to_tokens(turn_rewards, turn_ids), want)
