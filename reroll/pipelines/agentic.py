"""Agentic RL: the policy acts over many turns in an environment and learns from the outcome.

`EnvTask` is the task the RL pipeline (`reroll.pipelines.rl`) runs here, in the same loop and
training step as RLVR's prompts (`reroll.pipelines.rl`), under the same restart supervisor.
Only the task differs: trajectories come from multi-turn episodes (`reroll.rollout.agent_loop`),
each with its turn boundaries and per-turn rewards, so the catalogue's credit assignment applies
as configured:
`grpo` on episode returns (StarPO-style trajectory level), `rebn` (per-turn discounted returns,
batch-normalised), `gigpo` (episode + anchor-state step advantages) and `ipa_chunk` (discounted
chunk-level returns with a per-chunk ratio). Evaluation reports the mean return and the success
rate on held-out env seeds.

A learned reward (`reward:`, a reward model or an LLM judge) may score each finished episode
besides the environment: built like RLVR's (`judge.reward_factory`), here or in reward actors,
behind a RewardRunner, and added to the return by the agent loop (`EpisodeReward`).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from reroll.config.agentic import AgenticConfig, EnvConfig
from reroll.config.errors import ConfigError, RunStopped
from reroll.data.batch import Trajectory, infra_failed
from reroll.data.datasets import PromptSampler
from reroll.engines.base import Engine, SamplingParams
from reroll.envs import ChatFormat, make_env
from reroll.envs.base import EnvError
from reroll.envs.gem_adapter import PREFIX as GEM_PREFIX
from reroll.envs.process import EnvProcesses, picklable
from reroll.envs.registry import env_arguments, env_specs
from reroll.envs.user import check_kwargs, is_user_id, load_factory
from reroll.pipelines import rl, run
from reroll.pipelines.agents import AgentTask
from reroll.pipelines.envmix import EnvMixTask, entry_message
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.judge import reward_factory
from reroll.pipelines.roles import remote_envs, remote_reward
from reroll.pipelines.task import EvalSet, grouped, held_out, rollout_row
from reroll.pipelines.validation import context_tokens
from reroll.rewards import build_runner
from reroll.rollout.agent_loop import AgentJob, AgentStats, EpisodeReward, run_episodes
from reroll.rollout.async_episodes import EpisodeWork
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.context import from_config
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream

EVAL_SEED_BASE = 10**9


def check_history(tokenizer, system_prompt: str | None, history_thinking: str | None) -> None:
    """At start: a chat template that renders earlier turns otherwise than the agent loop
    records them (Qwen3's drops their reasoning) needs an explicit `env.history_thinking`."""
    problem = ChatFormat(tokenizer, system_prompt).history_mismatch()
    if problem is not None and history_thinking is None:
        raise ConfigError(f"env.history_thinking: {problem}. Set env.history_thinking: keep to "
                          "train on the tokens as generated (earlier reasoning stays in later "
                          "contexts, unlike what template-based inference shows the model); "
                          "see docs/agentic.md")


def env_processes(env: EnvConfig, factory, given: bool) -> EnvProcesses | None:
    """The env host processes `env.isolation` asks for (`auto`: for a user's `module:Class`
    env), started now, or None (threads of this process)."""
    isolation = env.isolation
    if isolation == "auto":
        user = is_user_id(env.id) and not env.id.startswith(GEM_PREFIX)
        isolation = "process" if user and not given else "thread"
    if isolation == "thread":
        return None
    problem = picklable(factory)
    if problem is not None:
        raise ConfigError(f"env.isolation: process needs an environment a new process can "
                          f"import; the one given cannot be sent there ({problem}): pass a class "
                          f"or function of an importable module, or set env.isolation: thread")
    try:
        return EnvProcesses(factory, env.id, env.num_processes)
    except EnvError as e:
        raise ConfigError(f"env.isolation: process: {e} (env.isolation: thread runs it in "
                          f"this process)") from None


@dataclass
class EpisodeCounters:
    """Run totals kept in checkpoints (as `reward_counters`), so a resumed run continues them."""

    episodes: int = 0
    env_errors: int = 0


class EnvTask:
    """An environment: env seeds instead of prompts, and the env's return as the reward. The
    env id and its arguments are tried and the chat template checked when the task is built,
    before the models load."""

    def __init__(self, config: AgenticConfig, tokenizer, inputs: TaskInputs | None = None,
                 env: EnvConfig | None = None, seed_offset: int = 0):
        """`inputs`: an environment passed as a Python object (`reroll.api.train`), built
        fresh for each episode instead of `env.id`. `env`: which environment (one of
        `config.envs`, `reroll.pipelines.envmix`); None: `config.env`. `seed_offset`: its env
        seeds are drawn with `seed + seed_offset` (each of several envs its own stream)."""
        self.config, self.tokenizer = config, tokenizer
        self.eval_sets: list[EvalSet] = []
        env = self.env = env or config.env
        kwargs = env_arguments(env.id, env.kwargs, env.max_turns)
        given = (inputs or TaskInputs()).env_factory
        factory = given or functools.partial(make_env, env.id, **kwargs)  # picklable
        factory()  # a bad id or argument fails at start-up, not mid-run
        # With `distributed.env` placed, each episode's environment lives in a Ray actor there;
        # else, with `env.isolation` process, in env host processes; else in threads here.
        self.env_hosts = remote_envs(config, factory)
        self.env_processes = None if self.env_hosts is not None else \
            env_processes(env, factory, given is not None)
        hosts = self.env_hosts or self.env_processes
        self.make_env = hosts.make if hosts is not None else factory
        check_history(tokenizer, env.system_prompt, env.history_thinking)
        self.context = from_config(env.context)
        self.max_context_tokens = context_tokens(env.max_context_tokens,
                                                 "env.max_context_tokens", config.model.path)
        self.label = env.id
        self.sampler = PromptSampler(list(range(env.train_seeds)),  # env seeds
                                     config.seed + seed_offset)
        self.stream = PromptStream(self.sampler)
        self.source: AsyncSource | None = None
        """With `async_training`: the producer running episodes ahead of the trainer."""
        self.eval_seeds = [EVAL_SEED_BASE + i for i in range(env.eval_episodes)]
        self.counters = EpisodeCounters()
        self._checked = EpisodeCounters()  # the counts at the last failure check
        self.last_error = ""
        # `reward:`: a learned reward of each episode, in reward actors with
        # `distributed.reward`, else here.
        self.episode_reward = None
        if config.reward is not None:
            factory = reward_factory(config.reward, config.seed)
            runner = build_runner(config.reward, remote_reward(config, factory) or factory())
            self.episode_reward = EpisodeReward(runner, config.reward.weight,
                                                config.reward.env_weight)
        self.engine: Engine | None = None
        self._metrics: dict[str, float] = {}

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_seeds)

    @property
    def eval_what(self) -> str:
        return held_out(len(self.eval_seeds), "episode", self.config.eval.samples_per_prompt)

    def start(self, engine: Engine) -> Engine:
        c = self.config
        if c.async_training.enabled:  # episodes run ahead while the trainer updates
            work = functools.partial(EpisodeWork, make_job=self.job, redundancy=self.env.redundancy)
            self.source = AsyncSource(SourceSettings.of(c), engine, None, self.tokenizer,
                                      self.stream, work=work)
            engine = self.source.engine
        self.engine = engine
        return engine

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        """A group of episodes for each of this step's env seeds (async: taken from the
        producer's buffer within the staleness bound of the trainer's version, step - 1)."""
        c = self.config
        if self.source is not None:
            trajectories = self.source.next_batch(step, step - 1, params)
            stats = self.source.work.take_stats()
            self.account(stats)
        else:
            seeds = self.stream.next_batch(c.rollout.prompts_per_step)
            trajectories, stats = self.run(seeds, c.rollout.group_size, params, step,
                                           self.env.redundancy)
        self.check_failure_rate(step)  # an environment that keeps failing stops the run here
        success = [t.reward_info.get("success", False) for t in trajectories]
        self._metrics = stats.metrics() | {
            "train/success_rate": sum(success) / max(len(success), 1),
            "env/errors_total": float(self.counters.env_errors)}
        if self.source is not None:
            self._metrics |= self.source.metrics() | {
                "rollout/episodes_restarted": float(self.source.work.restarted)}
        if self.episode_reward is not None:
            runner = self.episode_reward.runner
            runner.check_failure_rate(step)  # a reward that keeps failing stops the run here
            self._metrics |= runner.metrics() | learned_reward_means(trajectories, "train")
        return trajectories

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Mean return and success rate on the held-out env seeds, over the episodes that did
        not end in an infrastructure failure (`eval/infra_failure_frac`: the share that did)."""
        n = self.config.eval.samples_per_prompt
        trajectories, stats = self.run(self.eval_seeds, n, params, step=-1)
        valid = [t for t in trajectories if not infra_failed(t)]
        returns = torch.tensor([t.reward for t in valid] or [0.0])
        success = torch.tensor([float(t.reward_info.get("success", False)) for t in valid]
                               or [0.0])
        self.eval_sets = [EvalSet(self.label, grouped(trajectories, n),
                                  {k: v for k, v in stats.metrics().items()
                                   if k != "env/episodes"}
                                  | {"success_rate": float(success.mean())})]
        metrics = {"eval/reward_mean": float(returns.mean()),
                   "eval/success_rate": float(success.mean()),
                   "eval/turns_mean": stats.metrics()["env/turns_mean"],
                   "eval/infra_failure_frac": stats.metrics()["env/infra_failure_frac"]}
        if self.episode_reward is not None:
            metrics |= learned_reward_means(trajectories, "eval")
        return metrics

    def run(self, seeds: list[int], group_size: int, params: SamplingParams, step: int,
            redundancy: int = 0) -> tuple[list[Trajectory], AgentStats]:
        trajectories, stats = run_episodes(self.job(params), seeds, group_size, self.config.seed,
                                           step, redundancy)
        self.account(stats)
        return trajectories, stats

    def account(self, stats: AgentStats) -> None:
        """Episodes run (here or by `reroll.pipelines.envmix`) into the run's counters."""
        self.counters.episodes += stats.episodes
        self.counters.env_errors += stats.env_errors
        if stats.errors:
            self.last_error = " ".join(stats.errors[-1].split())  # one line

    def check_failure_rate(self, step: int) -> None:
        """Stop the run (RunStopped: exit 1, one line) when the share of episodes that ended in
        an infrastructure failure since the last check (this step, with the evaluation before
        it) or since the start reaches its bound (`env.max_failure_rate_step`, `_run`): an
        environment that keeps failing trains nothing, and the run must not look finished."""
        c, last, env = self.counters, self._checked, self.env
        self._checked = EpisodeCounters(**asdict(c))
        windows = (("step", c.episodes - last.episodes, c.env_errors - last.env_errors,
                    env.max_failure_rate_step),
                   ("run so far", c.episodes, c.env_errors, env.max_failure_rate_run))
        for name, episodes, failed, bound in windows:
            if episodes and failed / episodes >= bound:
                raise RunStopped(
                    f"step {step}: environment {env.id!r} failed in {failed} of {episodes} "
                    f"episodes this {name} ({failed / episodes:.0%}), at or past the bound of "
                    f"{bound:.0%} (env.max_failure_rate_{'step' if name == 'step' else 'run'}); "
                    f"the last failure: {self.last_error[:300] or 'in the run log'}")

    def job(self, params: SamplingParams) -> AgentJob:
        env = self.env
        return AgentJob(self.engine, self.tokenizer, self.make_env,
                        params, max_turns=env.max_turns,
                        max_context_tokens=self.max_context_tokens, context=self.context,
                        step_timeout_s=env.step_timeout_s, system_prompt=env.system_prompt,
                        history_thinking=env.history_thinking or "keep", one_sample=True,
                        episode_reward=self.episode_reward, tool_parser=env.tool_parser,
                        tool_timeout_s=env.tool_timeout_s, reset_retries=env.reset_retries,
                        reset_backoff_s=env.reset_backoff_s)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        """RLVR's row plus `segments`, the episode as text segments (policy tokens vs environment
        tokens, with their turn) for the run viewer; a seeded sample of the step's episodes."""
        picked = random.Random(step).sample(trajectories, min(count, len(trajectories)))
        return [rollout_row(t) for t in picked]

    def state_dict(self) -> dict[str, Any]:
        # The env seeds' position (async: the trainer's, and the groups owed the resumed run).
        position = self.source.state_dict() if self.source is not None else \
            {"sampler": self.stream.state_dict()}
        state = position | {"reward_counters": asdict(self.counters)}
        if self.episode_reward is not None:
            state["learned_reward_counters"] = self.episode_reward.runner.counter_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)
        else:
            self.stream.load_state_dict(state["sampler"])
        self.counters = EpisodeCounters(**state["reward_counters"])
        self._checked = EpisodeCounters(**state["reward_counters"])
        if self.episode_reward is not None and "learned_reward_counters" in state:
            self.episode_reward.runner.load_counters(state["learned_reward_counters"])

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.env_hosts is not None:
            self.env_hosts.close()
        if self.env_processes is not None:
            self.env_processes.close()
        if self.episode_reward is not None:
            self.episode_reward.runner.close()


def learned_reward_means(trajectories: list[Trajectory], split: str) -> dict[str, float]:
    """`<split>/env_return_mean` (the environment's own return, the true measure) and
    `<split>/learned_reward_mean` (the learned reward's score) of episodes a learned reward
    scored; episodes whose env failed have no score."""
    scores = [t.reward_info["learned_reward"]["score"] for t in trajectories
              if "score" in t.reward_info.get("learned_reward", {})]
    returns = [t.reward_info["env_return"] for t in trajectories]
    return {f"{split}/env_return_mean": sum(returns) / max(len(returns), 1),
            f"{split}/learned_reward_mean": sum(scores) / max(len(scores), 1)}


def agentic_step(config: AgenticConfig):
    """The step factory of `pipeline: agentic` (`reroll.config.pipelines`): the config's
    environment (`env`), its environments (`envs`, `envmix.EnvMixTask`), or its agent program
    through the gateway. A user's env id and kwargs are checked here, before the run directory
    is made and the model loads."""
    several = config.envs is not None
    for k, (name, env) in enumerate(config.env_list()):
        try:
            check_env(config, env)
        except ConfigError as e:
            raise ConfigError(entry_message(str(e), k, name) if several else str(e)) from None
    task = AgentTask if config.agent is not None else \
        functools.partial(EnvMixTask, env_task=EnvTask) if several else EnvTask
    return rl.rl_step(config, task)


def check_env(config: AgenticConfig, env: EnvConfig) -> None:
    """The env id (a user's kwargs too), the context policy and limit, checked at start."""
    if not is_user_id(env.id) and env.id not in env_specs():
        make_env(env.id)  # an unknown id: its ConfigError lists the known ones
    if is_user_id(env.id) and not UNIMPORTABLE.search(env.id):
        check_kwargs(env.id, load_factory(env.id), env_arguments(env.id, env.kwargs,
                                                                 env.max_turns))
    from_config(env.context)  # a bad hook or context fails before the run directory is made
    if Path(config.model.path).is_dir():  # (a missing model folder is reported as such)
        context_tokens(env.max_context_tokens, "env.max_context_tokens", config.model.path)


UNIMPORTABLE = re.compile(r"__main__|<|\(\)")
"""The names of objects given to the Python API that cannot be imported back (`reroll.api`):
those are checked when the task is built from the objects themselves."""


def agentic_pipeline(config: AgenticConfig, inputs: TaskInputs | None = None) -> run.Run:
    """The run of an agentic config, built (its step: `rl.RLStep` on the environment)."""
    return run.Run(config, inputs)


def train_agentic(config: AgenticConfig, inputs: TaskInputs | None = None) -> dict:
    """Run agentic RL (`reroll.pipelines.run.train`: restarts after a dead worker included)."""
    return run.train(config, inputs)
