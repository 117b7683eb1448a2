"""The teacher's top-k and the student's gathered logprobs of `reroll.models.top_k` (chunked from
the hidden states) equal the full-logits reference: values, placement (response positions only,
0 elsewhere) and gradients, over head kinds, seeds and shapes, with chunks smaller than a row."""

import pytest
import torch

from reroll.models import lm_head
from reroll.models.top_k import logprobs_at, teacher_top_k
from tests.models.test_lm_head import batch, small_model

pytestmark = pytest.mark.unit


def reference(model, ids, attention, temperature):
    """[B, L, V] log-softmax of the next-token distribution at each position (position t: token
    t's), from the model's own forward; position 0 is never scored."""
    logits = model(input_ids=ids, attention_mask=attention).logits.float() / temperature
    full = torch.log_softmax(logits, -1)
    return torch.cat([torch.zeros_like(full[:, :1]), full[:, :-1]], 1)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_teacher_top_k_is_the_full_distributions_top_k(kind, seed, monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 97 * 5)  # 5 positions a chunk
    model = small_model(kind, seed)
    ids, attention, response = batch(seed, rows=3, width=12, vocab=97)
    top_ids, top_lp = teacher_top_k(model, ids, attention, response, 4, temperature=0.7)
    with torch.no_grad():
        full = reference(model, ids, attention, 0.7)
    on = response.bool()
    expected = full.topk(4, -1)
    assert torch.equal(top_ids[on], expected.indices[on])
    torch.testing.assert_close(top_lp[on], expected.values[on], atol=1e-5, rtol=1e-5)
    assert not top_lp[~on].any() and not top_ids[~on].any()


@pytest.mark.parametrize("kind", ["llama", "cohere"])
@pytest.mark.parametrize("seed", [0, 2])
def test_gathered_logprobs_and_gradients_match_the_full_logits(kind, seed, monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 97 * 3)
    model = small_model(kind, seed)
    ids, attention, response = batch(seed, rows=3, width=10, vocab=97)
    g = torch.Generator().manual_seed(seed)
    picked = torch.randint(0, 97, (*ids.shape, 3), generator=g)
    weights = torch.linspace(0.5, 1.5, picked.numel()).view(picked.shape)

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn()
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                              if p.grad is not None}

    ours, ours_grads = run(lambda: logprobs_at(model, ids, attention, response, picked, 0.9)[0])
    ref, ref_grads = run(lambda: reference(model, ids, attention, 0.9).gather(-1, picked)
                         * response[..., None])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert ours_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(ours_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4)
    entropy = logprobs_at(model, ids, attention, response, picked, 0.9)[1]
    with torch.no_grad():
        full = reference(model, ids, attention, 0.9)
    expected = -(full.exp() * full).sum(-1) * response
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-5)
