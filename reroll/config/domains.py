"""The sections of a multi-domain RLVR run (`data.domains`): each domain's prompts (files, or a
reasoning-gym task), reward, share and filter."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from reroll.config.algorithm import DynamicSamplingConfig
from reroll.config.base import Section
from reroll.config.rewards import RewardConfig


class ReasoningGymSource(Section):
    """A task of the `reasoning-gym` library, generated procedurally and scored by the
    library's own `score_answer`."""

    task: str = Field(..., min_length=1)
    """The task's name in reasoning-gym (`basic_arithmetic`, `leg_counting`, ...; an unknown
    name is refused at start with the close matches)."""
    size: int = Field(1000, ge=1)
    """Training problems generated (the sampler goes round them epoch after epoch)."""
    seed: int = 0
    """Generator seed of the training problems."""
    eval_size: int = Field(0, ge=0)
    """Held-out problems generated with another seed (`seed + 1000003`); 0: no eval set."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own generator options (reasoning-gym's config fields, e.g. `min_terms`)."""
    answer_format: Literal["tag", "boxed"] = "tag"
    """How the model is asked to give its answer: `tag`: inside `<answer></answer>`;
    `boxed`: in `\\boxed{}`. The instruction is appended to every question."""


class DomainConfig(Section):
    """One domain of a multi-domain run: its prompts, reward, share and filter."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]+$")
    """Names the domain's metrics (`train/<name>/reward_mean`) and its errors."""
    train: str | list[str] | None = None
    """Training prompts: a .jsonl/.parquet file or a list of them (rows as in `data.train`).
    Exactly one of `train` and `reasoning_gym`."""
    eval: str | None = None
    """Held-out prompts of the domain (`eval/<name>/reward_mean`)."""
    reasoning_gym: ReasoningGymSource | None = None
    """Generate the domain's prompts with reasoning-gym instead of reading files."""
    reward: RewardConfig | None = None
    """The domain's reward, any `reward:` type. None: the run's `reward:` section for file
    domains, reasoning-gym's `score_answer` for `reasoning_gym` domains."""
    weight: float = Field(1.0, gt=0)
    """The domain's share of each step's prompts is weight / (sum of the weights)."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """The domain's own dynamic-sampling filter (applied to its groups, refilled from its own
    prompts when `scheduler.refill_filtered`); None: `algorithm.dynamic_sampling`. The run's
    `algorithm.dynamic_sampling`, when set, still applies to the whole batch after it."""
    system_prompt: str | None = None
    """Prepended as a system message to the domain's rows that have only `prompt` (None:
    `data.system_prompt`)."""

    @model_validator(mode="after")
    def _one_source(self) -> DomainConfig:
        if (self.train is None) == (self.reasoning_gym is None):
            raise ValueError(f"domain {self.name!r}: give exactly one of `train` (files) and "
                             f"`reasoning_gym` (a generated task)")
        if self.reasoning_gym is not None and self.eval is not None:
            raise ValueError(f"domain {self.name!r}: a reasoning_gym domain's eval set is "
                             f"generated (reasoning_gym.eval_size), not read from `eval`")
        return self
