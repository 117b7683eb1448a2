"""Agentic RL: the policy acts over many turns in an environment and learns from the outcome.

The step is RLVR's (`RLVRPipeline`): generate -> make_batch (collate, filter, score, estimate)
-> update -> sync_weights -> evaluate/record/checkpoint. Only what differs lives here:
trajectories come from multi-turn episodes (`reroll.rollout.agent_loop`), each with its turn
boundaries and per-turn rewards, so the catalogue's credit assignment applies as configured:
`grpo` on episode returns (StarPO-style trajectory level), `rebn` (per-turn discounted returns,
batch-normalised), `gigpo` (episode + anchor-state step advantages) and `ipa_chunk` (discounted
chunk-level returns with a per-chunk ratio). Evaluation reports the mean return and the success
rate on held-out env seeds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from reroll.config.agentic import AgenticConfig
from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.data.datasets import PromptSampler
from reroll.engines.base import Engine, SamplingParams
from reroll.envs import ChatFormat, make_env
from reroll.pipelines.common import RunDir
from reroll.pipelines.inputs import TaskInputs
from reroll.pipelines.rlvr import RLVRPipeline
from reroll.rollout.agent_loop import AgentJob, AgentStats, run_episodes
from reroll.tracking.jsonsafe import dumps

EVAL_SEED_BASE = 10**9


def check_history(tokenizer, system_prompt: str | None, history_thinking: str | None) -> None:
    """At start: a chat template that renders earlier turns otherwise than the agent loop
    records them (Qwen3's drops their reasoning) needs an explicit `env.history_thinking`."""
    if history_thinking == "strip":
        raise ConfigError("env.history_thinking: strip gives one training sample per turn, a "
                          "number that varies by episode; this pipeline's group advantages "
                          "need rollout.group_size samples per env seed, so it trains with "
                          "keep only (strip works in the agent loop, AgentJob)")
    problem = ChatFormat(tokenizer, system_prompt).history_mismatch()
    if problem is not None and history_thinking is None:
        raise ConfigError(f"env.history_thinking: {problem}. Set env.history_thinking: keep to "
                          "train on the tokens as generated (earlier reasoning stays in later "
                          "contexts, unlike what template-based inference shows the model); "
                          "see docs/agentic.md")


class EpisodeSource:
    """Runs a step's episodes; stands in for RLVR's rollout source and reward runner (the env
    is both), with counters that survive a resume."""

    def __init__(self, config: AgenticConfig, engine: Engine, tokenizer,
                 env_factory: Callable[[], Any] | None = None):
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.counters = SimpleNamespace(episodes=0, env_errors=0)
        self._metrics: dict[str, float] = {}
        env = config.env
        # `env_factory`: an environment passed as a Python object (reroll.api)
        self.make_env = env_factory or (lambda: make_env(env.id, **env.kwargs))
        self.make_env()  # a bad id or argument fails at start-up, not mid-run
        check_history(tokenizer, env.system_prompt, env.history_thinking)

    def job(self, params: SamplingParams) -> AgentJob:
        env = self.config.env
        return AgentJob(self.engine, self.tokenizer, self.make_env,
                        params, max_turns=env.max_turns,
                        max_context_tokens=env.max_context_tokens,
                        step_timeout_s=env.step_timeout_s, system_prompt=env.system_prompt,
                        history_thinking=env.history_thinking or "keep")

    def run(self, seeds: list[int], group_size: int, params: SamplingParams, step: int,
            redundancy: int = 0) -> tuple[list[Trajectory], AgentStats]:
        trajectories, stats = run_episodes(self.job(params), seeds, group_size, self.config.seed,
                                           step, redundancy)
        self.counters.episodes += stats.episodes
        self.counters.env_errors += stats.env_errors
        return trajectories, stats

    def record_step(self, stats: AgentStats, trajectories: list[Trajectory]) -> None:
        success = [t.reward_info.get("success", False) for t in trajectories]
        self._metrics = stats.metrics() | {
            "train/success_rate": sum(success) / max(len(success), 1),
            "env/errors_total": float(self.counters.env_errors)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def load_counters(self, state: dict[str, int]) -> None:
        vars(self.counters).update(state)

    def close(self) -> None:
        pass


class AgenticPipeline(RLVRPipeline):
    def start_rewards(self) -> None:
        """None: the environment is the reward (set up with the task)."""
        return None

    def load_task_data(self) -> None:
        """No prompt files: the episodes come from the environment."""

    def setup_task(self) -> None:
        """The task is an environment: env seeds instead of prompts, and the env is the reward."""
        c = self.config
        self.sampler = PromptSampler(list(range(c.env.train_seeds)), c.seed)  # env seeds
        self.eval_rows = [EVAL_SEED_BASE + i for i in range(c.env.eval_episodes)]
        self.source = self.rewards = EpisodeSource(c, self.engine, self.tokenizer,
                                                   self.inputs.env_factory)

    def method_name(self) -> str:
        return f"{self.config.env.id} {super().method_name()}"

    def sampling_params(self, temperature: float, top_p: float = 1.0, top_k: int = 0
                        ) -> SamplingParams:
        return SamplingParams(self.config.rollout.max_new_tokens, temperature, top_p, top_k,
                              self.stop_ids)

    def generate(self, step: int) -> list[Trajectory]:
        """A group of episodes for each of this step's env seeds."""
        c = self.config
        self.turns.rollout_turn()
        t0 = time.perf_counter()
        seeds = self.sampler.next_batch(c.rollout.prompts_per_step)
        params = self.sampling_params(c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)
        trajectories, stats = self.source.run(seeds, c.rollout.group_size, params, step,
                                              c.env.redundancy)
        self.source.record_step(stats, trajectories)
        self._rollout_s = time.perf_counter() - t0
        return trajectories

    def evaluate(self) -> dict[str, float]:
        """Mean return and success rate on the held-out env seeds (the same sampling seeds at
        every evaluation)."""
        c = self.config
        if not self.eval_rows:
            return {}
        self.turns.rollout_turn()
        params = self.sampling_params(c.eval.temperature)
        trajectories, stats = self.source.run(self.eval_rows, c.eval.samples_per_prompt, params,
                                              step=-1)
        returns = torch.tensor([t.reward for t in trajectories])
        success = torch.tensor([float(t.reward_info.get("success", False)) for t in trajectories])
        return {"eval/reward_mean": float(returns.mean()), "eval/success_rate": float(success.mean()),
                "eval/turns_mean": stats.metrics()["env/turns_mean"]}

    def record(self, step: int, trajectories: list[Trajectory]) -> None:
        """`rollouts/step_N.jsonl`: RLVR's row plus `segments`, the episode as text segments
        (policy tokens vs environment tokens, with their turn) for the run viewer."""
        count = self.config.tracking.record_rollouts
        if not count:
            return
        folder = self.run_dir.path / "rollouts"
        folder.mkdir(exist_ok=True)
        picked = random.Random(step).sample(trajectories, min(count, len(trajectories)))
        with (folder / f"step_{step}.jsonl").open("w") as f:
            for t in picked:
                f.write(dumps({"prompt": t.prompt_text, "response": t.response_text,
                                    "answer": t.answer, "reward": t.reward,
                                    "reward_info": t.reward_info,
                                    "finish_reason": t.finish_reason, "group_id": t.group_id,
                                    "segments": t.segments}) + "\n")


def train_agentic(config: AgenticConfig, inputs: TaskInputs | None = None) -> dict:
    """`inputs`: an environment passed as a Python object (`reroll.api.train`)."""
    done = RunDir(config.run_dir()).finished_summary(config.resume, config.steps)
    return done if done is not None else AgenticPipeline(config, inputs).run()
