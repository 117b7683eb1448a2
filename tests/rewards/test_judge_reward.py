"""`reward: {type: judge}`: verdict parsers, retries, the cache of identical requests, counted
parse failures, and a judge served by a real engine over the tiny model."""

import asyncio

import pytest

from reroll.config.schema import RLConfig
from reroll.pipelines.judge import build_here
from reroll.rewards import build_runner
from reroll.rewards.base import RewardSample
from reroll.rewards.judge import (
    JudgeRewardFn,
    VerdictError,
    parse_choice,
    parse_score,
    verdict_agreement,
)

pytestmark = pytest.mark.unit

SAMPLE = RewardSample("What is 2 + 3?", "It is 5.", answer="5")


def reward_config(**judge) -> RLConfig:
    return RLConfig.model_validate({"steps": 1, "model": {"path": "m"},
                                    "data": {"train": "t.jsonl"},
                                    "reward": {"type": "judge", **judge}})


def test_parse_score_maps_the_scale_to_unit_interval():
    assert parse_score("Reasoning... Score: 7", 0, 10) == pytest.approx(0.7)
    assert parse_score("8/10 overall, I'd say 8", 1, 10, pattern=r"(\d+)/10") == \
        pytest.approx(7 / 9)
    with pytest.raises(VerdictError, match="no score"):
        parse_score("no idea", 0, 10)
    with pytest.raises(VerdictError, match="outside"):
        parse_score("Score: 11", 0, 10)


def test_parse_choice_takes_the_first_named_choice_as_a_whole_word():
    choices = {"yes": 1.0, "no": 0.0}
    assert parse_choice("Yes, because 2 + 3 = 5. No doubt.", choices) == 1.0
    assert parse_choice("no", choices) == 0.0
    with pytest.raises(VerdictError):
        parse_choice("eyes nothing", choices)  # not whole words


def test_verdict_agreement_scores_the_first_verdict_against_the_rows_verdict():
    def agree(reply: str, verdict: str | None) -> float:
        return verdict_agreement(RewardSample("q", reply, answer=verdict))

    assert agree("yes", "yes") == 1.0 and agree("No.", "no") == 1.0
    assert agree("yes", "no") == 0.0 and agree("no, yes", "yes") == 0.0
    assert agree("maybe", "yes") == 0.0 and agree("maybe", "no") == 0.0  # no verdict: wrong
    with pytest.raises(ValueError, match="not a verdict"):
        agree("yes", "5")


class Scripted:
    """A judge that replies from a script, counting its calls (a stand-in for the engine's
    text generation; the real engine is used below)."""

    def __init__(self, *replies: str, delay: float = 0.0):
        self.replies, self.delay, self.calls = list(replies), delay, []

    async def __call__(self, prompt: str, attempt: int) -> str:
        self.calls.append((prompt, attempt))
        await asyncio.sleep(self.delay)
        return self.replies.pop(0)


def test_unparseable_replies_are_retried_and_counted():
    judge = Scripted("hmm", "Yes.")
    fn = JudgeRewardFn(judge, "{question}|{response}|{reference}",
                       lambda text: parse_choice(text, {"yes": 1.0, "no": 0.0}), retries=2)
    result = asyncio.run(fn(SAMPLE))
    assert result.score == 1.0 and result.info["judge"] == "Yes."
    assert [a for _, a in judge.calls] == [0, 1]
    assert judge.calls[0][0] == "What is 2 + 3?|It is 5.|5"
    assert fn.queue_metrics()["reward/judge_parse_failures"] == 1.0


def test_a_judge_that_never_gives_a_verdict_is_a_counted_reward_error():
    fn = JudgeRewardFn(Scripted("?", "??"), "{response}",
                       lambda text: parse_choice(text, {"yes": 1.0}), retries=1)
    runner = build_runner(reward_config(model="m").reward, fn)
    result = asyncio.run(runner.reward(SAMPLE))
    assert result.score == 0.0 and "VerdictError" in result.info["error"]
    metrics = runner.metrics()
    assert metrics["reward/errors"] == 1.0 and metrics["reward/judge_parse_failures"] == 2.0


def test_identical_requests_are_answered_once():
    judge = Scripted("yes", "no", delay=0.05)
    fn = JudgeRewardFn(judge, "{question} {response}",
                       lambda text: parse_choice(text, {"yes": 1.0, "no": 0.0}))
    other = RewardSample("What is 2 + 3?", "It is 6.")

    async def run():
        # two identical calls at once share one generation; a later identical call hits the cache
        first = await asyncio.gather(fn(SAMPLE), fn(SAMPLE), fn(other))
        return [*first, await fn(SAMPLE)]

    results = asyncio.run(run())
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 1.0]
    assert len(judge.calls) == 2
    assert fn.queue_metrics()["reward/judge_cache_hits"] == 2.0


def test_the_template_is_checked():
    with pytest.raises(ValueError, match="template"):
        reward_config(model="m", template="{question} {answer}")
    with pytest.raises(ValueError, match="template"):
        reward_config(model="m", template="{question} only")
    with pytest.raises(ValueError, match="quote the choice words"):
        reward_config(model="m", choices={True: 1.0, False: 0.0})  # YAML's `{yes: 1, no: 0}`


def test_a_judge_on_the_hf_engine_of_the_tiny_model(tiny_model):
    """The real path: the judge prompt through the judge's chat template and an HF engine. The
    random tiny model says no verdict word, so with a choice of every token it says something."""
    config = reward_config(model=tiny_model, verdict="score", max_new_tokens=8, retries=1,
                           score_pattern=r"(\d)", score_min=0, score_max=9).reward
    fn = build_here(config)
    runner = build_runner(config, fn)

    async def run():
        return await asyncio.gather(*(runner.reward(SAMPLE) for _ in range(3)))

    try:
        results = asyncio.run(run())
    finally:
        runner.close()
    counters = fn.queue_metrics()
    # the three identical calls made one judge generation (and its retry when unparseable)
    assert counters["reward/judge_requests"] in (1.0, 2.0)
    assert counters["reward/judge_cache_hits"] == 2.0
    assert len({r.score for r in results}) == 1
    for r in results:
        assert ("judge" in r.info) or ("VerdictError" in r.info["error"])


def test_reroll_eval_scores_a_judge_on_verdict_rows(tmp_path, tiny_model):
    """`reroll eval --reward custom --reward-function reroll.rewards.judge:verdict_agreement` on
    the rows of `make-data --judge-labels-from` (docs/preferences.md): each sample is scored
    against its row's verdict."""
    import json

    from reroll.cli import main
    from reroll.config.rewards import JUDGE_TEMPLATE
    from reroll.data.preferences import judge_label_rows

    samples = [{"prompt": f"What is {i} + 1?", "response": f"\\boxed{{{i + k}}}",
                "answer": str(i + 1), "reward": float(k == 1)} for i in range(3) for k in (1, 2)]
    rows = tmp_path / "labels.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in judge_label_rows(samples,
                                                                             JUDGE_TEMPLATE)))
    out = tmp_path / "agreement.json"
    assert main(["eval", "--model", tiny_model, "--task", str(rows), "--ignore-run-config",
                 "--reward", "custom", "--reward-function",
                 "reroll.rewards.judge:verdict_agreement", "--max-new-tokens", "4",
                 "--threads", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["reward_errors"] == 0.0
    scored = [json.loads(line) for line in out.with_suffix(".samples.jsonl").read_text()
              .splitlines()]
    assert sorted(s["answer"] for s in scored) == ["no"] * 3 + ["yes"] * 3
    for s in scored:
        assert s["reward"] == verdict_agreement(RewardSample(s["prompt"], s["response"],
                                                             answer=s["answer"]))


def test_a_checkpoint_keeps_the_judges_own_counts():
    """A resumed run continues `reward/judge_*` as it continues `reward/errors`: the runner's
    counter state holds the judge's counts (before, a resumed judge run restarted them at 0)."""
    def judged(*replies):
        fn = JudgeRewardFn(Scripted(*replies), "{response}",
                           lambda text: parse_choice(text, {"yes": 1.0, "no": 0.0}), retries=1)
        return build_runner(reward_config(model="m").reward, fn)

    first = judged("?", "yes")
    asyncio.run(first.reward(SAMPLE))
    state = first.counter_state()
    assert state["reward_fn"] == {"requests": 2, "cache_hits": 0, "parse_failures": 1}
    resumed = judged()
    resumed.load_counters(state)
    assert resumed.metrics() == first.metrics()
    assert resumed.counters.calls == 1 and resumed.metrics()["reward/judge_requests"] == 2.0
