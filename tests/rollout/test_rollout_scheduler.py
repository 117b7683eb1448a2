"""The rollout scheduler's sample lifecycle, cap, affinity, dynamic sampling, over-sampling and
partial rollout, on a scripted engine (deterministic) with the real tokenizer and reward runner."""

import asyncio

from scripted_engine import ScriptedEngine, runner

from reroll.config.algorithm import DynamicSamplingConfig
from reroll.data.datasets import PromptRow
from reroll.engines.base import SamplingParams
from reroll.rollout.groups import State
from reroll.rollout.scheduler import RolloutScheduler, signal_keep

TOKEN = 40
PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)


def rows(kinds: str) -> list[PromptRow]:
    """One row per letter: f = flat (all rewards equal), s = signal, L = long and with signal."""
    return [PromptRow([{"role": "user", "content": f"q{i}"}], "0",
                      {"flat": k == "f", "long": k == "L", "i": i}, source=f"t:{i}")
            for i, k in enumerate(kinds)]


def encode_for(table: list[PromptRow]):
    """Prompt ids [1000 + row number] so the scripted engine can tell rows apart."""
    return lambda row: [1000 + row.metadata["i"]]


def length_by_row(table: list[PromptRow], long: int = 400):
    def length(prompt, seed):
        row = table[prompt[0] - 1000]
        return long if row.metadata["long"] else 3 + seed % 4

    return length


def collect(scheduler, table, num_groups, keep=None, **kw):
    keep = keep or (lambda group: True)
    return asyncio.run(scheduler.collect(iter(table), encode_for(table), num_groups, 4, PARAMS,
                                         lambda i: i, keep=keep, **kw))


def test_every_sample_goes_queued_running_finished_rewarded_kept(tokenizer):
    table = rows("sss")
    engine = ScriptedEngine(length_by_row(table), TOKEN)
    scheduler = RolloutScheduler([engine], runner(), tokenizer)
    result = collect(scheduler, table, 3)
    assert [g.row.metadata["i"] for g in result.groups] == [0, 1, 2]
    for group in result.groups:
        for sample in group.samples:
            assert sample.history == [State.QUEUED, State.RUNNING, State.FINISHED,
                                      State.REWARDED, State.KEPT]
            assert sample.reward == float(len(sample.tokens))  # scored: "F" per token
    assert scheduler.lifecycle["kept"] == 12 and scheduler.lifecycle["rewarded"] == 12


def test_running_cap_per_engine_and_group_affinity(tokenizer):
    table = rows("ssssss")
    engines = [ScriptedEngine(length_by_row(table), TOKEN) for _ in range(2)]
    scheduler = RolloutScheduler(engines, runner(), tokenizer, max_running_per_engine=3)
    result = collect(scheduler, table, 6)
    assert all(e.max_running <= 3 for e in engines)
    assert all(len(e.requests) == 12 for e in engines)  # groups spread over both engines
    for engine in engines:  # affinity: a group's 4 requests all went to one engine
        prompts = [r.prompt_ids[0] for r in engine.requests]
        assert all(prompts.count(p) == 4 for p in set(prompts))
    assert len(result.groups) == 6


def test_dynamic_sampling_replaces_dropped_groups_until_the_batch_is_full(tokenizer):
    table = rows("fsffsfssss")
    keep = signal_keep(DynamicSamplingConfig(), 4)
    outcomes = []
    for _ in range(2):  # the kept groups do not depend on timing: same result twice
        scheduler = RolloutScheduler([ScriptedEngine(length_by_row(table), TOKEN)], runner(),
                                     tokenizer)
        result = collect(scheduler, table, 3, keep=keep, max_groups=10)
        outcomes.append(([g.row.metadata["i"] for g in result.groups],
                         [[s.tokens for s in g.samples] for g in result.groups]))
        assert [g.row.metadata["i"] for g in result.dropped] == [0, 2, 3, 5]
        assert result.metrics["rollout/groups_filtered"] >= 4
        assert all(s.state is State.FILTERED for g in result.dropped for s in g.samples)
        # launched rows after the last kept group go back to the stream, in order
        assert [r.metadata["i"] for r in result.unused_rows] == list(
            range(7, 7 + len(result.unused_rows)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [1, 4, 6]


def test_a_short_batch_when_the_group_budget_runs_out(tokenizer):
    table = rows("ffsfff")
    scheduler = RolloutScheduler([ScriptedEngine(length_by_row(table), TOKEN)], runner(),
                                 tokenizer)
    result = collect(scheduler, table, 2, keep=signal_keep(DynamicSamplingConfig(), 4),
                     max_groups=4)
    assert [g.row.metadata["i"] for g in result.groups] == [2]
    assert result.metrics["rollout/groups_launched"] == 4 and result.unused_rows == []


def test_oversampling_aborts_the_groups_left_once_the_batch_is_full(tokenizer):
    table = rows("ssL")  # the long group is launched last and is not needed
    engine = ScriptedEngine(length_by_row(table, long=10_000), TOKEN)
    scheduler = RolloutScheduler([engine], runner(), tokenizer)
    result = collect(scheduler, table, 2, oversample=1.5)
    assert [g.row.metadata["i"] for g in result.groups] == [0, 1]
    assert result.metrics["rollout/groups_aborted"] == 1
    assert [r.metadata["i"] for r in result.unused_rows] == [2]
    aborted = [r for r in engine.requests if r.prompt_ids[0] == 1002]
    assert len(aborted) == 4 and all(r.request_id in engine.aborted for r in aborted)
    assert scheduler.lifecycle["aborted"] == 4


def test_speculative_responses_keep_the_first_to_stop_and_abort_the_rest(tokenizer):
    """Groups of 4 start 5 samples (seeds 5g..5g+4). Group 0 has one straggler: it keeps the 4
    that stop and aborts the straggler. Group 1 has two: 4 can never stop, so it keeps all 5,
    its two stragglers cut at max_new_tokens, and fails `keep`."""
    stragglers = {1, 6, 8}
    table = rows("ss")
    outcomes = []
    for _ in range(2):  # which samples are kept does not depend on timing
        engine = ScriptedEngine(lambda prompt, seed: 10_000 if seed in stragglers else 3 + seed % 4,
                                TOKEN, tick=0.0005)
        scheduler = RolloutScheduler([engine], runner(), tokenizer)
        result = collect(scheduler, table, 2, keep=lambda g: all(
            s.finish_reason == "stop" for s in g.samples), spare=1, max_groups=2)
        assert [g.row.metadata["i"] for g in result.groups] == [0]
        kept = result.groups[0]
        assert [s.seed for s in kept.samples] == [0, 2, 3, 4]
        assert all(s.finish_reason == "stop" and s.state is State.KEPT for s in kept.samples)
        straggler = next(r for r in engine.requests if r.seed == 1)
        assert straggler.request_id in engine.aborted
        [failed] = result.dropped
        assert [s.seed for s in failed.samples] == [5, 6, 7, 8, 9]
        assert [len(s.tokens) for s in failed.samples if s.seed in stragglers] == [64, 64]
        assert scheduler.lifecycle["kept"] == 4 and scheduler.lifecycle["aborted"] == 1
        assert scheduler.lifecycle["filtered"] == 5
        outcomes.append([[s.tokens for s in g.samples] for g in result.groups])
    assert outcomes[0] == outcomes[1]


def test_partial_rollout_keeps_tokens_across_a_weight_update(tokenizer):
    """Requests preempted by a weight update resume as prompt + partial tokens; the finished
    response has exactly the length it would have had, with tokens from both versions."""
    table = rows("ss")
    engine = ScriptedEngine(lambda prompt, seed: 30, TOKEN, tick=0.001)
    scheduler = RolloutScheduler([engine], runner(), tokenizer)

    async def scenario():
        groups = [scheduler.new_group(i, row, [1000 + i], 4, lambda k: k)
                  for i, row in enumerate(table)]
        tasks = [asyncio.ensure_future(scheduler.run_group(g, PARAMS)) for g in groups]
        while min((len(r.prompt_ids) for r in engine.requests), default=0) == 0 or \
                engine.running < 8:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        preempted = await scheduler.preempt()
        assert engine.running == 0
        engine.load_weights([], 1)
        scheduler.release()
        await asyncio.gather(*tasks)
        return groups, preempted

    groups, preempted = asyncio.run(scenario())
    assert preempted == 8
    for group in groups:
        for sample in group.samples:
            assert len(sample.tokens) == 30 and len(sample.logprobs) == 30
            assert sample.finish_reason == "stop" and sample.resumes == 1
            assert sample.token_versions[0] == 0 and sample.token_versions[-1] == 1
            assert sample.logprobs[0] == -0.5 and sample.logprobs[-1] == -1.5
            assert sample.history[-1] is State.REWARDED
        assert group.version == 0  # staleness is counted from the oldest token
    resumed = [r for r in engine.requests if len(r.prompt_ids) > 1]
    assert len(resumed) == 8
    assert all(r.params.max_new_tokens == PARAMS.max_new_tokens - (len(r.prompt_ids) - 1)
               for r in resumed)
