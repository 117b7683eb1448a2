import asyncio

import pytest
import torch
from engine_checks import assert_trainer_logprobs, generate_all

from reroll.engines.base import Request, SamplingParams, fingerprint
from reroll.engines.hf import HFEngine, _top_k_top_p
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return HFEngine(load_model(tiny_model), max_batch_size=64, pad_token_id=tokenizer.pad_token_id)


def prompts(tokenizer, n):
    return [tokenizer.apply_chat_template([{"role": "user", "content": "apples " * (1 + i % 4)}],
                                          add_generation_prompt=True, tokenize=True)["input_ids"]
            for i in range(n)]



def test_behaviour_logprobs_match_the_trainer(engine, tokenizer, tiny_model):
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    outs = generate_all(engine, [Request(p, params, seed=i) for i, p in enumerate(prompts(tokenizer, 6))])
    assert_trainer_logprobs(outs, load_model(tiny_model), temperature=0.7, atol=1e-4)
    assert all(len(out.token_ids) == 12 and out.finish_reason == "length" for out in outs)


def test_sample_does_not_depend_on_batch_neighbours(engine, tokenizer):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    many = generate_all(engine, [Request(p, params, seed=100 + i) for i, p in enumerate(prompts(tokenizer, 8))])
    alone = generate_all(engine, [Request(many[5].prompt_ids, params, seed=105)])[0]
    assert alone.token_ids == many[5].token_ids
    other_seed = generate_all(engine, [Request(many[5].prompt_ids, params, seed=7)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_greedy_equals_top_k_one_and_stop_token_ends(engine, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    greedy = generate_all(engine, [Request(prompt, SamplingParams(8, temperature=0.0))])[0]
    top1 = generate_all(engine, [Request(prompt, SamplingParams(8, temperature=1.0, top_k=1), seed=3)])[0]
    assert greedy.token_ids == top1.token_ids
    stop = greedy.token_ids[2]
    stopped = generate_all(engine, [Request(prompt, SamplingParams(8, temperature=0.0, stop_token_ids=(stop,)))])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stopped.token_ids == greedy.token_ids[: len(stopped.token_ids)]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_top_k_top_p(logits, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, True, False, False]]


def test_abort_returns_tokens_generated_so_far(engine, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    params = SamplingParams(max_new_tokens=400, temperature=1.0)

    async def go():
        request = Request(prompt, params, seed=1)
        task = asyncio.create_task(engine.generate(request))
        await asyncio.sleep(0.05)
        engine.abort(request.request_id)
        return await task

    out = asyncio.run(go())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 400
    assert len(out.logprobs) == len(out.token_ids)


def test_load_weights_changes_fingerprint_and_outputs(tiny_model, tokenizer):
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    other = load_model(tiny_model)
    assert engine.weights_fingerprint() == fingerprint(other.state_dict().items())
    prompt = prompts(tokenizer, 1)[0]
    before = generate_all(engine, [Request(prompt, SamplingParams(6, temperature=0.0))])[0]
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.load_weights(other.state_dict().items(), version=3)
    after = generate_all(engine, [Request(prompt, SamplingParams(6, temperature=0.0))])[0]
    assert engine.weights_fingerprint() == fingerprint(other.state_dict().items())
    assert after.policy_version == 3 and after.token_ids != before.token_ids


def test_fingerprint_sees_a_single_changed_value():
    weights = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    changed = {**weights, "b": torch.tensor([[1.0, 1.0], [1.0, 1.0 + 1e-6]])}
    assert fingerprint(weights.items()) == fingerprint(reversed(list(weights.items())))
    assert fingerprint(weights.items()) != fingerprint(changed.items())


def test_stats_count_queue_and_speed_and_sleep_wake_keep_outputs(tiny_model, tokenizer):
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    requests = [Request(p, SamplingParams(6, temperature=0.0)) for p in prompts(tokenizer, 3)]

    async def go():
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
        await asyncio.sleep(0)
        queued = engine.stats().queued
        return queued, await asyncio.gather(*tasks)

    queued, before = asyncio.run(go())
    stats = engine.stats()
    assert queued == 3 and stats.queued == 0
    assert stats.generated_tokens == 18 and stats.tokens_per_s > 0
    engine.sleep()
    engine.wake()
    assert [c.token_ids for c in generate_all(engine, requests)] == [c.token_ids for c in before]


def test_batches_group_similar_prompt_lengths_and_keep_the_oldest():
    from reroll.engines.hf import _similar_lengths
    from reroll.engines.running_batch import Row

    pending = [Row(Request([0] * n, SamplingParams())) for n in (9, 2, 30, 8, 31, 10)]
    batch = _similar_lengths(pending, anchor=9, size=3)
    assert [len(row.request.prompt_ids) for row in batch] == [9, 8, 10]


def test_bf16_engine_keeps_the_trainers_fingerprint_and_close_logprobs(tiny_model, tokenizer):
    """rollout.dtype bfloat16: bf16 weights, fingerprints of the float32 weights it received,
    behaviour logprobs within bf16 rounding of the float32 trainer's."""
    from reroll.config.schema import RolloutConfig
    from reroll.engines import build_engine

    trainer = load_model(tiny_model)
    engine = build_engine(RolloutConfig(dtype="bfloat16"), tiny_model,
                          pad_token_id=tokenizer.pad_token_id)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.weights_fingerprint() == fingerprint(trainer.state_dict().items())
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.5) if not trainer.config.tie_word_embeddings \
            else trainer.model.embed_tokens.weight.mul_(1.5)
    engine.load_weights(trainer.state_dict().items(), version=1)
    assert engine.weights_fingerprint() == fingerprint(trainer.state_dict().items())
    for name, value in trainer.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value.to(torch.bfloat16)), name
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    outs = generate_all(engine, [Request(p, params, seed=i) for i, p in enumerate(prompts(tokenizer, 6))])
    assert_trainer_logprobs(outs, trainer, temperature=0.7, atol=0.03)  # ~0.01 seen
