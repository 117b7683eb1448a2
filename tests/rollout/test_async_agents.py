"""Asynchronous training of an agent program through the gateway (issue 46): the harness's
calls run through the async producer, so a weight update preempts them and they resume on the
new weights; every policy token the gateway records carries its version; a harness episode
that would span more than max_staleness versions restarts in a fresh session (or its group is
aborted); a checkpoint owes the resumed run the task rows it launched and did not train. The
harness is the unmodified `openai` SDK (`chat_harness`), the engine a scripted one."""

from __future__ import annotations

import asyncio
import functools
import sys
import time

import pytest
from chat_harness import TASKS, chat
from resume_check import stop_and_resume
from scripted_engine import ScriptedEngine

from reroll.config.agentic import AgenticConfig
from reroll.data.datasets import PromptSampler
from reroll.engines.base import SamplingParams
from reroll.rollout.async_agents import AgentWork
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.gateway import AgentSpec, Gateway
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream

pytestmark = pytest.mark.unit
TOKEN = 40
GROUPS, SIZE = 2, 2
PARAMS = SamplingParams(max_new_tokens=1024, temperature=1.0)


def config(**async_training) -> AgenticConfig:
    return AgenticConfig(model={"path": "unused"}, steps=8,
                         agent={"entrypoint": "chat_harness:chat", "tasks": "unused"},
                         rollout={"prompts_per_step": GROUPS, "group_size": SIZE,
                                  "max_new_tokens": 1024}, train={"micro_batch_size": 2},
                         async_training={"enabled": True, **async_training})


def long_first_call(prompt, seed):
    """An episode's first call (its prompt is the task alone) runs 600 tokens, a second or
    more; a later call (the conversation so far) 2."""
    return 600 if len(prompt) < 40 else 2


class Run:
    """A gateway and an async source of harness episodes on a scripted engine."""

    def __init__(self, tokenizer, cfg: AgenticConfig, tasks=TASKS, length=long_first_call,
                 spec: AgentSpec | None = None):
        engine = ScriptedEngine(length, TOKEN, tick=0.002)
        self.gateway = Gateway(engine, tokenizer, "tiny", PARAMS, 4096)
        stream = PromptStream(PromptSampler(list(tasks), cfg.seed))
        work = functools.partial(AgentWork, gateway=self.gateway,
                                 spec=spec or AgentSpec(entrypoint=chat, time_limit_s=60))
        self.source = AsyncSource(SourceSettings.of(cfg), engine, None, tokenizer, stream, work=work)
        self.gateway.engine = self.source.engine

    def close(self) -> None:
        self.source.close()
        self.gateway.close()


def trained(src: AsyncSource, steps) -> list[list[str]]:
    """Each step's task prompts (one per group); the trainer's update is a version bump."""
    rows = []
    for step in steps:
        trajectories = src.next_batch(step, step - 1, PARAMS)
        assert len(trajectories) == GROUPS * SIZE
        for t in trajectories:
            if t.reward_info["agent_status"] != "ok":
                continue
            pairs = list(zip(t.token_versions, t.policy_mask, strict=True))
            policy = [v for v, m in pairs if m]
            assert policy and min(policy) >= 0 and all(v == -1 for v, m in pairs if not m)
            assert step - 1 - min(policy) <= src.settings.async_training.max_staleness
            assert t.policy_version <= min(policy)  # the group's oldest token
        rows.append([t.prompt_text for t in trajectories[::SIZE]])
        src.engine.load_weights([], step)
    return rows


def play_across_syncs(run: Run, versions: list[int]) -> tuple[bool, list]:
    """One group of the task's episodes on the producer's loop; once their first calls have
    decoded a while, the engine moves to each of `versions`. (kept, trajectories)"""
    src = run.source
    group = src.work.new_group(0, TASKS[0], src.engine.version)
    played = asyncio.run_coroutine_threadsafe(src.work.run(group, PARAMS), src.loop)
    engine = src.engine.inner
    while engine.running < SIZE:
        time.sleep(0.01)
    time.sleep(0.3)
    for version in versions:
        src.engine.load_weights([], version)
    kept = played.result(timeout=60)
    return kept, src.work.trajectories(group, 0) if kept else []


def policy_versions(t) -> list[int]:
    return [v for v, m in zip(t.token_versions, t.policy_mask, strict=True) if m]


def test_a_call_in_flight_at_a_sync_resumes_on_the_new_weights(tokenizer):
    """A call preempted by the weight update keeps its tokens and resumes under the new
    weights: its episode's first completion holds tokens of both versions, recorded by the
    gateway, and the episode's later call samples from the new weights."""
    run = Run(tokenizer, config(max_staleness=1))
    try:
        kept, trajectories = play_across_syncs(run, [1])
        assert kept and len(trajectories) == SIZE
        for t in trajectories:
            assert t.reward_info["agent_status"] == "ok" and t.reward_info["calls"] == 2
            versions = policy_versions(t)
            first = versions[:600]  # the first call's completion
            assert first[0] == 0 and first[-1] == 1 and versions[-1] == 1
            assert t.reward_info["policy_versions"] == [0, 1] and t.policy_version == 0
        assert run.source.work.restarted == 0
    finally:
        run.close()


def test_a_harness_episode_past_the_staleness_bound_restarts_in_a_fresh_session(tokenizer):
    """Two updates land during the episodes' first calls (max_staleness 1): the calls cannot
    resume (their tokens would be two versions old), so the sessions are ended (the harness
    gets 409) and the episodes play again from the start on the current weights."""
    run = Run(tokenizer, config(max_staleness=1))
    try:
        kept, trajectories = play_across_syncs(run, [1, 2])
        assert kept and run.source.work.restarted == SIZE
        for t in trajectories:
            assert t.reward_info["agent_status"] == "ok"
            assert set(policy_versions(t)) == {2}  # nothing of the abandoned attempt
        assert run.gateway.stats.refused.get("session_ended", 0) >= SIZE
        stats = run.source.work.take_stats()
        assert stats.episodes == SIZE and stats.failures["crashed"] == 0  # restarts not counted
    finally:
        run.close()


def test_a_crashing_harness_is_an_infrastructure_failure(tokenizer):
    """Task 6's harness raises after its first call: its episodes are masked and counted as
    `crashed`, and take their group's mean reward (not a 0 the policy earned)."""
    run = Run(tokenizer, config(max_staleness=1), [TASKS[0], TASKS[6]], length=lambda p, s: 3)
    try:
        trajectories = run.source.next_batch(1, 0, PARAMS) + run.source.next_batch(2, 0, PARAMS)
        stats = run.source.work.take_stats()
        broken = [t for t in trajectories if "Task 6" in t.prompt_text]
        assert broken and stats.failures["crashed"] == len(broken)
        assert all(t.reward_info["agent_status"] == "crashed" and not any(t.policy_mask)
                   for t in broken)
    finally:
        run.close()


def test_a_command_harness_plays_async_episodes(tokenizer):
    """`agent: {command: [...]}`: a subprocess per episode, started from the producer's
    thread, its calls versioned like an entrypoint's."""
    code = ("import json, os, urllib.request\n"  # plain HTTP: a cheap process to start
            "task = json.loads(os.environ['REROLL_TASK'])\n"
            "body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': task['prompt']}]}\n"
            "urllib.request.urlopen(urllib.request.Request("
            "os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps(body).encode(), "
            "{'Content-Type': 'application/json'})).read()\n"
            "print(1.0)\n")
    spec = AgentSpec(command=[sys.executable, "-c", code], time_limit_s=60)
    run = Run(tokenizer, config(max_staleness=1, max_ahead=0), TASKS[:2],
              length=lambda p, s: 3, spec=spec)
    try:
        trajectories = run.source.next_batch(1, 0, PARAMS)
        assert all(t.reward_info["agent_status"] == "ok" and t.reward == 1.0
                   for t in trajectories)
        assert all(t.reward_info["policy_versions"] == [0, 0] for t in trajectories)
    finally:
        run.close()


@pytest.mark.parametrize("order", ["start", "finish"])
def test_a_resumed_source_trains_every_task_once(tokenizer, order):
    """Stopped after step 2's checkpoint and resumed from it: the task rows the producer had
    launched ahead are owed, so the resumed run trains the uninterrupted run's tasks, each once
    (in start order, step by step)."""
    cfg = config(max_staleness=2, order=order)
    tasks = [{"prompt": f"Task {k}: say something."} for k in range(20)]

    def make():
        run = Run(tokenizer, cfg, tasks, length=lambda p, s: 3)
        return run.source, run.close

    r = stop_and_resume(make, trained, steps=4, stop=2)
    assert r.state["async"]["owed"]  # the producer had run ahead of the checkpoint
    rows = [p for step in r.before + r.after for p in step]
    assert len(rows) == len(set(rows)) == 4 * GROUPS  # none lost, none twice
    if order == "start":
        assert r.before + r.after == r.whole
