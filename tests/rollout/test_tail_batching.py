"""Tail batching: regular rounds hold only responses within the length budget; prompts that run
long are deferred and run together in a long round with the full length."""

import time
from collections import Counter

import pytest
from resume_check import stop_and_resume
from scripted_engine import ScriptedEngine, runner

from reroll.config.errors import ConfigError
from reroll.config.schema import RLConfig
from reroll.data.datasets import PromptRow, PromptSampler
from reroll.engines.base import SamplingParams
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.scheduler import SyncSource
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import EncodedPrompt, PromptStream, encode_prompt

TOKEN = 40


def test_long_prompts_are_deferred_to_long_rounds(tokenizer):
    table = [PromptRow([{"role": "user", "content": f"question {i}"}], "0", {"long": i % 4 == 0},
                       f"t:{i}") for i in range(24)]
    lengths = {}

    def length(prompt, seed):  # prompts are told apart by their encoded ids
        return lengths[tuple(prompt)]

    config = RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 100},
                      train={"micro_batch_size": 2}, scheduler={"oversample": 1.5},
                      tail_batching={"enabled": True, "length_budget": 20})
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, ScriptedEngine(length, TOKEN), runner(), tokenizer,
                        PromptStream(PromptSampler(table, seed=0)))
    for row in table:
        lengths[tuple(source.encode(row))] = 90 if row.metadata["long"] else 5 + int(
            row.source[2:]) % 7
    params = SamplingParams(max_new_tokens=100)
    long_rounds = 0
    for step in range(1, 17):
        trajectories = source.next_batch(step, step - 1, params)
        assert len(trajectories) == 6
        texts = {t.prompt_text for t in trajectories}
        is_long = {row.metadata["long"] for row in table if row.prompt_text in texts}
        if source.metrics()["tail/long_round"]:
            long_rounds += 1
            assert is_long == {True}
            assert all(len(t.response_ids) == 90 for t in trajectories)
        else:
            assert is_long == {False}  # regular rounds are short and balanced
            assert all(len(t.response_ids) < 20 for t in trajectories)
    assert long_rounds >= 2
    # after the first epoch the known-long prompts are deferred before they start
    assert source.tail.longest and all(
        v >= 20 for k, v in source.tail.longest.items() if int(k[2:]) % 4 == 0)


def test_batches_stay_full_when_most_prompts_run_long(tokenizer):
    """Deferred groups are not filtered groups: with 3 prompts in 4 running long and no room for
    refills under `max_groups_factor`, every regular round still comes back full, and tail
    batching delivers as many samples as plain rounds."""
    table = [PromptRow([{"role": "user", "content": f"question {i}"}], "0", {"long": i % 4 != 0},
                       f"t:{i}") for i in range(32)]
    lengths = {}
    config = RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 60},
                      train={"micro_batch_size": 2},
                      scheduler={"max_groups_factor": 1.0},
                      tail_batching={"enabled": True, "length_budget": 10})
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, ScriptedEngine(lambda prompt, seed: lengths[tuple(prompt)], TOKEN),
                        runner(), tokenizer, PromptStream(PromptSampler(table, seed=0)))
    for row in table:
        lengths[tuple(source.encode(row))] = 50 if row.metadata["long"] else 4
    rounds = {0.0: 0, 1.0: 0}
    for step in range(1, 25):
        trajectories = source.next_batch(step, step - 1, SamplingParams(max_new_tokens=60))
        assert len(trajectories) == 4
        rounds[source.metrics()["tail/long_round"]] += 1
    assert rounds[0.0] and rounds[1.0]


def test_a_dataset_of_only_long_prompts_is_a_config_error(tokenizer):
    table = [PromptRow([{"role": "user", "content": f"q {i}"}], "0", {}, f"t:{i}")
             for i in range(4)]
    config = RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 8, "group_size": 2, "max_new_tokens": 60},
                      train={"micro_batch_size": 2}, scheduler={"max_groups_factor": 1.0},
                      tail_batching={"enabled": True, "length_budget": 10})
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, ScriptedEngine(lambda prompt, seed: 50, TOKEN), runner(),
                        tokenizer, PromptStream(PromptSampler(table, seed=0)))
    with pytest.raises(ConfigError, match="length_budget"):
        for step in range(1, 6):
            source.next_batch(step, step - 1, SamplingParams(max_new_tokens=60))


@pytest.mark.parametrize("response_oversample", [1.0, 1.5])
def test_speculative_responses_defer_only_prompts_that_really_run_long(tokenizer,
                                                                      response_oversample):
    """Rows "long": every response runs long; rows "flaky": one response in three does. With
    3 responses started per group of 2 (RollPacker's speculative execution), a flaky prompt
    keeps its 2 short responses in the regular round instead of being deferred: long rounds
    then hold only the long prompts. Without it, the flaky prompts are deferred too."""
    table = [PromptRow([{"role": "user", "content": f"question {i}"}], "0",
                       {"kind": ("long", "flaky", "short", "short")[i % 4]}, f"t:{i}")
             for i in range(24)]
    kinds, calls = {}, Counter()

    def length(prompt, seed):  # a flaky prompt's every third request runs long
        key = tuple(prompt)
        calls[key] += 1
        flaky_long = kinds[key] == "flaky" and calls[key] % 3 == 1
        return 90 if kinds[key] == "long" or flaky_long else 8

    config = RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 100},
                      train={"micro_batch_size": 2},
                      tail_batching={"enabled": True, "length_budget": 20, "use_history": False,
                                     "response_oversample": response_oversample})
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, ScriptedEngine(length, TOKEN), runner(), tokenizer,
                        PromptStream(PromptSampler(table, seed=0)))
    kinds.update({tuple(source.encode(row)): row.metadata["kind"] for row in table})
    long_round_kinds, regular_kinds = set(), set()
    for step in range(1, 25):
        trajectories = source.next_batch(step, step - 1, SamplingParams(max_new_tokens=100))
        assert len(trajectories) == 4
        if source.metrics()["tail/long_round"]:
            long_round_kinds |= {kinds[tuple(t.prompt_ids)] for t in trajectories}
        else:
            assert all(len(t.response_ids) == 8 for t in trajectories)
            regular_kinds |= {kinds[tuple(t.prompt_ids)] for t in trajectories}
    assert "long" in long_round_kinds and "long" not in regular_kinds
    speculative = response_oversample > 1.0
    assert ("flaky" in long_round_kinds) != speculative
    assert "flaky" in regular_kinds or not speculative


def async_source(tokenizer, table, long_rows: set[str]) -> AsyncSource:
    config = RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 60},
                      train={"micro_batch_size": 2},
                      async_training={"enabled": True, "max_staleness": 4},
                      tail_batching={"enabled": True, "length_budget": 20})
    encoded = {}

    def length(prompt, seed):
        return 40 if encoded[tuple(prompt)] in long_rows else 5 + seed % 7

    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = AsyncSource(settings, ScriptedEngine(length, TOKEN), runner(),
                         tokenizer, PromptStream(PromptSampler(table, seed=0)))
    encoded.update({tuple(EncodedPrompt.of(encode_prompt(tokenizer, row, 256)).ids): row.source
                    for row in table})
    return source


def play(source: AsyncSource, steps) -> list[list[str]]:
    """Each step's trained prompts (one per group); every response is whole: the long prompts'
    ran to 40 tokens in a long launch, the others' within the budget."""
    trained = []
    for step in steps:
        trajectories = source.next_batch(step, step - 1, SamplingParams(max_new_tokens=60))
        assert len(trajectories) == 6
        for t in trajectories:
            assert len(t.response_ids) == 40 or len(t.response_ids) < 20
        trained.append([t.prompt_text for t in trajectories[::2]])
        time.sleep(0.05)  # the trainer's update: long against a decoding step, as on a real run
        source.engine.load_weights([], step)
    return trained


def test_async_tail_batching_sets_long_prompts_aside_and_runs_them_together(tokenizer):
    """Async with tail batching: a group that reaches the budget is set aside, not trained cut;
    once 3 prompts wait they run again with the full length and are trained whole. Each prompt
    of the first epoch is trained once, long ones included; a checkpoint owes the prompts set
    aside, and the resumed run trains them."""
    table = [PromptRow([{"role": "user", "content": f"question {i}"}], "0", {}, f"t:{i}")
             for i in range(24)]
    long_rows = {f"t:{i}" for i in range(0, 24, 4)}
    is_long = {row.prompt_text: row.source in long_rows for row in table}
    source = async_source(tokenizer, table, long_rows)
    try:
        trained = sum(play(source, range(1, 7)), [])
        metrics = source.metrics()
    finally:
        source.close()
    assert len(trained) == len(set(trained)) == 18  # no prompt twice, none lost to the budget
    assert sum(is_long[p] for p in trained) >= 3 and metrics["tail/long_groups"] >= 3
    assert metrics["tail/deferred_total"] >= 3

    def make():
        s = async_source(tokenizer, table, long_rows)
        return s, s.close

    r = stop_and_resume(make, play, steps=8, stop=3)
    sampler = r.state["sampler"]
    assert sampler["epoch"] == 0 and not sampler["carry"]
    stream = PromptStream(PromptSampler(table, seed=0))
    drawn = {next(stream).prompt_text for _ in range(sampler["index"])}
    untrained = drawn - set(sum(r.before, []))
    assert any(is_long[p] for p in untrained)  # set aside, or running long, at the checkpoint
    assert untrained <= set(sum(r.after, []))  # the resumed run trains them: none lost


def test_async_takes_tail_batching_but_not_speculative_responses():
    base = {"model": {"path": "m"}, "data": {"train": "t"}, "steps": 1,
            "rollout": {"max_new_tokens": 100}, "async_training": {"enabled": True}}
    RLConfig(**base, tail_batching={"enabled": True, "length_budget": 20})
    with pytest.raises(ValueError, match="response_oversample .* not available with async"):
        RLConfig(**base, tail_batching={"enabled": True, "length_budget": 20,
                                        "response_oversample": 1.5})
