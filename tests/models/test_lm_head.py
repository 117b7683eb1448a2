"""The chunked LM-head path gives the full-logits reference's logprobs, entropies and gradients
(padded and packed batches, several seeds and shapes, scaled and soft-capped heads)."""

import pytest
import torch

from reroll.models import lm_head
from reroll.models.lm_head import OutputHead
from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs, forward_logprobs
from tests.models.test_packing import grpo_like_batch

pytestmark = pytest.mark.unit

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def small_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random-init model of one of the head kinds: plain, soft-capped, scaled up, scaled down."""
    from transformers import (
        AutoModelForCausalLM,
        CohereConfig,
        Gemma2Config,
        GraniteConfig,
        LlamaConfig,
    )

    configs = {
        "llama": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
        "gemma2": lambda: Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=2.0,
                                       query_pre_attn_scalar=8),
        "cohere": lambda: CohereConfig(**SMALL, logit_scale=0.37),
        "granite": lambda: GraniteConfig(**SMALL, logits_scaling=3.5),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="eager")
    with torch.no_grad():  # larger weights: logits that the cap and scales visibly change
        model.get_output_embeddings().weight.mul_(8.0)
    return model.float()


def batch(seed: int, rows: int, width: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    attention = (torch.arange(width) < lengths[:, None]).long()
    response = ((torch.arange(width) >= width // 3) & (attention > 0)).float()
    return ids, attention, response


def scores_and_grads(model, ids, attention, response, chunked, temperature=0.7):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = forward_logprobs(model, ids, attention, temperature, with_entropy=True,
                                         response_mask=response, chunked=chunked)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view(ids.shape) * attention
    ((logprobs * weights).sum() + 0.3 * (entropy * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


def assert_agree(model, ids, attention, response):
    ref = scores_and_grads(model, ids, attention, response, chunked=False)
    got = scores_and_grads(model, ids, attention, response, chunked=True)
    real = attention.bool() if response is None else torch.cumsum(response, -1) > 0
    real &= attention.bool()
    real[:, 0] = False
    torch.testing.assert_close(got[0][real], ref[0][real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][real], ref[1][real], atol=2e-5, rtol=1e-5)
    assert ref[2].keys() == got[2].keys()
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "cohere", "granite"])
@pytest.mark.parametrize("seed,rows,width", [(0, 3, 11), (1, 5, 17), (2, 1, 6)])
def test_chunked_head_matches_the_full_logits_on_a_padded_batch(kind, seed, rows, width,
                                                                monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 97 * 4)  # 4 positions a chunk: many chunks
    model = small_model(kind, seed)
    assert OutputHead.of(model) is not None
    ids, attention, response = batch(seed, rows, width, 97)
    assert_agree(model, ids, attention, None)
    assert_agree(model, ids, attention, response)


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_head_matches_the_full_logits_on_a_packed_batch(tiny_model, seed, monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 5000)
    model = load_model(tiny_model)
    ids, attention, response = grpo_like_batch(seed)
    assert_agree(model, ids, attention, response)


def test_soft_cap_and_scales_are_applied(monkeypatch):
    """Without the cap or the scale the chunked logprobs would differ: the test above would
    catch a head that ignores them."""
    for kind in ("gemma2", "cohere", "granite"):
        model = small_model(kind)
        head = OutputHead.of(model)
        plain = OutputHead(head.backbone, head.head)
        hidden = torch.randn(4, 32)
        assert not torch.allclose(plain.logits(hidden), head.logits(hidden), atol=1e-3), kind


def test_unknown_heads_take_the_reference_path(monkeypatch):
    from transformers import AutoModelForCausalLM, BloomConfig

    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=97, hidden_size=32, n_layer=1,
                                                         n_head=4))
    assert OutputHead.of(bloom) is None  # an architecture whose head is not checked here
    assert OutputHead.of(torch.nn.Linear(3, 3)) is None
    ids, attention, _ = batch(0, 2, 7, 97)
    logprobs, _ = forward_logprobs(bloom, ids, attention)  # still scored, by its own forward
    assert logprobs[:, 1:].lt(0).all()


def test_no_grad_scoring_matches_and_keeps_no_graph(tiny_model, monkeypatch):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 3000)
    model = load_model(tiny_model)
    ids, attention, response = grpo_like_batch(3)
    got = batched_logprobs(model, ids, attention, 4, 0.9, response)
    with torch.no_grad():
        ref, _ = forward_logprobs(model, ids, attention, 0.9, chunked=False)
    scored = response.bool()
    assert not got.requires_grad
    torch.testing.assert_close(got[scored], ref[scored], atol=2e-5, rtol=1e-5)
