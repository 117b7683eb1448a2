"""Policy losses and entropy: hand-computed values, loop references, micro-batch invariance."""

import math

import pytest
import torch

from reroll.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    chunk_count,
    cispo_loss,
    decoupled_ppo_loss,
    entropy_from_logits,
    gspo_loss,
    ipa_chunk_loss,
    loss_normalisers,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
)

pytestmark = pytest.mark.unit

L = math.log

POLICY_LOSSES = {"ppo": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "topr": topr_loss,
                 "reinforce": reinforce_loss, "decoupled_ppo": decoupled_ppo_loss,
                 "ipa_chunk": ipa_chunk_loss}
"""Every policy loss of the catalogue, for the tests that hold for all of them."""


def _ppo_batch():
    # row 0 has A = +1, ratios 1.5, 1.0, 0.5 ; row 1 has A = -1, ratios 0.5, 5.0, (masked 2.0)
    old = torch.full((2, 3), -1.0)
    ratios = torch.tensor([[1.5, 1.0, 0.5], [0.5, 5.0, 2.0]])
    logprobs = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logprobs, old, adv, mask


def test_ppo_by_hand():
    logprobs, old, adv, mask = _ppo_batch()
    loss, m = ppo_clip_loss(logprobs, old, adv, mask)
    # per token l = max(-A rho, -A clip(rho, 0.8, 1.2)):
    # row 0: max(-1.5, -1.2) = -1.2 (clipped) ; -1 ; max(-0.5, -0.8) = -0.5
    # row 1: max(0.5, 0.8) = 0.8 (clipped) ; max(5, 1.2) = 5
    # token_mean = (-1.2 - 1 - 0.5 + 0.8 + 5) / 5 = 3.1 / 5 = 0.62
    assert loss.item() == pytest.approx(0.62, abs=1e-6)
    assert float(m["clip_frac"]) == pytest.approx(2 / 5)
    assert float(m["ratio_mean"]) == pytest.approx((1.5 + 1 + 0.5 + 0.5 + 5) / 5)
    # k1: mean(log old - log new) = -(ln 1.5 + ln 1 + ln .5 + ln .5 + ln 5) / 5 = -ln(1.875) / 5
    assert float(m["approx_kl"]) == pytest.approx(-L(1.875) / 5, abs=1e-6)
    # k3: mean(rho - 1 - ln rho)
    k3 = sum(r - 1 - L(r) for r in (1.5, 1.0, 0.5, 0.5, 5.0)) / 5
    assert float(m["approx_kl_k3"]) == pytest.approx(k3, abs=1e-6)
    loss.backward()
    # d/dlogp of -A rho is -A rho / 5 where unclipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, -1.0 / 5, -0.5 / 5], [0.0, 5.0 / 5, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_ppo_dual_clip_by_hand():
    logprobs, old, adv, mask = _ppo_batch()
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, dual_clip=3.0)
    # the A < 0 token with rho = 5: min(max(5, 1.2), -c A = 3) = 3
    # token_mean = (-1.2 - 1 - 0.5 + 0.8 + 3) / 5 = 1.1 / 5 = 0.22
    assert loss.item() == pytest.approx(0.22, abs=1e-6)
    assert float(m["clip_frac_dual"]) == pytest.approx(1 / 5)
    loss.backward()
    assert logprobs.grad[1, 1].item() == 0.0
    with pytest.raises(ValueError):
        ppo_clip_loss(logprobs, old, adv, mask, dual_clip=0.5)


def test_ppo_asymmetric_clip_by_hand():
    logprobs, old, adv, mask = _ppo_batch()
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.6)
    # row 0 tok 0 now unclipped (1.5 < 1.6): -1.5 ; rest unchanged
    # (-1.5 - 1 - 0.5 + 0.8 + 5) / 5 = 2.8 / 5 = 0.56
    assert loss.item() == pytest.approx(0.56, abs=1e-6)
    assert float(m["clip_frac"]) == pytest.approx(1 / 5)


def test_ppo_aggregation_and_is_weights_by_hand():
    logprobs, old, adv, mask = _ppo_batch()
    loss, _ = ppo_clip_loss(logprobs, old, adv, mask, agg="seq_mean_token_mean")
    # seq 0: (-1.2 - 1 - 0.5) / 3 = -0.9 ; seq 1: (0.8 + 5) / 2 = 2.9 ; mean = 1.0
    assert loss.item() == pytest.approx(1.0, abs=1e-6)
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    loss, _ = ppo_clip_loss(logprobs, old, adv, mask, is_weights=w)
    # (-2.4 - 1 - 0.5 + 0.8 + 2.5) / 5 = -0.6 / 5 = -0.12
    assert loss.item() == pytest.approx(-0.12, abs=1e-6)


def test_gspo_by_hand():
    # one sequence, two tokens, log ratios +0.2 and -0.1 -> s = exp(0.05) = 1.05127 > 1 + 4e-4
    old = torch.tensor([[-1.0, -2.0]])
    logprobs = (old + torch.tensor([[0.2, -0.1]])).requires_grad_(True)
    mask = torch.ones(1, 2)
    for a in (1.0, -1.0):
        adv = torch.full((1, 2), a)
        lp = logprobs.detach().clone().requires_grad_(True)
        loss, m = gspo_loss(lp, old, adv, mask)
        s = math.exp(0.05)
        if a > 0:
            # A > 0 and s above the band: l = -A * (1 + 4e-4), clipped, no gradient
            assert loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)
            assert float(m["clip_frac"]) == 1.0
        else:
            # A < 0: max(s, 1.0004) = s -> loss s ; d/dlogp_t = s / 2 (seq_mean_token_mean)
            assert loss.item() == pytest.approx(s, abs=1e-6)
            loss.backward()
            torch.testing.assert_close(lp.grad, torch.full((1, 2), s / 2))
        assert float(m["seq_ratio_mean"]) == pytest.approx(s, abs=1e-6)


def test_cispo_by_hand():
    # ratios 2.0 and 0.5, A = 1, log pi = ln(2)-1 and ln(.5)-1 ; weights clip(2, -, 1.28) = 1.28, 0.5
    old = torch.tensor([[-1.0, -1.0]])
    logprobs = (old + torch.tensor([[L(2.0), L(0.5)]])).requires_grad_(True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, m = cispo_loss(logprobs, old, adv, mask)
    expected = -(1.28 * (L(2.0) - 1) + 0.5 * (L(0.5) - 1)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert float(m["clip_frac"]) == 0.5
    loss.backward()
    # the gradient is -w A / 2 for every token, clipped or not
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.64, -0.25]]))
    loss2, _ = cispo_loss(logprobs, old, adv, mask, clip_low=0.2)
    # lower bound 0.8 now binds on the 0.5 token
    assert loss2.item() == pytest.approx(-(1.28 * (L(2.0) - 1) + 0.8 * (L(0.5) - 1)) / 2, abs=1e-6)


def test_topr_by_hand():
    # token 0: A = +2, ratio 3 -> weight 1 ; token 1: A = -1, ratio 3 -> weight 1 ;
    # token 2: A = -1, ratio 0.25 -> weight 0.25
    old = torch.zeros(1, 3) - 2.0
    logprobs = (old + torch.tensor([[L(3.0), L(3.0), L(0.25)]])).requires_grad_(True)
    adv = torch.tensor([[2.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, m = topr_loss(logprobs, old, adv, mask)
    lp = logprobs.detach()
    expected = (-2 * lp[0, 0] + lp[0, 1] + 0.25 * lp[0, 2]) / 3
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert float(m["neg_frac"]) == pytest.approx(2 / 3)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2 / 3, 1 / 3, 0.25 / 3]]))
    # sequence ratio: 3 * 3 * 0.25 = 2.25 -> clip to 1 for the negative tokens
    loss_s, _ = topr_loss(logprobs, old, adv, mask, sequence_ratio=True)
    assert loss_s.item() == pytest.approx(((-2 * lp[0, 0] + lp[0, 1] + lp[0, 2]) / 3).item(), abs=1e-6)


def test_reinforce_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = reinforce_loss(logprobs, logprobs.detach(), adv, mask)
    # -(1*-1 + 1*-2 + -2*-0.5) / 3 = -(-1 - 2 + 1) / 3 = 2/3
    assert loss.item() == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- loop references


def _slow_ppo(lp, old, adv, mask, cl, ch, dual):
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            rho = math.exp(float(lp[i, t] - old[i, t]))
            a = float(adv[i, t])
            obj = min(rho * a, min(max(rho, 1 - cl), 1 + ch) * a)
            if dual is not None and a < 0:
                obj = max(obj, dual * a)
            out[i, t] = -obj
    return out


def _slow_gspo(lp, old, adv, mask, cl, ch):
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        idx = [t for t in range(lp.shape[1]) if mask[i, t] > 0]
        if not idx:
            continue
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in idx) / len(idx))
        for t in range(lp.shape[1]):
            a = float(adv[i, t])
            out[i, t] = -min(s * a, min(max(s, 1 - cl), 1 + ch) * a)
    return out


def _slow_cispo(lp, old, adv, mask, ch):
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            w = min(math.exp(float(lp[i, t] - old[i, t])), 1 + ch)
            out[i, t] = -w * float(adv[i, t]) * float(lp[i, t])
    return out


def _slow_topr(lp, old, adv, mask):
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            a = float(adv[i, t])
            w = 1.0 if a >= 0 else min(math.exp(float(lp[i, t] - old[i, t])), 1.0)
            out[i, t] = -w * a * float(lp[i, t])
    return out


def _random_batch(seed, B, T, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logprobs = old + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
    adv = adv + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    mask[0, 0] = 1.0
    return logprobs, old, adv, mask


@pytest.mark.parametrize("seed,B,T", [(0, 2, 3), (1, 5, 8), (2, 7, 4)])
@pytest.mark.parametrize("mode", list(LOSS_AGGREGATIONS))
def test_losses_match_loop_reference(seed, B, T, mode):
    lp, old, adv, mask = _random_batch(seed, B, T)
    kw = {"agg": mode, "max_len": T + 2}
    cases = [
        (ppo_clip_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.3, dual_clip=2.0, **kw)[0],
         _slow_ppo(lp, old, adv, mask, 0.1, 0.3, 2.0)),
        (ppo_clip_loss(lp, old, adv, mask, **kw)[0], _slow_ppo(lp, old, adv, mask, 0.2, 0.2, None)),
        (gspo_loss(lp, old, adv, mask, clip_low=0.05, clip_high=0.1, **kw)[0],
         _slow_gspo(lp, old, adv, mask, 0.05, 0.1)),
        (cispo_loss(lp, old, adv, mask, **kw)[0], _slow_cispo(lp, old, adv, mask, 0.28)),
        (topr_loss(lp, old, adv, mask, **kw)[0], _slow_topr(lp, old, adv, mask)),
        (reinforce_loss(lp, old, adv, mask, **kw)[0], -adv * lp),
    ]
    for got, slow_per_token in cases:
        want = aggregate_loss(slow_per_token, mask, mode, max_len=T + 2)
        assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- invariance


def _extra_inputs(seed, B, T):
    """Row-aligned extra inputs of the losses that need them (sliced with the batch)."""
    g = torch.Generator().manual_seed(200 + seed)
    behaviour = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    turn_ids = torch.randint(-1, 3, (B, T), generator=g)
    return {"decoupled_ppo": {"behaviour_logprobs": behaviour}, "ipa_chunk": {"turn_ids": turn_ids}}


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", list(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_micro_batch_invariance(name, mode, seed):
    fn = POLICY_LOSSES[name]
    lp, old, adv, mask = _random_batch(seed, 6, 5)
    extra = _extra_inputs(seed, 6, 5).get(name, {})
    g = torch.Generator().manual_seed(100 + seed)
    w = 0.5 + torch.rand(6, 5, generator=g, dtype=torch.float64)
    n_tok, n_seq = loss_normalisers(mask)
    if name == "ipa_chunk":
        n_tok = chunk_count(extra["turn_ids"], mask)  # this loss normalises by chunks
    kw = {"agg": mode, "num_tokens": n_tok, "num_seqs": n_seq, "max_len": 8}

    full_lp = lp.clone().requires_grad_(True)
    full, _ = fn(full_lp, old, adv, mask, is_weights=w, **kw, **extra)
    full.backward()

    part_lp = lp.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 6)):
        extra_sl = {k: v[sl] for k, v in extra.items()}
        total = total + fn(part_lp[sl], old[sl], adv[sl], mask[sl], is_weights=w[sl], **kw, **extra_sl)[0]
    total.backward()
    assert total.item() == pytest.approx(full.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(part_lp.grad, full_lp.grad)


def test_policy_losses_share_one_signature():
    lp, old, adv, mask = _random_batch(0, 3, 4)
    extras = _extra_inputs(0, 3, 4)
    for name, fn in POLICY_LOSSES.items():
        loss, metrics = fn(lp, old, adv, mask, agg="token_mean", num_tokens=None, num_seqs=None,
                           max_len=None, is_weights=None, **extras.get(name, {}))
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert {"ratio_mean", "approx_kl"} <= set(metrics)
        assert all(not torch.is_tensor(v) or not v.requires_grad for v in metrics.values())


def test_decoupled_ppo_by_hand():
    logprobs, prox, adv, mask = _ppo_batch()
    # behaviour = prox - ln 2 on row 0 (w = pi_prox / mu = 2), prox + ln 2 on row 1 (w = 0.5)
    behaviour = prox + torch.tensor([[-L(2)] * 3, [L(2)] * 3])
    loss, m = decoupled_ppo_loss(logprobs, prox, adv, mask, behaviour_logprobs=behaviour)
    # per-token PPO losses as in test_ppo_by_hand, weighted: 2 * (-1.2 - 1 - 0.5) + 0.5 * (0.8 + 5)
    # = -5.4 + 2.9 = -2.5 ; / 5 tokens = -0.5
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    assert float(m["behaviour_weight_mean"]) == pytest.approx((3 * 2 + 2 * 0.5) / 5)
    capped, _ = decoupled_ppo_loss(logprobs, prox, adv, mask, behaviour_logprobs=behaviour,
                                   behaviour_cap=1.5)
    # w = 1.5 on row 0: (1.5 * -2.7 + 2.9) / 5 = -1.15 / 5 = -0.23
    assert capped.item() == pytest.approx(-0.23, abs=1e-6)
    dropped, m = decoupled_ppo_loss(logprobs, prox, adv, mask, behaviour_logprobs=behaviour,
                                    behaviour_cap=1.5, behaviour_cap_mode="drop")
    # AReaL's filter: row 0 (w = 2 > 1.5) weighs 0 and still counts in the 5 tokens: 2.9 / 5
    assert dropped.item() == pytest.approx(0.58, abs=1e-6)
    assert float(m["behaviour_capped_frac"]) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="behaviour_cap_mode"):
        decoupled_ppo_loss(logprobs, prox, adv, mask, behaviour_logprobs=behaviour,
                           behaviour_cap=1.5, behaviour_cap_mode="clip")


def test_ipa_chunk_loss_by_hand():
    # one row: chunk 0 = tokens 0,1 (log ratios 0.2, 0.0), env token 2, chunk 1 = token 3 (ln 2)
    old = torch.zeros(1, 4) - 1.0
    logprobs = (old + torch.tensor([[0.2, 0.0, 0.7, L(2)]])).requires_grad_(True)
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    loss, m = ipa_chunk_loss(logprobs, old, adv, mask, turn_ids=turn_ids)
    # chunk 0: s = exp(0.1) = 1.10517, A = 1, unclipped -> l = -1.10517 on both tokens, / 2 each
    # chunk 1: s = 2, A = -1 -> max(2, 1.2) = 2 -> l = 2, / 1
    # mean over the 2 chunks: (-1.10517 + 2) / 2
    assert loss.item() == pytest.approx((-math.exp(0.1) + 2) / 2, abs=1e-6)
    assert chunk_count(turn_ids, mask) == 2.0
    loss.backward()
    # grads: chunk 0 tokens -A s / 2 / 2 chunks ; env token 0 ; chunk 1: -A s / 2 = 1
    want = torch.tensor([[-math.exp(0.1) / 4, -math.exp(0.1) / 4, 0.0, 1.0]])
    torch.testing.assert_close(logprobs.grad, want)


def _slow_ipa(lp, old, adv, mask, turn_ids, cl, ch):
    """Per-token IPA chunk loss already divided by the chunk length."""
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        chunks = {}
        for t in range(lp.shape[1]):
            if mask[i, t] > 0 and turn_ids[i, t] >= 0:
                chunks.setdefault(int(turn_ids[i, t]), []).append(t)
        for ts in chunks.values():
            s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in ts) / len(ts))
            for t in ts:
                a = float(adv[i, t])
                out[i, t] = -min(s * a, min(max(s, 1 - cl), 1 + ch) * a) / len(ts)
    return out


@pytest.mark.parametrize("seed,B,T", [(0, 3, 6), (1, 5, 9)])
def test_ipa_chunk_and_decoupled_match_loop_reference(seed, B, T):
    lp, old, adv, mask = _random_batch(seed, B, T)
    extra = _extra_inputs(seed, B, T)
    turn_ids = extra["ipa_chunk"]["turn_ids"]
    in_chunk = mask * (turn_ids >= 0)
    got = ipa_chunk_loss(lp, old, adv, mask, turn_ids=turn_ids, clip_low=0.1, clip_high=0.15)[0]
    slow = _slow_ipa(lp, old, adv, mask, turn_ids, 0.1, 0.15)
    n_chunks = len({(i, int(turn_ids[i, t])) for i in range(B) for t in range(T)
                    if in_chunk[i, t] > 0})
    assert got.item() == pytest.approx(float(slow.sum()) / n_chunks, rel=1e-9)
    behaviour = extra["decoupled_ppo"]["behaviour_logprobs"]
    got = decoupled_ppo_loss(lp, old, adv, mask, behaviour_logprobs=behaviour, behaviour_cap=2.0)[0]
    w = torch.exp(old - behaviour).clamp(max=2.0)
    want = aggregate_loss(w * _slow_ppo(lp, old, adv, mask, 0.2, 0.2, None), mask, "token_mean")
    assert got.item() == pytest.approx(want.item(), rel=1e-9)


# ----------------------------------------------------------------------------- entropy


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [0.0, float("-inf")], [1000.0, 1000.0]]])
    # uniform over 2 -> ln 2 ; one-hot -> 0 ; huge equal logits -> ln 2 (stable)
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[L(2), 0.0, L(2)]]))
    # p = (1/2, 1/4, 1/4) from logits ln p: H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    logits = torch.tensor([[[L(0.5), L(0.25), L(0.25)]]])
    assert entropy_from_logits(logits).item() == pytest.approx(1.5 * L(2), abs=1e-6)


def test_entropy_gradient_finite_with_masked_vocab():
    logits = torch.tensor([[[0.3, float("-inf"), -1.0]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("seed,shape", [(0, (2, 3, 5)), (1, (1, 4, 11))])
def test_entropy_matches_loop_reference(seed, shape):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, generator=g, dtype=torch.float64)
    got = entropy_from_logits(logits)
    for b in range(shape[0]):
        for t in range(shape[1]):
            z = [math.exp(float(v)) for v in logits[b, t]]
            p = [v / sum(z) for v in z]
            assert got[b, t].item() == pytest.approx(-sum(q * math.log(q) for q in p))


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_bool_mask_and_float32_give_the_same_loss(name):
    lp, old, adv, mask = _random_batch(3, 4, 6, dtype=torch.float32)
    extra = _extra_inputs(3, 4, 6).get(name, {})
    extra = {k: (v.float() if v.is_floating_point() else v) for k, v in extra.items()}
    a, _ = POLICY_LOSSES[name](lp, old, adv, mask, **extra)
    b, _ = POLICY_LOSSES[name](lp, old, adv, mask.bool(), **extra)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
