import asyncio
import time

import pytest

from reroll.rewards import RewardResult, RewardRunner, RewardSample
from reroll.rewards.math import WARM_UP_ANSWERS, MathRewardFn, last_boxed, verify_boxed
from reroll.rewards.pool import CallTimeout, ProcessPool

pytestmark = pytest.mark.unit


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{unclosed") is None


@pytest.mark.parametrize("response, answer, score", [
    ("3 + 4 = 7. The answer is \\boxed{7}.", "7", 1.0),
    ("The answer is \\boxed{7.0}.", "7", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("The answer is \\boxed{8}.", "7", 0.0),
    ("The answer is 7.", "7", 0.0),  # no boxed answer: no credit, even if the number is right
])
def test_math_reward_scores(response, answer, score):
    reward = MathRewardFn(timeout_s=5)
    try:
        result = asyncio.run(reward(RewardSample("q", response, answer)))
    finally:
        reward.close()
    assert result.score == score


def test_the_warm_up_answers_take_the_real_paths():
    """Each warm-up answer parses and matches itself, and not 9: the warm-up sets up the
    parsing and comparison a real answer of its kind needs, not an error path."""
    for answer in WARM_UP_ANSWERS:
        assert verify_boxed(f"\\boxed{{{answer}}}", answer)[0] == 1.0, answer
        assert verify_boxed(f"\\boxed{{{answer}}}", "9")[0] == 0.0, answer


def test_format_weight_mixes_in_a_format_score():
    reward = MathRewardFn(format_weight=0.2)
    try:
        wrong_but_boxed = asyncio.run(reward(RewardSample("q", "\\boxed{8}", "7")))
        truncated = asyncio.run(reward(RewardSample("q", "\\boxed{7}", "7", finish_reason="length")))
    finally:
        reward.close()
    assert wrong_but_boxed.score == pytest.approx(0.2)
    assert truncated.score == pytest.approx(0.8)


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def crash() -> None:
    import os

    os._exit(3)


def test_process_pool_kills_a_hung_call_and_keeps_serving():
    pool = ProcessPool(num_workers=2)

    async def go():
        return await asyncio.gather(pool.run(sleepy, 30, timeout=0.5), pool.run(sleepy, 0, timeout=5),
                                    return_exceptions=True)
    try:
        start = time.perf_counter()
        hung, fine = asyncio.run(go())
        assert isinstance(hung, CallTimeout) and fine == "done"
        assert time.perf_counter() - start < 10
        assert asyncio.run(pool.run(sleepy, 0, timeout=5)) == "done"
        with pytest.raises(Exception, match="exited"):
            asyncio.run(pool.run(crash, timeout=5))
        assert asyncio.run(pool.run(sleepy, 0, timeout=5)) == "done"
        assert pool.restarts >= 1
    finally:
        pool.close()


def remember(value):
    global REMEMBERED
    REMEMBERED = value


def recall():
    return REMEMBERED


def test_process_pool_warm_up_runs_first_in_every_worker_and_may_fail():
    pool = ProcessPool(num_workers=2, warm_up=(remember, ("warm",)))
    try:
        assert pool._started == 2  # started with the pool, before any call
        async def both():
            return await asyncio.gather(pool.run(recall, timeout=5), pool.run(recall, timeout=5))

        assert asyncio.run(both()) == ["warm", "warm"]
    finally:
        pool.close()
    failing = ProcessPool(num_workers=1, warm_up=(int, ("not a number",)))
    try:  # a warm-up's error is not the call's
        assert asyncio.run(failing.run(abs, -3, timeout=5)) == 3
    finally:
        failing.close()


class Hangs:
    name = "hangs"

    async def __call__(self, sample):
        await asyncio.sleep(60)


class Crashes:
    name = "crashes"

    async def __call__(self, sample):
        raise RuntimeError("verifier bug")


class Works:
    name = "works"

    async def __call__(self, sample):
        return RewardResult(1.0)


def test_runner_counts_timeouts_and_errors_and_never_raises():
    hangs, crashes, works = (RewardRunner(fn(), timeout_s=0.1) for fn in (Hangs, Crashes, Works))
    sample = RewardSample("q", "r", "a")

    async def go():
        return await asyncio.gather(hangs.reward(sample), crashes.reward(sample), works.reward(sample))

    timed_out, crashed, ok = asyncio.run(go())
    assert timed_out.score == 0.0 and "timeout" in timed_out.info["error"]
    assert crashed.score == 0.0 and "verifier bug" in crashed.info["error"]
    assert ok.score == 1.0
    counts = ("reward/errors", "reward/timeouts")
    assert [hangs.metrics()[k] for k in counts] == [0.0, 1.0]
    assert [crashes.metrics()[k] for k in counts] == [1.0, 0.0]
