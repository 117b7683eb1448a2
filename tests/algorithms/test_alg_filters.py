"""Overlong filtering, DAPO overlong penalty, dynamic-sampling group filter."""

import pytest
import torch

from reroll.algorithms import dapo_overlong_penalty, dynamic_sampling_keep, overlong_filter_mask

pytestmark = pytest.mark.unit


def test_overlong_filter_by_hand():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    truncated = torch.tensor([False, True, True])
    want = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(overlong_filter_mask(mask, truncated), want)


def test_dapo_penalty_by_hand():
    # L_max = 20, L_cache = 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    got = dapo_overlong_penalty(lengths, 20, 4)
    # 17 -> (16 - 17) / 4 = -0.25 ; 18 -> -0.5 ; 20 -> -1
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    got = dapo_overlong_penalty(lengths, 20, 4, penalty=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    with pytest.raises(ValueError):
        dapo_overlong_penalty(lengths, 20, 0)


def test_dapo_penalty_matches_loop_reference():
    lengths = torch.arange(0, 40)
    got = dapo_overlong_penalty(lengths, 30, 8, penalty=0.5)
    for L, x in zip(lengths.tolist(), got.tolist(), strict=True):
        want = 0.0 if L <= 22 else ((22 - L) / 8 * 0.5 if L <= 30 else -0.5)
        assert x == pytest.approx(want)


def test_dynamic_sampling_by_hand():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5])
    # groups of 3: (1,1,1) equal -> drop ; (0,0,0) equal -> drop ; (1,0,1) keep ; (.5,.5,.5) drop
    assert dynamic_sampling_keep(r, 3).tolist() == [False, False, True, False]
    assert dynamic_sampling_keep(r, 3, drop_all_equal=False).tolist() == [True] * 4
    # mean filter: group means 1, 0, 2/3, 0.5 ; keep means in [0.1, 0.9]
    keep = dynamic_sampling_keep(r, 3, drop_all_equal=False, min_mean=0.1, max_mean=0.9)
    assert keep.tolist() == [False, False, True, True]
    # std filter: unbiased stds 0, 0, 0.577, 0 ; min_std 0.1
    keep = dynamic_sampling_keep(r, 3, drop_all_equal=False, min_std=0.1)
    assert keep.tolist() == [False, False, True, False]
    keep = dynamic_sampling_keep(r, 3, drop_all_equal=False, max_std=0.1)
    assert keep.tolist() == [True, True, False, True]
    with pytest.raises(ValueError):
        dynamic_sampling_keep(r, 5)


@pytest.mark.parametrize("seed,n", [(0, 2), (1, 4), (2, 5)])
def test_dynamic_sampling_matches_loop_reference(seed, n):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (n * 6,), generator=g).float()
    got = dynamic_sampling_keep(r, n, min_mean=0.2, max_std=0.6)
    for k in range(6):
        grp = r[k * n:(k + 1) * n].tolist()
        m = sum(grp) / n
        sd = (sum((x - m) ** 2 for x in grp) / (n - 1)) ** 0.5
        want = len(set(grp)) > 1 and m >= 0.2 and sd <= 0.6
        assert bool(got[k]) == want
