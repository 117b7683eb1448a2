"""The disaggregation benchmark's modelled engine wakes only when a sequence is due to finish, and
finishes every sequence when a loop that woke at every decoding step would (an arrival joins at
the step after it arrives). Driven by hand: `_replay(now)` at chosen times, no sleeping."""

import asyncio
import importlib.util
import random
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).parents[1] / "benchmarks" / "disaggregation.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("disaggregation", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_by_step(bench, arrivals: list[float]) -> list[float]:
    """The reference: every step one by one; a sequence that arrives during a step joins at its
    end, one that arrives while the engine is idle starts a step at once."""
    waiting = sorted((t, i) for i, t in enumerate(arrivals))
    active, start, finish = {}, 0.0, [0.0] * len(arrivals)
    while waiting or active:
        if not active:
            start = max(start, waiting[0][0])
        while waiting and waiting[0][0] <= start:
            active[waiting.pop(0)[1]] = bench.TOKENS
        start += bench.STEP_S + bench.PER_SEQ_S * len(active)
        for i in list(active):
            active[i] -= 1
            if active[i] == 0:
                finish[i] = start
                del active[i]
    return finish


def replayed(bench, arrivals: list[float]) -> list[float]:
    """When the engine's replay first reports each sequence done, checking at every arrival and
    at every time the engine asks to be woken (its `_next_finish`)."""
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
                engine.waiting.append((now, [bench.TOKENS, futures[i], i]))
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
