"""The disaggregation benchmark's modelled engine wakes only when a sequence is due to finish, and
finishes every sequence when a loop that woke at every decoding step would (an arrival joins at
the step after it arrives). Driven by hand: `_replay(now)` at chosen times, no sleeping."""

import asyncio
import random
import time

import pytest
from scripts import load_script

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/disaggregation.py")


def step_by_step(bench, arrivals: list[float], lengths: list[int] | None = None) -> list[float]:
    """The reference: every step one by one; a sequence that arrives during a step joins at its
    end, one that arrives while the engine is idle starts a step at once."""
    lengths = lengths or [bench.TOKENS] * len(arrivals)
    waiting = sorted((t, i) for i, t in enumerate(arrivals))
    active, start, finish = {}, 0.0, [0.0] * len(arrivals)
    while waiting or active:
        if not active:
            start = max(start, waiting[0][0])
        while waiting and waiting[0][0] <= start:
            i = waiting.pop(0)[1]
            active[i] = lengths[i]
        start += bench.STEP_S + bench.PER_SEQ_S * len(active)
        for i in list(active):
            active[i] -= 1
            if active[i] == 0:
                finish[i] = start
                del active[i]
    return finish


def replayed(bench, arrivals: list[float], lengths: list[int] | None = None) -> list[float]:
    """When the engine's replay first reports each sequence done, checking at every arrival and
    at every time the engine asks to be woken (its `_next_finish`)."""
    lengths = lengths or [bench.TOKENS] * len(arrivals)
    loop = asyncio.new_event_loop()
    try:
        engine = bench.Engine()
        futures = [loop.create_future() for _ in arrivals]
        finish = [None] * len(arrivals)
        events = sorted((t, i) for i, t in enumerate(arrivals))
        while events or engine.active or engine.waiting:
            wake = engine._next_finish() if engine.active else float("inf")
            if events and events[0][0] <= wake:
                now, i = events.pop(0)
                engine._replay(now)  # what has finished by the arrival, then the arrival
                engine.waiting.append((now, [lengths[i], futures[i], i]))
            else:
                now = wake
            engine._replay(now)
            for i, future in enumerate(futures):
                if future.done() and finish[i] is None:
                    assert future.result() == i
                    finish[i] = now
        return finish
    finally:
        loop.close()


def test_one_sequence_takes_tokens_steps_of_a_batch_of_one(bench):
    step = bench.STEP_S + bench.PER_SEQ_S
    assert replayed(bench, [0.0]) == pytest.approx([bench.TOKENS * step])


def test_an_arrival_during_a_step_joins_at_its_end(bench):
    one, two = (bench.STEP_S + bench.PER_SEQ_S * n for n in (1, 2))
    first, second = replayed(bench, [0.0, one / 2])
    assert first == pytest.approx(one + (bench.TOKENS - 1) * two)  # the rest of its steps with two
    assert second == pytest.approx(first + one)  # its last step alone


def test_the_replay_finishes_every_sequence_when_the_step_by_step_loop_does(bench):
    rng = random.Random(0)
    arrivals = [0.0] * 5 + [rng.uniform(0, 1.5) for _ in range(40)] + [2.5, 2.5, 4.0]
    assert replayed(bench, arrivals) == pytest.approx(step_by_step(bench, arrivals), abs=1e-9)


def test_responses_of_different_lengths_finish_when_the_step_by_step_loop_has_them_done(bench):
    """A short response that joins a batch finishes before the longer ones in flight: the wake
    the engine asks for moves earlier, never late."""
    two = bench.STEP_S + 2 * bench.PER_SEQ_S
    long, short = replayed(bench, [0.0, 0.1], [2 * bench.TOKENS, 3])
    assert short < 0.1 + 5 * two < long
    rng = random.Random(1)
    arrivals = [0.0] * 8 + [rng.uniform(0, 1.0) for _ in range(40)] + [2.0, 3.5]
    lengths = [rng.randint(1, 2 * bench.TOKENS) for _ in arrivals]
    assert replayed(bench, arrivals, lengths) == pytest.approx(
        step_by_step(bench, arrivals, lengths), abs=1e-9)


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_the_running_engine_wakes_for_a_short_response_that_joins_a_long_one(bench, event_loop):
    """The engine's own timer (not the hand-driven replay): a 3-token response that arrives
    while a long one decodes is answered while the long one is still in flight. On asyncio's
    loop and on uvloop, which Ray's async actors run on."""

    async def run():
        engine = bench.Engine()
        # about 60 s long: a loaded machine cannot stall the loop past it
        long = asyncio.create_task(engine.generate(0, 0, 0, 100 * bench.TOKENS))
        await asyncio.sleep(0.05)
        short = await engine.generate(1, 0, 0, 3)
        assert not long.done()
        long.cancel()
        return short

    run_loop = asyncio.run if event_loop == "asyncio" else pytest.importorskip("uvloop").run
    assert run_loop(run()) == bench.action_of(1, 0, 0)


def test_a_batch_decoded_together_lasts_until_its_longest_response(bench):
    """`decode_s`, the monolithic node's turn, is the step-by-step loop's last finish when the
    batch starts together; with equal lengths, TOKENS steps of the whole batch."""
    lengths = [bench.tokens_of(e, 3, 0.5) for e in range(16)]
    assert bench.decode_s(lengths) == pytest.approx(max(step_by_step(bench, [0.0] * 16, lengths)))
    assert bench.decode_s([bench.TOKENS] * 16) == pytest.approx(
        bench.TOKENS * (bench.STEP_S + 16 * bench.PER_SEQ_S))


def test_response_lengths_come_from_the_seed_and_average_tokens(bench):
    lengths = [bench.tokens_of(e, t, 0.5) for e in range(64) for t in range(8)]
    half = round(bench.TOKENS * 0.5)
    assert min(lengths) >= bench.TOKENS - half and max(lengths) <= bench.TOKENS + half
    assert abs(sum(lengths) / len(lengths) - bench.TOKENS) < 2
    assert len(set(lengths)) > 20
    assert lengths == [bench.tokens_of(e, t, 0.5) for e in range(64) for t in range(8)]
    assert {bench.tokens_of(e, 0, 0.0) for e in range(16)} == {bench.TOKENS}


def test_work_in_cpu_time_burns_its_seconds_and_answers_from_the_seed_alone(bench):
    """An environment step costs its CPU seconds however fast the CPU runs that minute, and
    both modes still see the same observations (the answer depends on the seed, not on how many
    hashes fitted in the time)."""
    start = time.thread_time()
    short = bench.burn_cpu_s("e0/0/7", 0.005)
    spent = time.thread_time() - start
    assert 0.005 <= spent < 0.5
    assert bench.burn_cpu_s("e0/0/7", 0.02) == short == bench.burn("e0/0/7", 1)
    assert bench.burn_cpu_s("e0/0/8", 0.005) != short
