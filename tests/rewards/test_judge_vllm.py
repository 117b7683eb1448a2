"""A judge served by vLLM (`reward: {type: judge, engine: {type: vllm}}`): the local judge model
in a worker process of its own (vLLM's engine core), giving the replies the in-process `hf`
judge gives, and gone when the reward is closed."""

import asyncio

import psutil
import pytest

from reroll.config.schema import RLConfig
from reroll.pipelines.judge import build_here
from reroll.rewards import build_runner
from reroll.rewards.base import RewardSample

pytestmark = pytest.mark.vllm

SAMPLES = [RewardSample(f"What is {i} + 3?", f"It is {i + k}.", answer=str(i + 3))
           for i in range(3) for k in (3, 4)]


def judge_config(model: str, engine: dict):
    """A judge whose replies are digits (tests/conftest.py), the first one its verdict."""
    return RLConfig.model_validate({
        "steps": 1, "model": {"path": "m"}, "data": {"train": "t.jsonl"},
        "reward": {"type": "judge", "model": model, "engine": engine, "verdict": "score",
                   "score_pattern": r"(\d)", "score_min": 0, "score_max": 9,
                   "max_new_tokens": 8, "retries": 0}}).reward


def engine_cores() -> int:
    """Live vLLM engine-core processes started by this one."""
    return sum(p.name().startswith("VLLM::EngineCor") and p.status() != psutil.STATUS_ZOMBIE
               for p in psutil.Process().children(recursive=True))


def judge_replies(config) -> tuple[list[str], int]:
    """The judge's greedy reply to each sample's judge prompt, and the live vLLM engine cores
    while the judge was up."""
    fn = build_here(config)
    workers = engine_cores()
    try:
        replies = asyncio.run(_all(fn, [fn.judge_prompt(s) for s in SAMPLES]))
    finally:
        fn.close()
    return replies, workers


async def _all(fn, prompts: list[str]) -> list[str]:
    return list(await asyncio.gather(*(fn.generate(p, 0) for p in prompts)))


def test_a_vllm_judge_runs_in_its_own_process_and_replies_as_the_hf_judge(digit_judge):
    before = engine_cores()
    on_vllm, workers = judge_replies(judge_config(digit_judge, {"type": "vllm",
                                                               "max_num_seqs": 8}))
    on_hf, _ = judge_replies(judge_config(digit_judge, {"type": "hf"}))
    assert workers == before + 1  # vLLM's engine core: the judge model decodes in its own process
    assert on_vllm == on_hf  # greedy, fp32 on both
    assert len(set(on_hf)) > 1  # and not one reply for every prompt
    assert engine_cores() == before  # closed with the reward


def test_a_vllm_judge_scores_through_the_reward_runner(digit_judge):
    """The path a run takes: the runner's time limit and counters around the vLLM judge."""
    config = judge_config(digit_judge, {"type": "vllm", "max_num_seqs": 8})
    fn = build_here(config)
    runner = build_runner(config, fn)

    async def run():
        return await asyncio.gather(*(runner.reward(s) for s in SAMPLES + SAMPLES[:2]))

    try:
        results = asyncio.run(run())
    finally:
        runner.close()
    counters = fn.queue_metrics()
    assert counters["reward/judge_requests"] == len(SAMPLES)  # the two repeats were cached
    assert counters["reward/judge_cache_hits"] == 2.0
    assert runner.counters.errors == 0
    assert all(0.0 <= r.score <= 1.0 and r.info["judge"][0].isdigit() for r in results)
