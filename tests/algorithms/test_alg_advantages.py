"""Outcome-level and token-level advantage estimators and reward normalisation."""

import math

import pytest
import torch

from reroll.algorithms import (
    clip_advantages,
    clip_rewards,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    gigpo_advantages,
    grpo_advantages,
    ipa_chunk_advantages,
    lite_ppo_advantages,
    normalize_rewards,
    rebn_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    whiten_advantages,
)

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------- grpo & co


def test_grpo_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +-0.5 * sqrt(3) = +-0.8660
    # group 1: all equal -> 0
    a = grpo_advantages(r, 4)
    h = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(a, torch.tensor([h, -h, -h, h, 0.0, 0.0, 0.0, 0.0]))
    # without std scaling: r - mean = +-0.5
    b = grpo_advantages(r, 4, scale_by_std=False)
    torch.testing.assert_close(b, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(dr_grpo_advantages(r, 4), b)


def test_grpo_group_of_one_is_zero_and_bad_size_raises():
    r = torch.tensor([3.0, -1.0])
    assert grpo_advantages(r, 1).tolist() == [0.0, 0.0]
    assert rloo_advantages(r, 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        grpo_advantages(torch.ones(5), 2)


def test_lite_ppo_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # group means 0.5 and 1 ; batch std of (1, 0, 1, 1): mean .75, var (3*.0625+.5625)/3 = .25 -> .5
    # A = (0.5, -0.5, 0, 0) / 0.5 = (1, -1, 0, 0)
    torch.testing.assert_close(lite_ppo_advantages(r, 2, eps=0.0), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_rloo_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0])
    # group of 2: 1 - 0 = 1, 0 - 1 = -1 ; group of 2: 0 - 3 = -3, 3 - 0 = 3
    torch.testing.assert_close(rloo_advantages(r, 2), torch.tensor([1.0, -1.0, -3.0, 3.0]))
    r = torch.tensor([1.0, 2.0, 6.0])
    # leave-one-out means 4, 3.5, 1.5 -> -3, -1.5, 4.5
    torch.testing.assert_close(rloo_advantages(r, 3), torch.tensor([-3.0, -1.5, 4.5]))


def test_normalize_rewards_levels_by_hand():
    r = torch.tensor([1.0, 3.0, 5.0, 9.0])
    # batch mean 4.5 ; batch std: var = (12.25 + 2.25 + 0.25 + 20.25) / 3 = 35/3
    bs = math.sqrt(35 / 3)
    torch.testing.assert_close(
        normalize_rewards(r, 2, mean_level="batch", std_level="batch", eps=0.0),
        (r - 4.5) / bs,
    )
    # batch mean, group std: group stds sqrt(2) and sqrt(8)
    gs = torch.tensor([math.sqrt(2)] * 2 + [math.sqrt(8)] * 2)
    torch.testing.assert_close(
        normalize_rewards(r, 2, mean_level="batch", std_level="group", eps=0.0), (r - 4.5) / gs
    )
    torch.testing.assert_close(normalize_rewards(r, 2, mean_level="none", std_level="none"), r)
    with pytest.raises(ValueError):
        normalize_rewards(r, 2, mean_level="running")


def test_clipping_by_hand():
    assert clip_rewards(torch.tensor([-5.0, 0.5, 5.0]), -1.0, 2.0).tolist() == [-1.0, 0.5, 2.0]
    assert clip_advantages(torch.tensor([-5.0, 0.5, 5.0]), 2.0).tolist() == [-2.0, 0.5, 2.0]


def _slow_group_norm(r, n, mean_level, std_level, eps):
    out = []
    vals = r.tolist()
    bm = sum(vals) / len(vals)
    bstd = math.sqrt(sum((v - bm) ** 2 for v in vals) / (len(vals) - 1))
    for g in range(len(vals) // n):
        grp = vals[g * n:(g + 1) * n]
        gm = sum(grp) / n
        gstd = math.sqrt(sum((v - gm) ** 2 for v in grp) / (n - 1)) if n > 1 else 0.0
        for v in grp:
            c = v - {"group": gm, "batch": bm, "none": 0.0}[mean_level]
            if std_level == "group":
                c /= gstd + eps
            elif std_level == "batch":
                c /= bstd + eps
            out.append(c)
    return torch.tensor(out, dtype=r.dtype)


def _slow_rloo(r, n):
    vals = r.tolist()
    out = []
    for g in range(len(vals) // n):
        grp = vals[g * n:(g + 1) * n]
        out += [v - (sum(grp) - v) / (n - 1) for v in grp]
    return torch.tensor(out, dtype=r.dtype)


@pytest.mark.parametrize("seed,groups,n", [(0, 3, 4), (1, 5, 2), (2, 2, 7)])
def test_outcome_estimators_match_loop_reference(seed, groups, n):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (groups * n,), generator=g).double()
    torch.testing.assert_close(grpo_advantages(r, n), _slow_group_norm(r, n, "group", "group", 1e-6))
    torch.testing.assert_close(dr_grpo_advantages(r, n), _slow_group_norm(r, n, "group", "none", 0))
    torch.testing.assert_close(lite_ppo_advantages(r, n), _slow_group_norm(r, n, "group", "batch", 1e-6))
    torch.testing.assert_close(rloo_advantages(r, n), _slow_rloo(r, n))
    for ml in ("group", "batch", "none"):
        for sl in ("group", "batch", "none"):
            torch.testing.assert_close(
                normalize_rewards(r, n, mean_level=ml, std_level=sl),
                _slow_group_norm(r, n, ml, sl, 1e-6),
            )


# ----------------------------------------------------------------------------- token level


def test_scores_to_token_rewards_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    # each score lands on its row's last valid token; the empty row gets nothing
    want = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    torch.testing.assert_close(scores_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask), want)


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 99.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7], [0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.5)
    # row 0: d2 = 1 - 0.7 = 0.3 ; d1 = 0.9*0.7 - 0.6 = 0.03 ; d0 = 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3 ; A1 = 0.03 + 0.45*0.3 = 0.165 ; A0 = 0.04 + 0.45*0.165 = 0.11425
    # row 1: the env token (mask 0) is skipped: A2 = 0.3 ; d0 = 0.9*0.7 - 0.5 = 0.13 ;
    #        A0 = 0.13 + 0.45*0.3 = 0.265
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3], [0.265, 0.0, 0.3]]))
    # returns = A + V on valid tokens
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0], [0.765, 0.0, 1.0]]))


def _slow_gae(r, v, mask, gamma, lam):
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[i, t] > 0]
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            nv = float(v[i, idx[j + 1]]) if j + 1 < len(idx) else 0.0
            delta = float(r[i, t]) + gamma * nv - float(v[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, (adv + v) * mask


def _slow_returns(r, mask, gamma):
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        run = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[i, t] > 0:
                run = float(r[i, t]) + gamma * run
                out[i, t] = run
    return out


def _slow_whiten(x, mask, eps):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t] > 0]
    m = sum(vals) / len(vals)
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return (x - m) / math.sqrt(var + eps) * mask


@pytest.mark.parametrize("seed,B,T", [(0, 2, 5), (1, 4, 7), (2, 3, 3)])
def test_token_estimators_match_loop_reference(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    adv, ret = gae_advantages(r, v, mask, gamma=0.97, lam=0.9)
    sa, sr = _slow_gae(r, v, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, sa)
    torch.testing.assert_close(ret, sr)
    torch.testing.assert_close(discounted_returns(r, mask, 0.9), _slow_returns(r, mask, 0.9))

    scores = torch.randn(B, generator=g, dtype=torch.float64)
    kl = torch.rand(B, T, generator=g, dtype=torch.float64)
    tok = torch.zeros_like(r)
    for i in range(B):
        last = max(t for t in range(T) if mask[i, t] > 0)
        for t in range(T):
            if mask[i, t] > 0:
                tok[i, t] = (scores[i] if t == last else 0.0) - 0.05 * kl[i, t]
    slow_g = _slow_returns(tok, mask, 0.99)
    adv, ret = reinforce_pp_advantages(scores, mask, kl=kl, kl_coef=0.05, gamma=0.99)
    torch.testing.assert_close(ret, slow_g)
    torch.testing.assert_close(adv, _slow_whiten(slow_g, mask, 1e-8))


def test_reinforce_pp_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.full((2, 3), 0.1)
    adv, ret = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=1.0)
    # token rewards: row 0 (-0.1, -0.1, 0.9) -> G = (0.7, 0.8, 0.9)
    #                row 1 (-0.1, -0.1)      -> G = (-0.2, -0.1)
    torch.testing.assert_close(ret, torch.tensor([[0.7, 0.8, 0.9], [-0.2, -0.1, 0.0]]))
    # mean 2.1 / 5 = 0.42 ; deviations .28 .38 .48 -.62 -.52 ; unbiased var = 1.108 / 4 = 0.277
    dev = torch.tensor([[0.28, 0.38, 0.48], [-0.62, -0.52, 0.0]])
    torch.testing.assert_close(adv, dev / math.sqrt(0.277 + 1e-8))


def test_reinforce_pp_baseline_by_hand():
    mask = torch.ones(4, 2)
    adv, ret = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, 2)
    # group-centred rewards 0.5, -0.5, 0, 0 -> returns constant per row (gamma 1, no KL)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))
    # whiten over 8 tokens: mean 0, unbiased var = 4 * 0.25 / 7 = 1/7 -> +-0.5 * sqrt(7)
    h = 0.5 / math.sqrt(1 / 7 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[h, h], [-h, -h], [0.0, 0.0], [0.0, 0.0]]))


def test_whiten_advantages_keep_mean_by_hand():
    a = torch.tensor([[1.0, 3.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    # mean 2, std sqrt(2) -> (-1/sqrt2 + 2, 1/sqrt2 + 2, 0)
    want = torch.tensor([[2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2), 0.0]])
    torch.testing.assert_close(whiten_advantages(a, m, shift_mean=False, eps=0.0), want)


# ----------------------------------------------------------------------------- multi-turn


def test_rebn_by_hand():
    turn_rewards = torch.tensor([[0.0, 1.0], [1.0, 5.0]])
    # row 1 has no token in turn 1, so its reward 5 is ignored
    turn_ids = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    adv, ret = rebn_advantages(turn_rewards, turn_ids, gamma=0.5)
    # G: row 0 turn 1 = 1, turn 0 = 0 + 0.5 * 1 = 0.5 ; row 1 turn 0 = 1
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]))
    # over (0.5, 1, 1): mean 5/6, unbiased var = (1/9 + 2/36) / 2 = 1/12
    s = math.sqrt(1 / 12 + 1e-8)
    lo, hi = (0.5 - 5 / 6) / s, (1 - 5 / 6) / s
    torch.testing.assert_close(adv, torch.tensor([[lo, lo, 0.0, hi], [hi, 0.0, 0.0, 0.0]]))


def test_gigpo_by_hand():
    # one group of 2 episodes, 2 turns each; anchor states: ep0 (7, 8), ep1 (7, 9)
    turn_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    state_ids = torch.tensor([[7, 8], [7, 9]])
    turn_ids = torch.tensor([[0, 1], [0, 1]])
    adv, ret = gigpo_advantages(turn_rewards, turn_ids, state_ids, 2, gamma=0.5, scale_by_std=False)
    # episode returns 1, 0 -> A^E = +0.5, -0.5
    # G: ep0 (0 + 0.5*1, 1) = (0.5, 1) ; ep1 (0, 0)
    # step group state 7: {0.5, 0} mean 0.25 -> A^S = +0.25, -0.25 ; states 8, 9 singletons -> 0
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.5], [-0.75, -0.5]]))
    adv2, _ = gigpo_advantages(turn_rewards, turn_ids, state_ids, 2, gamma=0.5, step_weight=2.0,
                               scale_by_std=False)
    torch.testing.assert_close(adv2, torch.tensor([[1.0, 0.5], [-1.0, -0.5]]))


def test_ipa_chunk_by_hand():
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    adv, ret = ipa_chunk_advantages(torch.tensor([[1.0, 4.0]]), turn_ids, gamma=0.5)
    # G1 = 4 ; G0 = 1 + 0.5 * 4 = 3 ; constant over each chunk, 0 on the env token
    torch.testing.assert_close(adv, torch.tensor([[3.0, 3.0, 0.0, 4.0]]))
    torch.testing.assert_close(ret, adv)


def _random_episodes(seed, B, K, T):
    g = torch.Generator().manual_seed(seed)
    turn_rewards = torch.randint(0, 3, (B, K), generator=g).double()
    turn_ids = torch.full((B, T), -1)
    for i in range(B):
        n_turns = int(torch.randint(1, K + 1, (1,), generator=g))
        pos = 0
        for k in range(n_turns):
            pos += int(torch.randint(0, 2, (1,), generator=g))  # env tokens before the turn
            for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
                if pos < T:
                    turn_ids[i, pos] = k
                    pos += 1
    state_ids = torch.randint(0, 3, (B, K), generator=g)
    return turn_rewards, turn_ids, state_ids


def _slow_turn_returns(turn_rewards, turn_ids, gamma):
    B, K = turn_rewards.shape
    G = {}
    for i in range(B):
        turns = sorted({int(x) for x in turn_ids[i] if x >= 0})
        run = 0.0
        for k in reversed(turns):
            run = float(turn_rewards[i, k]) + gamma * run
            G[(i, k)] = run
    return G


def _to_tokens(per_turn, turn_ids):
    out = torch.zeros(turn_ids.shape, dtype=torch.float64)
    for i in range(turn_ids.shape[0]):
        for t in range(turn_ids.shape[1]):
            if turn_ids[i, t] >= 0:
                out[i, t] = per_turn[(i, int(turn_ids[i, t]))]
    return out


def _slow_gigpo(turn_rewards, turn_ids, state_ids, n, gamma, w, scale, eps):
    G = _slow_turn_returns(turn_rewards, turn_ids, gamma)
    B = turn_rewards.shape[0]
    R = [sum(float(turn_rewards[i, k]) for (j, k) in G if j == i) for i in range(B)]
    a_ep = _slow_group_norm(torch.tensor(R, dtype=torch.float64), n, "group",
                            "group" if scale else "none", eps)
    groups = {}
    for (i, k), g in G.items():
        groups.setdefault((i // n, int(state_ids[i, k])), []).append(g)
    A = {}
    for (i, k), g in G.items():
        grp = groups[(i // n, int(state_ids[i, k]))]
        if len(grp) == 1:
            a_s = 0.0
        else:
            m = sum(grp) / len(grp)
            sd = math.sqrt(sum((x - m) ** 2 for x in grp) / (len(grp) - 1))
            a_s = (g - m) / (sd + eps) if scale else g - m
        A[(i, k)] = float(a_ep[i]) + w * a_s
    return A, G


@pytest.mark.parametrize("seed,B,K,T,n", [(0, 4, 3, 8, 2), (1, 6, 2, 6, 3), (2, 8, 4, 12, 4)])
def test_multi_turn_match_loop_reference(seed, B, K, T, n):
    turn_rewards, turn_ids, state_ids = _random_episodes(seed, B, K, T)
    G = _slow_turn_returns(turn_rewards, turn_ids, 0.9)
    adv, ret = ipa_chunk_advantages(turn_rewards, turn_ids, gamma=0.9)
    torch.testing.assert_close(ret, _to_tokens(G, turn_ids))

    adv, ret = rebn_advantages(turn_rewards, turn_ids, gamma=0.9)
    vals = list(G.values())
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1) + 1e-8)
    torch.testing.assert_close(adv, _to_tokens({k: (x - m) / sd for k, x in G.items()}, turn_ids))

    for scale in (True, False):
        A, Gg = _slow_gigpo(turn_rewards, turn_ids, state_ids, n, 0.8, 0.7, scale, 1e-6)
        adv, ret = gigpo_advantages(turn_rewards, turn_ids, state_ids, n, gamma=0.8,
                                    step_weight=0.7, scale_by_std=scale)
        torch.testing.assert_close(adv, _to_tokens(A, turn_ids))
        torch.testing.assert_close(ret, _to_tokens(Gg, turn_ids))
