"""Agentic RL on your own agent program (`agent:`): the task the RL pipeline runs when an
agentic config names an agent instead of an environment.

The agent drives itself through reroll's OpenAI-compatible gateway (`reroll.rollout.gateway`),
which runs in this process in front of the rollout engine for the whole run. Each step draws
`rollout.prompts_per_step` task rows and runs `rollout.group_size` episodes of each, every one
in its own session; the calls' tokens become the step's trajectories (one per episode, see
`rollout/gateway/assembly.py`), scored by the agent's reward. The run's sampling settings apply
to every call (the client's `temperature` is not used), so the trainer's ratios hold.

With `async_training`, an asynchronous source (`reroll.rollout.async_agents.AgentWork`) runs
the task rows' groups of episodes ahead of the trainer, every call through its scheduler, each
token recording the weight version that sampled it; the checkpoint keeps the groups owed to a
resumed run, as for environments.
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path
from typing import Any

from reroll.config.agentic import AgenticConfig
from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory, infra_failed
from reroll.data.datasets import PromptSampler, _read_records
from reroll.engines.base import Engine, SamplingParams
from reroll.pipelines.envmix import outcome
from reroll.pipelines.task import EvalSet, grouped, held_out, rollout_row
from reroll.pipelines.validation import context_tokens
from reroll.rewards.custom import resolve
from reroll.rollout.async_agents import AgentWork
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.gateway import AgentSpec, Gateway, run_episodes
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream

EVAL_SEED_BASE = 10**9
log = logging.getLogger(__name__)


def read_tasks(path: str, field: str) -> list[Any]:
    """The task rows of a JSONL file (any JSON objects), or one error naming the file."""
    if not Path(path).is_file():
        raise ConfigError(f"{field}: no such file {path}")
    rows = [record for _, record in _read_records(Path(path))]
    if not rows:
        raise ConfigError(f"{field}: {path} holds no task rows")
    return rows


def agent_spec(config: AgenticConfig) -> AgentSpec:
    a = config.agent
    return AgentSpec(
        entrypoint=resolve(a.entrypoint, "agent.entrypoint") if a.entrypoint else None,
        command=list(a.command) if a.command else None, time_limit_s=a.time_limit_s,
        verifier=resolve(a.verifier, "agent.verifier") if a.verifier else None, env=dict(a.env))


def held_out_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Mean return and success rate over the episodes that did not end in an infrastructure
    failure (a harness that crashed, timed out, never called or gave no reward; `envmix.outcome`,
    as environments' episodes), and the share that did."""
    valid = sum(not infra_failed(t) for t in trajectories)
    return {"eval/" + key: value for key, value in outcome(trajectories).items()} | {
        "eval/infra_failure_frac": 1.0 - valid / max(len(trajectories), 1)}


class AgentTask:
    """Task rows for an agent program instead of an environment (see the module doc)."""

    def __init__(self, config: AgenticConfig, tokenizer, inputs=None):
        self.config, self.tokenizer = config, tokenizer
        a = config.agent
        self.spec = agent_spec(config)  # a bad import path fails here, before the models load
        self.tasks = read_tasks(a.tasks, "agent.tasks")
        self.eval_tasks = read_tasks(a.eval_tasks, "agent.eval_tasks") if a.eval_tasks else []
        self.max_context_tokens = context_tokens(a.max_context_tokens, "agent.max_context_tokens",
                                                 config.model.path)
        self.label = "agent"
        self.sampler = PromptSampler(self.tasks, config.seed)
        self.stream = PromptStream(self.sampler)
        self.eval_sets: list[EvalSet] = []
        self.gateway: Gateway | None = None
        self.source: AsyncSource | None = None
        """With `async_training`: the producer running episodes ahead of the trainer."""
        self.episodes = 0
        self._metrics: dict[str, float] = {}

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_tasks)

    @property
    def eval_what(self) -> str:
        return held_out(len(self.eval_tasks), "task", self.config.eval.samples_per_prompt)

    def start(self, engine: Engine) -> Engine:
        c, a = self.config, self.config.agent
        self.gateway = Gateway(engine, self.tokenizer, Path(c.model.path).name,
                               SamplingParams(), self.max_context_tokens, a.host, a.port,
                               a.tool_parser)
        if c.async_training.enabled:  # episodes run ahead while the trainer updates
            work = functools.partial(AgentWork, gateway=self.gateway, spec=self.spec)
            self.source = AsyncSource(SourceSettings.of(c), engine, None, self.tokenizer,
                                      self.stream, work=work)
            # Held-out episodes (sessions without an engine of their own) sample through it too.
            engine = self.gateway.engine = self.source.engine
        return engine

    def run(self, tasks: list[Any], group_size: int, params: SamplingParams, seed: int):
        self.gateway.params = params
        trajectories, stats = run_episodes(self.gateway, self.spec, tasks, group_size, seed)
        self.episodes += stats.episodes
        return trajectories, stats

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        """A group of episodes for each of this step's task rows (async: taken from the
        producer's buffer within the staleness bound of the trainer's version, step - 1)."""
        c = self.config
        if self.source is not None:
            trajectories = self.source.next_batch(step, step - 1, params)
            stats = self.source.work.take_stats()
            self.episodes += stats.episodes
        else:
            tasks = self.stream.next_batch(c.rollout.prompts_per_step)
            trajectories, stats = self.run(tasks, c.rollout.group_size, params,
                                           c.seed * 7_919 + step * 1_000_003)
        success = [t.reward_info.get("success", False) for t in trajectories]
        g = self.gateway.stats
        self._metrics = stats.metrics() | {
            "train/success_rate": sum(success) / max(len(success), 1),
            "gateway/retokenize_mismatch": float(g.retokenize_mismatch),
            "gateway/late_calls": float(self.gateway.sessions.late_calls)}
        if self.source is not None:
            self._metrics |= self.source.metrics() | {
                "rollout/episodes_restarted": float(self.source.work.restarted)}
        return trajectories

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Mean return and success rate on the held-out tasks, over the episodes whose harness
        did not fail (`eval/infra_failure_frac`: the share that did; a timed-out or crashed
        harness is not the policy's failure)."""
        n = self.config.eval.samples_per_prompt
        trajectories, stats = self.run(self.eval_tasks, n, params, EVAL_SEED_BASE)
        self.eval_sets = [EvalSet(self.label, grouped(trajectories, n), stats.metrics())]
        failed = sum(infra_failed(t) for t in trajectories)
        if failed:
            log.warning("evaluation: the harness failed in %d of %d episodes (%s; the last: "
                        "%s); the eval metrics are over the others", failed, len(trajectories),
                        dict(stats.failures), stats.errors[-1][:200] if stats.errors else "")
        return held_out_metrics(trajectories) | {
            "eval/gateway_calls_mean": stats.metrics()["gateway/calls_mean"]}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        picked = random.Random(step).sample(trajectories, min(count, len(trajectories)))
        return [rollout_row(t) for t in picked]

    def state_dict(self) -> dict[str, Any]:
        # The task rows' position (async: the trainer's, and the groups owed the resumed run).
        position = self.source.state_dict() if self.source is not None else \
            {"sampler": self.sampler.state_dict()}
        return position | {"episodes": self.episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)
        else:
            self.stream.load_state_dict(state["sampler"])
        self.episodes = state.get("episodes", 0)

    def close(self) -> None:
        if self.source is not None:  # its episodes end before the gateway they call
            self.source.close()
            self.source = None
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None
