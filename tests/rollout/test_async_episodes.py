"""Asynchronous agentic training (issue 46): episodes run on while the trainer updates; every
token records the version that sampled it; no trained episode spans more than max_staleness
versions (a stale one restarts, or its group is dropped); a checkpoint owes the resumed run the
episodes' env seeds it launched and did not train."""

from __future__ import annotations

import pytest
from resume_check import stop_and_resume
from scripted_engine import ScriptedEngine

from reroll.config.agentic import AgenticConfig
from reroll.data.datasets import PromptSampler
from reroll.engines.base import SamplingParams
from reroll.envs import make_env
from reroll.rollout.agent_loop import AgentJob
from reroll.rollout.async_episodes import EpisodeWork
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream

pytestmark = pytest.mark.unit
TOKEN = 40
GROUPS, SIZE = 2, 2


def config(**async_training) -> AgenticConfig:
    return AgenticConfig(model={"path": "unused"}, steps=8, env={"id": "guess_number"},
                         rollout={"prompts_per_step": GROUPS, "group_size": SIZE,
                                  "max_new_tokens": 512}, train={"micro_batch_size": 2},
                         async_training={"enabled": True, **async_training})


def source(tokenizer, cfg: AgenticConfig, turns: int = 4, tick: float = 0.002,
           length=lambda prompt, seed: 2 + seed % 6, hold=None) -> AsyncSource:
    """Episodes of `turns` turns of 2-7 tokens (by the sampling seed): several weight updates
    land inside one episode."""
    engine = ScriptedEngine(length, TOKEN, tick=tick, hold=hold)

    def make_job(params: SamplingParams) -> AgentJob:
        return AgentJob(engine, tokenizer, lambda: make_env("guess_number", high=64,
                                                            max_turns=turns),
                        params, max_turns=turns, max_context_tokens=8192)

    stream = PromptStream(PromptSampler(list(range(1000)), cfg.seed))
    work = lambda s: EpisodeWork(s, make_job)  # noqa: E731
    return AsyncSource(SourceSettings.of(cfg), engine, None, tokenizer, stream, work=work)




def LONG_TAIL(prompt, seed):  # noqa: N802 - a constant's name
    # 300 ticks of 2 ms (PARAMS allow the 300 tokens): several updates land inside one turn
    return 300 if seed % 9 == 0 else 2


PARAMS = SamplingParams(max_new_tokens=512, temperature=1.0)


def run_steps(src: AsyncSource, steps) -> list[list[int]]:
    """Each step's env seeds (one per group); the trainer's update is a version bump."""
    seeds = []
    for step in steps:
        trajectories = src.next_batch(step, step - 1, PARAMS)
        assert len(trajectories) == GROUPS * SIZE
        for t in trajectories:
            assert t.token_versions is not None and len(t.token_versions) == len(t.response_ids)
            policy = [v for v, m in zip(t.token_versions, t.policy_mask, strict=True) if m]
            env = [v for v, m in zip(t.token_versions, t.policy_mask, strict=True) if not m]
            assert policy and all(v >= 0 for v in policy) and all(v == -1 for v in env)
            # the per-episode bound: its oldest token within max_staleness of the trainer
            assert step - 1 - min(policy) <= src.settings.async_training.max_staleness
            assert t.policy_version <= min(policy)  # the group's oldest token
        seeds.append([t.reward_info["env_seed"] for t in trajectories[::SIZE]])
        src.engine.load_weights([], step)
    return seeds


@pytest.mark.parametrize("restart", [True, False])
def test_episodes_span_at_most_max_staleness_versions(tokenizer, restart):
    """A few turns wait for two weight updates after their first token, while short groups fill
    the batches (order: finish): their episodes would span two versions. Counted in updates,
    not ticks: under a loaded CI run, turns of 300 ticks sometimes finished inside one update
    and nothing went stale."""
    src = source(tokenizer, config(max_staleness=1, restart_stale_episodes=restart),
                 hold=lambda seed: 2 if seed % 9 == 0 else 0)
    try:
        run_steps(src, range(1, 8))
        work: EpisodeWork = src.work
        metrics = src.metrics()
        assert metrics["staleness/max"] <= 1
        if restart:  # long episodes met the bound: restarted, never aborted
            assert work.restarted > 0 and src.stale_groups_aborted == 0
        else:  # their groups are aborted (RLVR's behaviour)
            assert work.restarted == 0 and src.stale_groups_aborted > 0
    finally:
        src.close()


def test_a_partial_episode_continues_on_new_weights(tokenizer):
    """A turn preempted by the update resumes under the new weights: one episode holds tokens
    of two versions, and its turns after the sync sample from the new one."""
    src = source(tokenizer, config(max_staleness=2), length=LONG_TAIL)
    try:
        spans, resumed = [], 0
        for step in range(1, 7):
            for t in src.next_batch(step, step - 1, PARAMS):
                policy = {v for v, m in zip(t.token_versions, t.policy_mask, strict=True) if m}
                spans.append(max(policy) - min(policy))
            resumed += src.metrics()["rollout/resumed_samples"]
            src.engine.load_weights([], step)
        assert resumed > 0 and 1 <= max(spans) <= 2
        assert src.metrics()["staleness/off_policy_token_frac"] >= 0
    finally:
        src.close()


@pytest.mark.parametrize("order", ["start", "finish"])
def test_a_resumed_source_trains_every_env_seed_once(tokenizer, order):
    """Killed after step 2's checkpoint and resumed from it: the env seeds the producer had
    launched ahead are owed, so the resumed run trains the uninterrupted run's seeds, each once
    (in start order, step by step)."""
    cfg = config(max_staleness=2, order=order, restart_stale_episodes=True)

    def make():
        src = source(tokenizer, cfg)
        return src, src.close

    r = stop_and_resume(make, run_steps, steps=5, stop=2)
    launched = PromptStream(PromptSampler(list(range(1000)), cfg.seed)).next_batch(
        r.state["async"]["next_index"])
    owed = [seed for seed in launched if seed not in sum(r.before, [])]
    assert [seed for _, seed in r.state["async"]["owed"]] == owed
    assert owed  # the producer had run ahead of the checkpoint
    trained = [s for step in r.before + r.after for s in step]
    assert len(trained) == len(set(trained)) == 5 * GROUPS  # none lost, none twice
    assert set(launched) <= set(trained)  # the owed seeds were trained after the resume
    if order == "start":
        assert r.before + r.after == r.whole
