"""The reward runner and its workers: non-finite scores are failures, a reward that keeps failing
stops the run, every kind of reward function is held to its time limit (counting the call, not
the wait for a worker), and reward workers have a memory cap."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from reroll.config.errors import RunStopped
from reroll.config.schema import CustomReward
from reroll.rewards import FailureBounds, RewardResult, RewardRunner, RewardSample, build_runner
from reroll.rewards.custom import CustomRewardFn

pytestmark = pytest.mark.unit
HELPERS = Path(__file__).parent.parent / "pipelines"  # rewards_for_tests.py


@pytest.fixture
def helpers(monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))


class Fixed:
    """Scores every sample with the next value of `scores` (cycled)."""

    name = "fixed"

    def __init__(self, *scores):
        self.scores, self.i = scores, 0

    async def __call__(self, sample):
        self.i += 1
        return RewardResult(self.scores[(self.i - 1) % len(self.scores)], {"k": 1})


def score_all(runner: RewardRunner, n: int) -> list[RewardResult]:
    async def go():
        return await asyncio.gather(*(runner.reward(RewardSample("q", str(i), "a"))
                                      for i in range(n)))
    return asyncio.run(go())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_a_non_finite_score_is_a_counted_failure(bad):
    runner = RewardRunner(Fixed(1.0, bad), timeout_s=1, failure_score=0.0)
    results = score_all(runner, 4)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert "non-finite" in results[1].info["error"] and results[1].info["k"] == 1
    assert runner.counters.errors == 2 and runner.counters.nonfinite == 2
    assert runner.metrics()["reward/nonfinite"] == 2.0


def test_a_custom_function_returning_nan_is_counted(helpers):
    for function in ("rewards_for_tests:nan_reward", "rewards_for_tests:inf_reward"):
        runner = build_runner(CustomReward(function=function))
        try:
            results = score_all(runner, 2)
        finally:
            runner.close()
        assert [r.score for r in results] == [0.0, 0.0]
        assert runner.counters.errors == 2 and runner.counters.nonfinite == 2


def test_every_call_failing_stops_the_run_at_the_first_check():
    runner = RewardRunner(Fixed(float("nan")), timeout_s=1)  # default bounds
    score_all(runner, 8)
    with pytest.raises(RunStopped, match=r"step 1: reward 'fixed' failed on 8 of 8 calls"):
        runner.check_failure_rate(1)


def test_the_stop_quotes_the_last_error():
    """Issue 49: a judge endpoint's malformed replies showed only as counts; the stop now says
    what the last failed call was."""

    class Malformed:
        name = "judge"

        async def __call__(self, sample):
            raise RuntimeError("http://judge/v1: malformed reply, not an OpenAI completion")

    runner = RewardRunner(Malformed(), timeout_s=1)
    score_all(runner, 4)
    with pytest.raises(RunStopped, match=r"the last: RuntimeError: http://judge/v1: malformed"):
        runner.check_failure_rate(1)


def test_failure_rate_bounds_per_step_and_per_run():
    runner = RewardRunner(Fixed(1.0, 1.0, 1.0, float("nan")), timeout_s=1,
                          bounds=FailureBounds(step=0.5, run=0.3))
    score_all(runner, 8)
    runner.check_failure_rate(1)  # 25% of calls failed: under both bounds
    runner.bounds = FailureBounds(step=0.5, run=0.2)
    score_all(runner, 8)
    with pytest.raises(RunStopped, match="this run so far"):
        runner.check_failure_rate(2)
    runner.bounds = FailureBounds(step=0.5, run=1.0)
    runner.reward_fn = Fixed(float("nan"), float("nan"), 1.0)
    score_all(runner, 6)  # this step: 4 of 6 failed
    with pytest.raises(RunStopped, match="step 3: .* 4 of 6 calls this step"):
        runner.check_failure_rate(3)


def test_counters_restored_on_resume_start_a_fresh_step_window():
    runner = RewardRunner(Fixed(1.0), timeout_s=1)
    runner.load_counters({"calls": 10, "errors": 4, "timeouts": 0})
    score_all(runner, 4)
    runner.check_failure_rate(5)  # 0 of 4 this step; 4 of 14 since the start: no stop
    assert (runner.counters.calls, runner.counters.errors) == (14, 4)


def test_an_async_reward_that_blocks_its_event_loop_still_times_out(helpers):
    fn = CustomRewardFn("rewards_for_tests:blocks_its_loop", timeout_s=1.0)
    runner = RewardRunner(fn, timeout_s=1.0)
    try:
        start = time.perf_counter()
        result = score_all(runner, 1)[0]
        elapsed = time.perf_counter() - start
        assert result.score == 0.0 and "timeout" in result.info["error"]
        assert runner.counters.timeouts == 1 and elapsed < 2.5, elapsed
        # The blocked loop was set aside: a later call runs on a fresh one.
        fn.fn = __import__("rewards_for_tests").quick_async
        assert score_all(runner, 1)[0].score == 0.5
    finally:
        runner.close()


def test_the_time_limit_counts_the_call_not_the_wait_for_a_worker(helpers):
    """Six 0.7 s calls on one worker with a 1 s limit: the last waits 3.5 s for the worker, yet
    none times out; the wait shows as `time/reward_queue_s_mean`."""
    runner = build_runner(CustomReward(function="rewards_for_tests:slow_reward", timeout_s=1.0,
                                       num_workers=1))
    try:
        results = score_all(runner, 6)
        metrics = runner.metrics()
    finally:
        runner.close()
    assert [r.score for r in results] == [1.0] * 6, [r.info for r in results]
    assert runner.counters.timeouts == 0
    assert metrics["time/reward_queue_s_mean"] > 1.0


def test_reward_workers_have_a_memory_cap(helpers):
    runner = build_runner(CustomReward(function="rewards_for_tests:allocates_3gb",
                                       memory_mb=512))
    try:
        results = score_all(runner, 2)
    finally:
        runner.close()
    assert [r.score for r in results] == [0.0, 0.0]
    assert results[0].info["error"].startswith("MemoryError")
    assert runner.counters.memory_errors == 2 and runner.metrics()["reward/memory_errors"] == 2.0
