"""Config of the agentic pipeline (`pipeline: agentic`): multi-turn episodes in an environment
instead of prompts and a reward function. The other sections are RLVR's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from reroll.config.algorithm import AlgorithmConfig
from reroll.config.base import Section
from reroll.config.distributed import DistributedConfig
from reroll.config.schema import (
    CheckpointConfig,
    EvalConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    TrackingConfig,
    TrainConfig,
)


class EnvConfig(Section):
    """The environment episodes run in, and the limits of an episode."""

    id: str = Field(..., min_length=1)
    """A built-in environment (`reroll envs` lists them) or `gem:<id>` for a gem-llm one."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor (e.g. `high: 8` for guess_number)."""
    max_turns: int = Field(8, ge=1, le=1000)
    """Most model turns per episode (the env may end it earlier)."""
    max_context_tokens: int = Field(512, ge=16)
    """First prompt plus every turn's tokens; an episode that would grow past it ends cleanly
    with finish reason `length`."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Limit of one env reset or step; past it the episode fails (`env/errors`), the run goes on."""
    system_prompt: str | None = None
    """Prepended as a system message to every episode."""
    train_seeds: int = Field(100_000, ge=1)
    """Training episodes reset the env with seeds drawn from [0, train_seeds)."""
    eval_episodes: int = Field(32, ge=0)
    """Held-out episodes per evaluation, with seeds from 10^9 upwards (never used in training)."""
    redundancy: int = Field(0, ge=0)
    """Extra episodes started per group; the first `rollout.group_size` to finish are kept and
    the rest aborted (ROLL's redundant environments)."""


class AgenticConfig(Section):
    """`reroll train CONFIG.yaml` with `pipeline: agentic`: RL on multi-turn environment episodes."""

    pipeline: Literal["agentic"] = "agentic"
    """Which pipeline this config is for."""
    name: str = Field("agentic", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set."""
    output_dir: str | None = None
    """Run directory (default `runs/<name>/`)."""
    seed: int = 0
    """Seeds env seeds, sampling and initialisation; the same seed reproduces the run on CPU."""
    steps: int = Field(..., ge=1)
    """Training steps (one batch of episodes each)."""
    resume: bool | str = False
    """true: continue from the latest checkpoint of the run directory; a path: from that checkpoint."""
    model: ModelConfig
    env: EnvConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """`prompts_per_step` is the number of env resets (groups) per step, `group_size` the episodes
    per reset, `max_new_tokens` the limit of one turn."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Credit assignment: `grpo` on episode returns (trajectory level), `rebn`, `gigpo`,
    `ipa_chunk` (turn level); see docs/agentic.md."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _check_batch(self) -> AgenticConfig:
        episodes = self.rollout.prompts_per_step * self.rollout.group_size
        mini, rest = divmod(episodes, self.algorithm.updates_per_batch)
        if rest or mini % self.train.micro_batch_size:
            raise ValueError(
                f"the step's {episodes} episodes (rollout.prompts_per_step x rollout.group_size) "
                f"must split into algorithm.updates_per_batch ({self.algorithm.updates_per_batch}) "
                f"mini-batches of whole train.micro_batch_size ({self.train.micro_batch_size}) "
                f"chunks")
        problems = self.algorithm.rollout_errors(self.rollout.group_size,
                                                 self.rollout.max_new_tokens)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name
