"""The HF engine's continuous batching and shared-prompt prefill, on the real tiny model.

"Alone" is the same request decoded by itself: joining a running batch, sharing a prefill or being
padded must not change a request's sample."""

import asyncio
from dataclasses import replace

import pytest
import torch

from reroll.engines.base import Request, SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.attention import decode_row_segments
from reroll.models.loading import load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return HFEngine(load_model(tiny_model), max_batch_size=64, pad_token_id=tokenizer.pad_token_id)


def prompt(tokenizer, words: int) -> list[int]:
    """A chat prompt of 11 + `words` tokens."""
    return tokenizer.apply_chat_template([{"role": "user", "content": "apples " * words}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]


def assert_same_sample(out, alone):
    assert out.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-4)


async def until(condition, ticks: int = 10_000) -> None:
    """Hand the loop to the engine until `condition()` holds."""
    for _ in range(ticks):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_requests_join_a_running_batch_and_return_before_it_ends(engine, tokenizer):
    params = SamplingParams(max_new_tokens=120, temperature=1.0)
    long = Request(prompt(tokenizer, 1), params, seed=1)
    # joins when the running cache is shorter than its prompt: the running rows get padded
    wide = Request(prompt(tokenizer, 60), replace(params, max_new_tokens=5), seed=2)
    # joins when the running cache is longer than its prompt: the newcomer gets padded
    short = Request(prompt(tokenizer, 2), replace(params, max_new_tokens=5), seed=3)

    async def go():
        long_task = asyncio.create_task(engine.generate(long))
        await until(lambda: engine.running_cache_length() >= len(long.prompt_ids) + 3)
        wide_out = await engine.generate(wide)
        assert not long_task.done()
        short_out = await engine.generate(short)
        assert not long_task.done()
        return await long_task, wide_out, short_out

    outs = asyncio.run(go())
    for request, out in zip((long, wide, short), outs, strict=True):
        assert_same_sample(out, engine.generate_batch([request])[0])


def test_joining_requests_reuse_the_rows_that_finished_rows_left(engine, tokenizer):
    """After rows end (and leave their K/V behind in the buffers), newcomers are written into
    the spare rows of the same buffers, not into a new cache, and still sample as if alone."""
    params = SamplingParams(max_new_tokens=60, temperature=1.0)
    first = [Request(prompt(tokenizer, 2 + i), replace(params, max_new_tokens=n), seed=30 + i)
             for i, n in enumerate([60, 4, 4, 4, 60])]
    later = [Request(prompt(tokenizer, 1 + i), replace(params, max_new_tokens=8), seed=40 + i)
             for i in range(3)]
    buffers = []

    def key_buffer():
        return engine._running.cache.layers[0].buffers[0]

    async def go():
        tasks = [asyncio.create_task(engine.generate(r)) for r in first]
        await asyncio.gather(*tasks[1:4])  # three rows ended: compacted away
        await until(lambda: engine._running is not None and len(engine._running.rows) == 2)
        buffers.append(key_buffer())
        joined = [asyncio.create_task(engine.generate(r)) for r in later]
        await until(lambda: engine._running is not None and len(engine._running.rows) == 5)
        buffers.append(key_buffer())
        return await asyncio.gather(*tasks, *joined)

    outs = asyncio.run(go())
    assert buffers[1] is buffers[0]  # the same buffers: only the newcomers were copied
    for request, out in zip(first + later, outs, strict=True):
        assert_same_sample(out, engine.generate_batch([request])[0])


def test_rows_of_a_batch_return_as_they_finish(engine, tokenizer):
    requests = [Request(prompt(tokenizer, 1 + i), SamplingParams(max_new_tokens=n, temperature=1.0),
                        seed=i) for i, n in enumerate([40, 3, 40, 3])]
    returned = []

    async def one(request):
        out = await engine.generate(request)
        returned.append((len(out.token_ids), engine.running_cache_length() > 0))

    async def go():
        await asyncio.gather(*(one(r) for r in requests))

    asyncio.run(go())
    assert returned == [(3, True), (3, True), (40, False), (40, False)]


def test_a_shared_prompt_is_prefilled_once_and_samples_as_if_alone(engine, tokenizer):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    group = [Request(prompt(tokenizer, 3), params, seed=10 + i) for i in range(4)]
    other = [Request(prompt(tokenizer, 6), params, seed=20 + i) for i in range(2)]
    requests = group[:2] + other[:1] + group[2:] + other[1:]
    lm_head_inputs = []
    hook = engine.model.lm_head.register_forward_hook(
        lambda module, args, out: lm_head_inputs.append(args[0].numel() // args[0].shape[-1]))
    try:
        together = engine.generate_batch(requests)
    finally:
        hook.remove()
    assert lm_head_inputs[0] == 2  # two distinct prompts, logits of the last position only
    assert lm_head_inputs[1] == 6
    for request, out in zip(requests, together, strict=True):
        assert_same_sample(out, engine.generate_batch([request])[0])
    assert len({tuple(out.token_ids) for out in together}) == len(requests)


def test_padding_is_cropped_when_the_row_that_needed_it_leaves(engine, tokenizer):
    wide = Request(prompt(tokenizer, 100), SamplingParams(3, temperature=1.0), seed=1)
    narrow = Request(prompt(tokenizer, 1), SamplingParams(40, temperature=1.0), seed=2)
    lengths = []  # (wide has returned, running cache length) at each tick

    async def go():
        tasks = [asyncio.create_task(engine.generate(r)) for r in (wide, narrow)]
        while not tasks[1].done():
            lengths.append((tasks[0].done(), engine.running_cache_length()))
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    _, narrow_out = asyncio.run(go())
    assert max(n for wide_done, n in lengths if not wide_done) >= len(wide.prompt_ids)
    after = [n for wide_done, n in lengths if wide_done and n > 0]
    assert after and max(after) <= len(narrow.prompt_ids) + 40
    assert_same_sample(narrow_out, engine.generate_batch([narrow])[0])


def test_another_sampling_key_waits_for_the_batch_to_drain_and_is_not_overtaken(engine, tokenizer):
    greedy_long = Request(prompt(tokenizer, 1), SamplingParams(30, temperature=0.0))
    sampled = Request(prompt(tokenizer, 2), SamplingParams(5, temperature=1.0), seed=1)
    greedy_short = Request(prompt(tokenizer, 3), SamplingParams(5, temperature=0.0))
    order = []

    async def one(request, name):
        await engine.generate(request)
        order.append(name)

    async def go():
        first = asyncio.create_task(one(greedy_long, "greedy long"))
        await until(lambda: engine.running_cache_length() > 0)
        # greedy_short could join the running greedy batch, but `sampled` came first and waits
        await asyncio.gather(first, one(sampled, "sampled"), one(greedy_short, "greedy short"))

    asyncio.run(go())
    assert order == ["greedy long", "sampled", "greedy short"]


def test_a_request_aborted_while_waiting_ends_at_once_with_no_tokens(engine, tokenizer):
    running = Request(prompt(tokenizer, 1), SamplingParams(60, temperature=0.0))
    waiting = Request(prompt(tokenizer, 1), SamplingParams(5, temperature=1.0), seed=1)

    async def go():
        running_task = asyncio.create_task(engine.generate(running))
        await until(lambda: engine.running_cache_length() > 0)
        waiting_task = asyncio.create_task(engine.generate(waiting))
        await asyncio.sleep(0)
        engine.abort(waiting.request_id)
        waited = await waiting_task
        assert not running_task.done()
        return waited, await running_task

    waited, ran = asyncio.run(go())
    assert waited.finish_reason == "abort" and waited.token_ids == [] == waited.logprobs
    assert ran.finish_reason == "length" and len(ran.token_ids) == 60


def test_a_prompt_the_model_rejects_fails_alone_and_the_engine_keeps_serving(engine, tokenizer):
    good = Request(prompt(tokenizer, 1), SamplingParams(20, temperature=0.0))
    bad = Request([engine.model.config.vocab_size + 5], SamplingParams(5, temperature=0.0))
    later = Request(prompt(tokenizer, 2), SamplingParams(4, temperature=0.0))

    async def go():
        good_task = asyncio.create_task(engine.generate(good))
        await until(lambda: engine.running_cache_length() > 0)
        with pytest.raises(IndexError):
            await engine.generate(bad)
        assert not good_task.done()
        return await good_task, await engine.generate(later)

    good_out, later_out = asyncio.run(go())
    assert good_out.token_ids == engine.generate_batch([good])[0].token_ids
    assert len(later_out.token_ids) == 4


def test_decode_row_segments_by_hand():
    starts = [0, 0, 5, 40, 41, 42, 100]
    attention = torch.zeros(len(starts), 120, dtype=torch.long)
    for row, start in enumerate(starts):
        attention[row, start:] = 1
    assert decode_row_segments(attention) == ((0, 3, 0), (3, 6, 40), (6, 7, 100))
    assert decode_row_segments(attention, most=2) == ((0, 6, 0), (6, 7, 100))
    assert decode_row_segments(torch.ones(3, 10, dtype=torch.long)) is None  # nothing to skip


def test_a_paused_request_keeps_its_cache_does_no_work_and_resumes_as_if_never_paused(
        tiny_model, tokenizer):
    engine = HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id)
    paused = Request([1, 5, 9, 11], SamplingParams(40, temperature=1.0), seed=3)
    neighbour = Request([1, 6], SamplingParams(60, temperature=1.0), seed=4)

    async def go():
        tasks = [asyncio.create_task(engine.generate(r)) for r in (paused, neighbour)]
        await until(lambda: engine.running_cache_length() >= len(paused.prompt_ids) + 5)
        engine.pause(paused.request_id)
        await until(lambda: engine.paused() == 1)
        held = len(engine._parked[paused.request_id].rows[0].tokens)
        assert 0 < held < 40 and len(engine._running.rows) == 1  # out of the batch
        neighbour_out = await tasks[1]  # the neighbour runs to its end meanwhile ...
        for _ in range(50):
            await asyncio.sleep(0)
        assert not tasks[0].done() and engine.paused() == 1  # ... and the paused one waits
        assert len(engine._parked[paused.request_id].rows[0].tokens) == held  # doing nothing
        engine.resume(paused.request_id)
        return await tasks[0], neighbour_out

    paused_out, neighbour_out = asyncio.run(go())
    assert engine.paused() == 0
    for request, out in ((paused, paused_out), (neighbour, neighbour_out)):
        alone = engine.generate_batch([request])[0]
        assert out.finish_reason == "length" and out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_an_aborted_paused_request_ends_at_once_with_its_tokens_and_a_paused_pending_one_waits(
        tiny_model, tokenizer):
    engine = HFEngine(load_model(tiny_model), 8, tokenizer.pad_token_id)
    running = Request([1, 5, 9], SamplingParams(300, temperature=1.0), seed=1)
    pending = Request([1, 7], SamplingParams(5, temperature=1.0), seed=2)

    async def go():
        task = asyncio.create_task(engine.generate(running))
        await until(lambda: engine.running_cache_length() >= len(running.prompt_ids) + 3)
        engine.pause(running.request_id)
        await until(lambda: engine.paused() == 1)
        held = list(engine._parked[running.request_id].rows[0].tokens)
        engine.pause(pending.request_id)  # paused before it starts: not admitted
        later = asyncio.create_task(engine.generate(pending))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not later.done() and engine._running is None  # nothing decodes
        engine.abort(running.request_id)
        out = await task
        assert out.finish_reason == "abort" and out.token_ids == held
        assert len(out.logprobs) == len(held) and engine.paused() == 0
        engine.resume(pending.request_id)
        return await later

    later_out = asyncio.run(go())
    assert later_out.token_ids == engine.generate_batch([pending])[0].token_ids
