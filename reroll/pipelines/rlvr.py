"""RLVR: reinforcement learning with verifiable rewards on prompts.

`PromptTask` is the task: the train and eval prompts (read and checked at start), the reward
runner (math, code, rules, judges, a custom function) and the rollout source that turns a step's
prompts into rewarded groups (sync, or async in the background). The loop and the training step
are the RL pipeline's (`reroll.pipelines.rl`: the loop and the step).
"""

from __future__ import annotations

from typing import Any

import torch

from reroll.config.schema import RLConfig
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptSampler, load_prompts
from reroll.engines.base import Engine, SamplingParams
from reroll.pipelines import rl, run
from reroll.pipelines.domains import DomainTask
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.judge import reward_factory
from reroll.pipelines.roles import remote_reward
from reroll.pipelines.task import EvalSet, grouped, held_out, reward_failures, rollout_row
from reroll.pipelines.validation import check_prompts
from reroll.rewards import build_runner
from reroll.rewards.runner import RewardRunner
from reroll.rollout.async_source import AsyncSource
from reroll.rollout.sampling import RolloutJob, rollout
from reroll.rollout.scheduler import SyncSource
from reroll.rollout.settings import SourceSettings
from reroll.rollout.stream import PromptStream


def build_source(config: RLConfig, engine: Engine, rewards: RewardRunner, tokenizer,
                 stream: PromptStream) -> SyncSource | AsyncSource:
    """The rollout source over `engine`, the engine the roles were built with (in its own process
    when `scheduler.engine_process` says so): asynchronous when `async_training` is on."""
    settings = SourceSettings.of(config, config.data.max_prompt_tokens)
    if config.async_training.enabled:
        return AsyncSource(settings, engine, rewards, tokenizer, stream)
    return SyncSource(settings, engine, rewards, tokenizer, stream)


class PromptTask:
    """Prompts with a reward. Built before the models load: the prompts are read and checked
    whole (templated lengths against `data.max_prompt_tokens` and the model's context, the
    reward's `answer` column), and the reward's workers import their verifier meanwhile
    (math-verify: ~0.5 s), not during the first step."""

    label = ""

    def __init__(self, config: RLConfig, tokenizer, inputs: TaskInputs | None = None):
        """`inputs`: a reward passed as Python objects (`reroll.api.train`) instead of the one
        `config.reward` names (the section then gives its limits)."""
        c = self.config = config
        self.tokenizer = tokenizer
        self.train_rows = load_prompts(c.data.train, c.data.system_prompt)
        self.eval_rows = load_prompts(c.data.eval, c.data.system_prompt)[: c.eval.max_prompts] \
            if c.data.eval else []
        check_prompts(c, tokenizer, {"data.train": self.train_rows, "data.eval": self.eval_rows})
        inputs = inputs or TaskInputs()
        factory = inputs.reward_factory or reward_factory(c.reward, c.seed)
        # With `distributed.reward` placed, the reward is built in Ray actors on its nodes,
        # else here.
        remote = remote_reward(c, factory)
        self.rewards = build_runner(c.reward, remote or factory())
        # `eval.reward`: the held-out prompts are scored by another reward (the true verifier
        # of a run trained on a learned reward), in this process.
        self.eval_rewards = None if c.eval.reward is None or not self.eval_rows else \
            build_runner(c.eval.reward, reward_factory(c.eval.reward, c.seed)())
        self.stream = PromptStream(PromptSampler(self.train_rows, c.seed))
        self.source = None
        self.engine: Engine | None = None
        self.eval_sets: list[EvalSet] = []

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_rows)

    @property
    def eval_what(self) -> str:
        return held_out(len(self.eval_rows), "prompt", self.config.eval.samples_per_prompt)

    def start(self, engine: Engine) -> Engine:
        self.source = build_source(self.config, engine, self.rewards, self.tokenizer, self.stream)
        self.engine = self.source.engine
        return self.engine

    def next_batch(self, step: int, params: SamplingParams) -> list[Trajectory]:
        trajectories = self.source.next_batch(step, step - 1, params)
        self.rewards.check_failure_rate(step)  # a reward that keeps failing stops the run here
        if self.eval_rewards is not None:  # the last evaluation's calls are in this step's window
            self.eval_rewards.check_failure_rate(step)
        return trajectories

    def evaluate(self, params: SamplingParams) -> dict[str, float]:
        """Mean reward on the held-out prompts."""
        c = self.config
        runner = self.eval_rewards or self.rewards
        job = RolloutJob(self.engine, runner, self.tokenizer, params, c.data.max_prompt_tokens)
        n = c.eval.samples_per_prompt
        trajectories = rollout(job, self.eval_rows, n, c.seed, step=-1)
        self.eval_sets = [EvalSet(self.label or "eval", grouped(trajectories, n),
                                  reward_failures(runner))]
        rewards = torch.tensor([t.reward for t in trajectories])
        return {"eval/reward_mean": float(rewards.mean())}

    def metrics(self) -> dict[str, float]:
        metrics = self.rewards.metrics() | self.source.metrics()
        if self.eval_rewards is not None:
            metrics |= {"eval_reward/" + k.removeprefix("reward/"): v
                        for k, v in self.eval_rewards.metrics().items()}
        return metrics

    def record(self, step: int, trajectories: list[Trajectory], count: int) -> list[dict]:
        return [rollout_row(t) for t in trajectories[:count]]

    def state_dict(self) -> dict[str, Any]:
        # The source's position in the prompts (async: the groups it owes the resumed run too).
        state = self.source.state_dict() | {"reward_counters": self.rewards.counter_state()}
        if self.eval_rewards is not None:
            state["eval_reward_counters"] = self.eval_rewards.counter_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.rewards.load_counters(state["reward_counters"])
        if self.eval_rewards is not None and "eval_reward_counters" in state:
            self.eval_rewards.load_counters(state["eval_reward_counters"])

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        self.rewards.close()
        if self.eval_rewards is not None:
            self.eval_rewards.close()


def prompt_task(config: RLConfig, tokenizer, inputs: TaskInputs | None = None):
    """The task of an RLVR config: its prompts and reward, or its domains (`data.domains`)."""
    if config.data.domains is not None:
        return DomainTask(config, tokenizer, inputs)
    return PromptTask(config, tokenizer, inputs)


def rlvr_step(config: RLConfig):
    """The step factory of `pipeline: rlvr` (`reroll.config.pipelines`)."""
    return rl.rl_step(config, prompt_task)


def rlvr_pipeline(config: RLConfig, inputs: TaskInputs | None = None) -> run.Run:
    """The run of an RLVR config, built (its step: `rl.RLStep` on the config's prompts)."""
    return run.Run(config, inputs)


def train(config: RLConfig, inputs: TaskInputs | None = None) -> dict:
    """Run RLVR (`reroll.pipelines.run.train`: restarts after a dead worker included);
    `inputs`: a reward and datasets passed as Python objects (`reroll.api.train`)."""
    return run.train(config, inputs)
