"""The scheduler, sources and async training with the real HF engine and the tiny model."""

import asyncio
import shutil
import threading

import pytest
import torch

from reroll.config.schema import RLConfig
from reroll.data.datasets import PromptSampler, load_prompts
from reroll.engines.base import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_model
from reroll.pipelines.rlvr import rlvr_pipeline
from reroll.rewards import RewardRunner
from reroll.rewards.base import RewardResult
from reroll.rollout.scheduler import RolloutScheduler, SyncSource
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream, encode_prompt
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


class LengthReward:
    name = "length"

    async def __call__(self, sample):
        return RewardResult(float(len(sample.response)))


def test_partial_rollout_on_the_hf_engine_keeps_every_token(tiny_model, tokenizer, arithmetic):
    torch.set_num_threads(1)
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    scheduler = RolloutScheduler([engine], RewardRunner(LengthReward(), 5.0), tokenizer)
    rows = load_prompts(arithmetic["eval"])[:2]
    params = SamplingParams(max_new_tokens=160, temperature=1.0)  # no stop token: full length
    decoding, forwards = threading.Event(), []

    def count_forward(*_):  # set once the engine has decoded a few tokens of every response
        forwards.append(1)
        if len(forwards) == 5:
            decoding.set()

    # The engine runs the backbone and the LM head itself (not the model's own forward), once
    # per decoding step: count the head's calls.
    engine.model.get_output_embeddings().register_forward_hook(count_forward)

    async def scenario():
        groups = [scheduler.new_group(i, row, encode_prompt(tokenizer, row, 256), 4, lambda k: k)
                  for i, row in enumerate(rows)]
        tasks = [asyncio.ensure_future(scheduler.run_group(g, params)) for g in groups]
        await asyncio.to_thread(decoding.wait, 60)  # preempt mid-response, whatever the speed
        preempted = await scheduler.preempt()
        engine.load_weights(engine.model.state_dict().items(), 1)
        scheduler.release()
        await asyncio.gather(*tasks)
        return groups, preempted

    groups, preempted = asyncio.run(scenario())
    assert preempted == 8
    for group in groups:
        for sample in group.samples:
            assert len(sample.tokens) == len(sample.logprobs) == 160
            assert sample.finish_reason == "length" and sample.resumes == 1
            assert set(sample.token_versions) == {0, 1}
    # the reward scored the whole response, both pieces
    assert all(s.reward == float(len(s.response_text)) for g in groups for s in g.samples)


def test_in_flight_update_on_the_hf_engine_keeps_requests_running(tiny_model, tokenizer,
                                                                  arithmetic):
    """Weights loaded between two decoding steps: nothing is aborted or re-prefilled, and each
    token records the version whose logits it was sampled from."""
    torch.set_num_threads(1)
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    scheduler = RolloutScheduler([engine], RewardRunner(LengthReward(), 5.0), tokenizer)
    row = load_prompts(arithmetic["eval"])[0]
    params = SamplingParams(max_new_tokens=60, temperature=1.0)
    steps = []

    async def scenario():
        group = scheduler.new_group(0, row, encode_prompt(tokenizer, row, 256), 4, lambda k: k)
        task = asyncio.ensure_future(scheduler.run_group(group, params))
        while len(steps) < 10:  # let the engine decode a few tokens, then load on this loop
            steps.append(1)
            await asyncio.sleep(0)
        engine.load_weights(engine.model.state_dict().items(), 1)
        await task
        return group

    group = asyncio.run(scenario())
    for sample in group.samples:
        assert len(sample.tokens) == len(sample.token_versions) == 60 and sample.resumes == 0
        versions = sample.token_versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert group.version == 0


def test_speculative_responses_on_the_hf_engine(tiny_model, tokenizer, arithmetic):
    """6 responses started per group of 4 on the real engine: a kept group is the first 4 to
    stop, the spares are aborted in the engine (their requests end early, nothing hangs)."""
    torch.set_num_threads(1)
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    scheduler = RolloutScheduler([engine], RewardRunner(LengthReward(), 5.0), tokenizer)
    rows = load_prompts(arithmetic["eval"])[:6]
    # The untrained model samples nearly uniformly: stopping on a tenth of the vocabulary gives
    # responses of ~10 tokens, some of them cut at max_new_tokens.
    params = SamplingParams(max_new_tokens=40, temperature=1.0,
                            stop_token_ids=tuple(range(3, tokenizer.vocab_size, 10)))
    result = asyncio.run(scheduler.collect(
        iter(rows), lambda row: encode_prompt(tokenizer, row, 256), 3, 4, params, lambda i: i,
        keep=lambda g: all(s.finish_reason == "stop" for s in g.samples), max_groups=6, spare=2))
    assert result.groups
    for group in result.groups:
        assert len(group.samples) == 4
        assert all(s.finish_reason == "stop" and len(s.tokens) < 40 for s in group.samples)
    lifecycle = scheduler.lifecycle
    assert lifecycle["queued"] == 6 * int(result.metrics["rollout/groups_launched"])
    assert lifecycle["kept"] == 4 * len(result.groups) and lifecycle["aborted"] > 0
    assert not engine._aborted  # no abort mark outlives its request


def test_tail_batching_on_the_hf_engine(tiny_model, tokenizer, arithmetic):
    """Tail batching with speculative responses, through the sync source, on the real engine:
    regular rounds hold only responses that stopped within the budget, deferred prompts come
    back in long rounds with the full length, and every step gets a full batch."""
    torch.set_num_threads(1)
    config = RLConfig(model={"path": tiny_model}, data={"train": "unused"}, steps=1,
                      rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 40},
                      train={"micro_batch_size": 8},
                      tail_batching={"enabled": True, "length_budget": 12,
                                     "response_oversample": 1.5})
    engine = HFEngine(load_model(tiny_model), pad_token_id=tokenizer.pad_token_id)
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    source = SyncSource(settings, engine, RewardRunner(LengthReward(), 5.0), tokenizer,
                        PromptStream(PromptSampler(load_prompts(arithmetic["train"]), seed=0)))
    params = SamplingParams(max_new_tokens=40, temperature=1.0,  # responses of ~10 tokens
                            stop_token_ids=tuple(range(3, tokenizer.vocab_size, 10)))
    long_rounds = 0
    for step in range(1, 13):
        trajectories = source.next_batch(step, 0, params)
        assert len(trajectories) == 8
        if source.metrics()["tail/long_round"]:
            long_rounds += 1
            assert max(len(t.response_ids) for t in trajectories) > 12
        else:
            assert all(t.finish_reason == "stop" and len(t.response_ids) <= 12
                       for t in trajectories)
    assert long_rounds >= 1 and source.metrics()["tail/deferred_total"] >= 2
    assert not engine._aborted


def rl_config(tmp_path, tiny_model, arithmetic, **sections) -> RLConfig:
    data = {
        "output_dir": str(tmp_path / "run"), "seed": 1, "steps": 4,
        "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 16, "num_threads": 1},
        "eval": {"every_steps": 0, "max_prompts": 8},
        "reward": {"type": "custom", "function": "rewards_for_rollout_tests:length_score"},
        "tracking": {"progress": False, "tensorboard": False, "record_batch_every": 0},
    }
    data.update(sections)
    return RLConfig.model_validate(data)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "rewards_for_rollout_tests.py").write_text(
        "def length_score(sample):\n    return float(len(sample.response) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)


def test_async_training_trains_within_the_staleness_bound(tmp_path, tiny_model, arithmetic,
                                                        reward_module):
    config = rl_config(tmp_path, tiny_model, arithmetic,
                       async_training={"enabled": True, "max_staleness": 1},
                       algorithm={"correction": {"tis": {"level": "token", "cap": 2.0}}})
    pipeline = rlvr_pipeline(config)
    before = {k: v.clone() for k, v in pipeline.step.policy.state_dict_for_sync()}
    summary = pipeline.run()
    rows = read_metrics(summary["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows)  # rollout really ran ahead of training
    assert all("correction/tis_weight_mean" in r and "time/trainer_idle_s" in r for r in rows)
    assert sum(r["rollout/samples_kept"] for r in rows) >= 4 * 16
    after = dict(pipeline.step.policy.state_dict_for_sync())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert summary["eval_reward_end"] is not None


def test_async_training_without_a_configured_correction_applies_tis(tmp_path, tiny_model,
                                                                   arithmetic, reward_module):
    # Issue 17: no `algorithm.correction` configured, staleness > 0: the run must not train on
    # stale samples as if on-policy; token TIS (cap 2) is on and its weights are not all 1.
    config = rl_config(tmp_path, tiny_model, arithmetic,
                       async_training={"enabled": True, "max_staleness": 1})
    assert config.algorithm.correction.tis is not None
    summary = rlvr_pipeline(config).run()
    rows = read_metrics(summary["run_dir"])
    assert any(r["staleness/max"] == 1 for r in rows)
    assert all("correction/tis_weight_mean" in r for r in rows)
    assert any(abs(r["correction/tis_weight_mean"] - 1.0) > 1e-4 for r in rows)
    assert any(r["correction/behaviour_ratio_max"] > 1.0 + 1e-4 for r in rows)
    assert "cap: 2.0" in (tmp_path / "run" / "config.yaml").read_text()


def test_async_training_with_in_flight_updates(tmp_path, tiny_model, arithmetic, reward_module):
    config = rl_config(tmp_path, tiny_model, arithmetic,
                       async_training={"enabled": True, "max_staleness": 1,
                                       "in_flight_updates": True},
                       algorithm={"correction": {"tis": {"level": "token", "cap": 2.0}}})
    summary = rlvr_pipeline(config).run()
    rows = read_metrics(summary["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 and r["rollout/resumed_samples"] == 0 for r in rows)
    assert sum(r["rollout/samples_kept"] for r in rows) >= 4 * 16


def trained_prompts(config) -> list[list[str]]:
    """Run the pipeline; the prompts of each step's batch, one per group, in order."""
    pipeline, steps = rlvr_pipeline(config), []
    next_batch = pipeline.step.task.source.next_batch

    def recorded(*args):
        trajectories = next_batch(*args)
        steps.append(list(dict.fromkeys(t.prompt_text for t in trajectories)))
        return trajectories

    pipeline.step.task.source.next_batch = recorded
    pipeline.run()
    return steps


def test_async_in_start_order_trains_each_step_on_syncs_prompts(tmp_path, tiny_model, arithmetic,
                                                                reward_module):
    """`order: start` makes async training equal work with sync: the same prompts, step by step,
    while the engine runs up to a batch ahead."""
    sync = trained_prompts(rl_config(tmp_path / "sync", tiny_model, arithmetic))
    config = rl_config(tmp_path / "async", tiny_model, arithmetic,
                       async_training={"enabled": True, "max_staleness": 2, "max_ahead": 1,
                                       "order": "start"})
    assert trained_prompts(config) == sync and len(sync) == 4


def test_a_resumed_async_run_trains_the_uninterrupted_runs_prompts(tmp_path, tiny_model,
                                                                   arithmetic, reward_module):
    """Issue 46: a run killed after its step-1 checkpoint had groups buffered and in flight (the
    producer works a batch ahead); the checkpoint must owe them to the resumed run, not skip to
    where the producer had got. In start order the resumed steps train the uninterrupted run's
    prompts, step by step; no prompt is lost or trained twice. (A kill -9 after the checkpoint
    leaves what deleting the later checkpoints leaves: checkpoints are written whole or not.)"""
    sections = {"steps": 3, "checkpoint": {"every_steps": 1, "keep_last": 3},
                "async_training": {"enabled": True, "max_staleness": 2, "max_ahead": 1,
                                   "order": "start"}}
    whole = trained_prompts(rl_config(tmp_path, tiny_model, arithmetic, **sections))
    run = tmp_path / "run"
    for n in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{n}")
    resumed = trained_prompts(rl_config(tmp_path, tiny_model, arithmetic, resume=True,
                                        **sections))
    assert len(whole) == 3 and all(len(step) == 4 for step in whole)
    assert resumed == whole[1:]
    trained = sum(whole[:1] + resumed, [])
    assert len(set(trained)) == len(trained) == 12  # none lost, none twice


def test_in_flight_updates_need_the_hf_engine(tmp_path, tiny_model, arithmetic):
    with pytest.raises(ValueError, match="async_training.in_flight_updates needs rollout.engine"):
        rl_config(tmp_path, tiny_model, arithmetic,
                  rollout={"engine": "vllm", "prompts_per_step": 4, "group_size": 4},
                  async_training={"enabled": True, "in_flight_updates": True})


def test_dynamic_sampling_fills_the_batch_with_the_hf_engine(tmp_path, tiny_model, arithmetic,
                                                           reward_module):
    config = rl_config(tmp_path, tiny_model, arithmetic, steps=2,
                       algorithm={"dynamic_sampling": {"drop_all_equal": True}},
                       scheduler={"oversample": 1.5, "max_groups_factor": 8})
    summary = rlvr_pipeline(config).run()
    rows = read_metrics(summary["run_dir"])
    for r in rows:
        assert r["rollout/groups_kept"] == 4  # dropped groups were replaced
        assert r["filter/groups_dropped"] == 0
        assert r["train/groups_all_equal"] == 0
