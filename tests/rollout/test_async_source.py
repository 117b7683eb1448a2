"""Asynchronous training's buffer and source: the staleness bound holds, stale groups are never
handed to the trainer, the producer keeps generating while the trainer is away."""

import threading
import time

import pytest
import torch
from scripted_engine import ScriptedEngine, runner

from reroll.config.schema import RLConfig
from reroll.data.datasets import PromptRow, PromptSampler
from reroll.engines.base import SamplingParams, WeightSyncError, fingerprint
from reroll.pipelines.rlvr import build_source
from reroll.rollout.async_source import AsyncSource, BufferedGroup, StaleBatchError, VersionedBuffer
from reroll.rollout.groups import Group
from reroll.rollout.stream import PromptStream, encode_prompt

TOKEN = 40
PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)


def group(version: int) -> BufferedGroup:
    return BufferedGroup(Group(0, PromptRow([{"role": "user", "content": "q"}], "0"), [1], 0, []),
                         version)


def test_buffer_hands_out_only_groups_within_the_staleness_bound():
    buffer = VersionedBuffer(max_staleness=1, capacity_groups=8)
    for version in (0, 1, 2, 2):
        buffer.put(group(version))
    taken = buffer.take(2, version=3)
    assert [g.version for g in taken] == [2, 2]
    assert buffer.dropped_stale_groups == 2 and len(buffer) == 0
    buffer.put(group(1))
    with pytest.raises(TimeoutError):
        buffer.take(1, version=3, timeout_s=0.05)  # version 1 is 2 behind: dropped, never taken
    assert buffer.dropped_stale_groups == 3
    buffer.close(RuntimeError("producer died"))
    with pytest.raises(StaleBatchError):
        buffer.take(1, version=3)


def config(**async_training) -> RLConfig:
    return RLConfig(model={"path": "unused"}, data={"train": "unused"}, steps=4,
                    rollout={"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 64},
                    train={"micro_batch_size": 2},
                    async_training={"enabled": True, **async_training})


def stream(n: int = 50) -> PromptStream:
    table = [PromptRow([{"role": "user", "content": f"question {i}"}], "0", {}, f"t:{i}")
             for i in range(n)]
    return PromptStream(PromptSampler(table, seed=0))


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_source_respects_max_staleness_through_weight_updates(tokenizer, max_staleness):
    engine = ScriptedEngine(lambda prompt, seed: 10 + seed % 20, TOKEN, tick=0.0005)
    source = build_source(config(max_staleness=max_staleness), engine, runner(), tokenizer,
                          stream())
    assert isinstance(source, AsyncSource)
    try:
        staleness, kept = [], 0.0
        for step in range(1, 7):
            trajectories = source.next_batch(step, step - 1, PARAMS)
            assert len(trajectories) == 6
            for t in trajectories:  # the trainer at version step-1 never sees older samples
                assert step - 1 - t.policy_version <= max_staleness
                assert len(t.response_ids) == len(t.behaviour_logprobs) > 0
            metrics = source.metrics()
            assert metrics["staleness/max"] <= max_staleness
            staleness.append(metrics["staleness/max"])
            kept += metrics["rollout/samples_kept"]
            source.engine.load_weights([], step)  # the trainer's update, then the sync
            assert source.engine.weights_fingerprint() == f"v{step}"
        # Counts are per step and the producer runs ahead, so one step may keep fewer than it
        # consumes; every consumed sample was kept by the time it was taken.
        assert kept >= 6 * 6
        if max_staleness == 0:
            assert staleness == [0.0] * 6
    finally:
        source.close()


def test_partial_rollout_resumes_requests_cut_by_the_weight_update(tokenizer):
    engine = ScriptedEngine(lambda prompt, seed: 60, TOKEN, tick=0.002)
    source = build_source(config(max_staleness=2), engine, runner(), tokenizer, stream())
    try:
        resumed = 0.0
        for step in range(1, 7):
            trajectories = source.next_batch(step, step - 1, PARAMS)
            assert all(len(t.response_ids) == 60 for t in trajectories)  # no token lost
            resumed += source.metrics()["rollout/resumed_samples"]
            time.sleep(0.05)  # the trainer's update: the producer is mid-generation meanwhile
            source.engine.load_weights([], step)
        # the producer was mid-generation at some update: those samples mix two versions
        assert resumed > 0
        assert source.metrics()["staleness/off_policy_token_frac"] >= 0.0
    finally:
        source.close()


class HeldLoads(ScriptedEngine):
    """An engine that loads between decoding steps, whose loads wait for `release`, and whose
    fingerprint is that of what it loaded (or garbage, with `corrupt`)."""

    in_flight_updates = True

    def __init__(self, corrupt: bool = False):
        super().__init__(lambda prompt, seed: 10, TOKEN, tick=0.0005)
        self.release, self.corrupt = threading.Event(), corrupt

    def load_weights(self, named_tensors, version: int) -> None:
        assert self.release.wait(timeout=30)
        super().load_weights(named_tensors, version)
        self.loaded = fingerprint(named_tensors) if not self.corrupt else "garbage"

    def weights_fingerprint(self) -> str:
        return getattr(self, "loaded", "initial")


def test_in_flight_weights_are_handed_over_without_waiting_for_the_load(tokenizer):
    engine = HeldLoads()
    source = build_source(config(max_staleness=2, in_flight_updates=True), engine, runner(),
                          tokenizer, stream())
    weights = [("w", torch.ones(3))]
    try:
        source.next_batch(1, 0, PARAMS)
        source.engine.publish_weights(weights, 1)
        assert engine.loads == 0 and source.engine.version == 0  # returned while it waits
        engine.release.set()
        source.engine.wait_for_load()
        assert engine.loads == 1 and source.engine.version == 1
        assert source.engine.weights_fingerprint() == fingerprint(weights)
    finally:
        source.close()


def test_a_mismatched_in_flight_load_stops_the_run(tokenizer):
    engine = HeldLoads(corrupt=True)
    engine.release.set()
    source = build_source(config(max_staleness=2, in_flight_updates=True), engine, runner(),
                          tokenizer, stream())
    try:
        source.next_batch(1, 0, PARAMS)
        source.engine.publish_weights([("w", torch.ones(3))], 1)
        with pytest.raises(StaleBatchError, match="fingerprint"):
            for step in range(2, 10):  # the trainer's next batch raises it
                source.next_batch(step, step - 1, PARAMS)
        with pytest.raises(WeightSyncError):
            source.engine.wait_for_load()
    finally:
        source._stop_producer()


@pytest.mark.parametrize("max_ahead, starts_ahead", [(0, False), (None, True)])
def test_max_ahead_bounds_how_far_the_producer_runs_ahead(tokenizer, max_ahead, starts_ahead):
    """With max_ahead 0 the producer starts nothing for the next batch until the engine has the
    trainer's weights; by default (max_staleness 4) it works up to four batches ahead."""
    engine = ScriptedEngine(lambda prompt, seed: 10, TOKEN, tick=0.0005)
    source = build_source(config(max_staleness=4, max_ahead=max_ahead), engine, runner(),
                          tokenizer, stream())
    try:
        source.next_batch(1, 0, PARAMS)
        time.sleep(0.2)  # the producer's chance to start the next batches
        assert (len(source.buffer) + source.in_flight > 0) == starts_ahead
        source.engine.load_weights([], 1)
        assert len(source.next_batch(2, 1, PARAMS)) == 6
    finally:
        source.close()


def test_max_ahead_beyond_max_staleness_is_a_config_error():
    with pytest.raises(ValueError, match="async_training.max_ahead"):
        config(max_staleness=1, max_ahead=2)


def in_order_group(index: int, version: int = 0) -> BufferedGroup:
    row = PromptRow([{"role": "user", "content": f"q{index}"}], "0")
    return BufferedGroup(Group(index, row, [1], 0, []), version)


def test_an_in_order_buffer_hands_out_groups_in_start_order():
    buffer = VersionedBuffer(max_staleness=1, capacity_groups=8, in_order=True)
    for index in (2, 1, 4):  # 0 still running, 3 will be filtered
        buffer.put(in_order_group(index))
    assert len(buffer) == 3
    with pytest.raises(TimeoutError):
        buffer.take(1, version=0, timeout_s=0.05)  # nothing before group 0 finishes
    buffer.put(in_order_group(0))
    assert [g.group.index for g in buffer.take(2, version=0)] == [0, 1]
    with pytest.raises(TimeoutError):
        buffer.take(2, version=0, timeout_s=0.05)  # 2, then 3 unknown: 4 waits behind it
    buffer.skip(3)
    assert [g.group.index for g in buffer.take(2, version=0)] == [2, 4]
    buffer.put(in_order_group(5, version=0))
    buffer.put(in_order_group(6, version=2))
    assert [g.group.index for g in buffer.take(1, version=2)] == [6]  # 5 too stale: dropped
    assert buffer.dropped_stale_groups == 1 and len(buffer) == 0


@pytest.mark.parametrize("order", ["finish", "start"])
def test_order_start_trains_each_step_on_the_prompts_sync_would(tokenizer, order):
    """The first prompt's responses run 12x longer than the others'. Taken as they finish, the
    first batch leaves it out (later groups finish first); taken in start order, the first
    batch is the stream's first three prompts, the long one included, as in sync."""
    cfg = config(max_staleness=2, order=order)
    first, expected = next(stream()), [r.prompt_text for r in stream().next_batch(3)]
    long_ids = encode_prompt(tokenizer, first, cfg.data.max_prompt_tokens)
    engine = ScriptedEngine(lambda prompt, seed: 60 if prompt == long_ids else 5, TOKEN,
                            tick=0.002)
    source = build_source(cfg, engine, runner(), tokenizer, stream())
    try:
        batch = source.next_batch(1, 0, PARAMS)
        prompts = list(dict.fromkeys(t.prompt_text for t in batch))  # one per group, in order
        if order == "start":
            assert prompts == expected and max(len(t.response_ids) for t in batch) == 60
        else:
            assert first.prompt_text not in prompts and len(prompts) == 3
    finally:
        source.close()


def test_order_is_checked():
    with pytest.raises(ValueError, match="order"):
        config(order="shortest")


def run_steps(source, steps: range) -> list[list[str]]:
    """The prompts of each step's batch (one per group, in the order taken), then the sync."""
    prompts = []
    for step in steps:
        batch = source.next_batch(step, step - 1, PARAMS)
        prompts.append(list(dict.fromkeys(t.prompt_text for t in batch)))
        time.sleep(0.02)  # the trainer's update: the producer goes on meanwhile
        source.engine.load_weights([], step)
    return prompts


@pytest.mark.parametrize("order", ["finish", "start"])
def test_a_resumed_source_trains_what_was_buffered_or_running_at_the_checkpoint(tokenizer, order):
    """Issue 46: a run killed after step 2's checkpoint, resumed from it. The groups the
    producer had launched ahead (buffered or running) are owed by the checkpoint: the resumed
    source launches them first, so no prompt is lost or trained twice; in start order each
    step trains the uninterrupted run's prompts. Response lengths vary with the prompt, so in
    finish order groups overtake each other."""
    cfg = config(max_staleness=3, max_ahead=1, order=order)
    engine = lambda: ScriptedEngine(lambda prompt, seed: 4 + 12 * (sum(prompt) % 3),  # noqa: E731
                                    TOKEN, tick=0.0005)
    whole = build_source(cfg, engine(), runner(), tokenizer, stream())
    try:
        uninterrupted = run_steps(whole, range(1, 6))
    finally:
        whole.close()
    killed = build_source(cfg, engine(), runner(), tokenizer, stream())
    try:
        before = run_steps(killed, range(1, 3))
        time.sleep(0.05)  # the producer's chance to run ahead of the trainer
        state = killed.state_dict()
    finally:
        killed.close()  # what it had buffered or running dies with it
    launched = [r.prompt_text for r in stream().next_batch(state["async"]["next_index"])]
    owed = [p for p in launched if p not in sum(before, [])]
    assert [killed.stream.row(r).prompt_text for _, r in state["async"]["owed"]] == owed
    assert owed  # the producer had run ahead: the bug lost these

    resumed = build_source(cfg, engine(), runner(), tokenizer, stream())
    resumed.load_state_dict(state)
    resumed.engine.load_weights([], 2)  # the checkpoint's weights (the pipeline's weight sync)
    try:
        after = run_steps(resumed, range(3, 6))
    finally:
        resumed.close()
    trained = sum(before + after, [])
    assert len(trained) == len(set(trained)) == 15  # none twice
    assert set(launched) <= set(trained)  # none lost
    if order == "start":
        assert before + after == uninterrupted
