"""Shared-prefix packing gives the padded batch's logprobs, entropies and gradients."""

import pytest
import torch

from reroll.models.loading import load_model
from reroll.models.logprobs import forward_logprobs
from reroll.models.packing import pack_shared_prefixes, supports_packing

pytestmark = pytest.mark.unit


def test_packing_layout_by_hand():
    # Rows 0 and 1 share the prompt [5, 6]; row 2 has its own. Right padding is 0.
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [4, 6, 9, 9]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    response = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1]])
    packed = pack_shared_prefixes(ids, attention, response)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 6, 9, 9, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 0]]
    assert packed.segments.tolist() == [[0, 0, 1, 1, 2], [0, 0, 1, 1, -1]]
    # Token (row 0, col 2) = 7 is predicted from packed (0, 1), the prompt's last token; (0, 3)
    # from (0, 2); row 1's only response token from the same prompt position (0, 1).
    assert list(zip(packed.target_row.tolist(), packed.target_col.tolist(),
                    packed.source_row.tolist(), packed.source_col.tolist(),
                    packed.target_ids.tolist(), strict=True)) == [
        (0, 2, 0, 1, 7), (0, 3, 0, 2, 8), (1, 2, 0, 1, 9), (2, 2, 1, 1, 9), (2, 3, 1, 2, 9)]
    mask = packed.attention_mask(torch.bool)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 0],
                    [1, 1, 0, 0, 1]]  # the second response sees the prompt and itself only
    assert packed.attention_mask(torch.bool)[1, 0, 4].int().tolist() == [0, 0, 0, 0, 1]


def test_no_shared_prompt_means_no_packing():
    ids = torch.tensor([[5, 6, 7], [4, 6, 7]])
    ones = torch.ones_like(ids)
    response = torch.tensor([[0, 1, 1], [0, 1, 1]])
    assert pack_shared_prefixes(ids, ones, response) is None


def grpo_like_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two groups of 3 sharing prompts of 5 and 7 tokens, responses of 1-6 tokens (right
    padded), a multi-turn row with an environment span inside its response, and a lone row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_len, response_lens in ((5, (6, 2, 4)), (7, (1, 5, 3))):
        prompt = torch.randint(3, 500, (prompt_len,), generator=g).tolist()
        for n in response_lens:
            rows.append((prompt, torch.randint(3, 500, (n,), generator=g).tolist()))
    rows.append((torch.randint(3, 500, (4,), generator=g).tolist(),
                 torch.randint(3, 500, (5,), generator=g).tolist()))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, response = torch.zeros_like(ids), torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        response[i, len(p) : len(p) + len(r)] = 1
    response[0, 7:9] = 0  # row 0: an environment reply inside its response
    return ids, attention, response


@pytest.mark.parametrize("attention_impl", ["sdpa", "eager"])
def test_packed_forward_matches_the_padded_batch(tiny_model, attention_impl):
    model = load_model(tiny_model)
    model.set_attn_implementation(attention_impl)
    ids, attention, response = grpo_like_batch()
    assert pack_shared_prefixes(ids, attention, response) is not None
    padded, padded_entropy = forward_logprobs(model, ids, attention, 0.7, with_entropy=True)
    packed, packed_entropy = forward_logprobs(model, ids, attention, 0.7, with_entropy=True,
                                              response_mask=response)
    scored = response.bool()
    assert torch.allclose(packed[scored], padded[scored], atol=1e-5)
    assert torch.allclose(packed_entropy[scored], padded_entropy[scored], atol=1e-5)
    before_response = torch.cumsum(response, -1) == 0
    assert (packed[before_response] == 0).all()


def test_packed_forward_gives_the_padded_gradient(tiny_model):
    ids, attention, response = grpo_like_batch(seed=1)
    grads = []
    for mask in (None, response):
        model = load_model(tiny_model)
        logprobs, entropy = forward_logprobs(model, ids, attention, with_entropy=True,
                                             response_mask=mask)
        ((logprobs + 0.1 * entropy) * response).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, atol=1e-5, rtol=1e-4), name


def test_packing_is_only_used_where_a_custom_mask_is_honoured(tiny_model):
    model = load_model(tiny_model)
    assert supports_packing(model)
    # Sliding-window layers pack (the packed mask carries the window); others do not.
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert supports_packing(model)
    model.config.layer_types = ["chunked_attention"] * len(model.config.layer_types)
    assert not supports_packing(model)
    model = load_model(tiny_model)
    model.config._attn_implementation = "flash_attention_2"
    assert not supports_packing(model)


def test_a_group_packs_only_while_a_member_costs_fewer_flops_packed():
    # Attention only (hidden size 0): a 2-token prompt with 4-token responses would make a
    # 10-token row, 10^2 > 2 x 6^2 pairs: long responses to a short prompt stay rows of their
    # own (the dense mask over the packed row would cost more than the padded rows).
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 9, 9, 9, 9]])
    ones, response = torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)
    assert pack_shared_prefixes(ids, ones, response) is None
    # With hidden size 8 the second member saves 6 x 8 x (6 - 4) = 96 >= 10^2 - 6^2 - 6^2 = 28.
    assert pack_shared_prefixes(ids, ones, response, hidden_size=8).input_ids.tolist() == [
        [5, 6, 7, 8, 9, 10, 9, 9, 9, 9]]
    # A 5-token prompt with 1-token responses packs whole: 8^2 - 7^2 - 6^2 < 0 pairs added.
    ids = torch.tensor([[5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 9, 2], [5, 6, 7, 8, 9, 3]])
    response = torch.tensor([[0, 0, 0, 0, 0, 1]] * 3)
    packed = pack_shared_prefixes(ids, torch.ones_like(ids), response)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]


# -- sliding windows (a custom 4D mask replaces the model's own window) -----------------------------

@pytest.mark.parametrize("architecture", ["mistral", "gemma2", "gemma3_text"])
def test_packing_keeps_the_sliding_window(tmp_path, architecture):
    """Rows longer than the 16-token window: the packed forward equals the padded one (which
    transformers masks itself). Mistral, which declares only `sliding_window`, was packed with a
    full causal mask: logprobs off by nats."""
    from reroll.models.factory import make_model
    from reroll.models.loading import load_model
    from reroll.models.logprobs import forward_logprobs
    from reroll.models.packing import sliding_window, supports_packing

    path = make_model(tmp_path / architecture, "tiny", seed=0, architecture=architecture)
    model = load_model(str(path)).eval()
    assert sliding_window(model.config) == 16 and supports_packing(model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 500, (20,), generator=generator)
    rows = [torch.cat([prompt, torch.randint(5, 500, (n,), generator=generator)])
            for n in (30, 12, 25, 7)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], attention[i, :len(r)], response[i, 20:len(r)] = r, 1, 1
    with torch.no_grad():
        padded, _ = forward_logprobs(model, ids, attention)
        packed, _ = forward_logprobs(model, ids, attention, response_mask=response)
    assert torch.allclose(padded * response, packed, atol=1e-4), \
        (padded * response - packed).abs().max()
