"""What a rollout source reads of a run's config: the narrow sections, not the run config.

A source (`SyncSource`, `AsyncSource`) and the group work it runs take one `SourceSettings`.
The pipeline builds it from its run config once; a domain of a multi-domain run passes its own
seed and dynamic-sampling filter with `dataclasses.replace`, so nothing copies or mutates a
config, and a per-step value (a domain's share of the step) is an argument of `next_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

from reroll.config.algorithm import DynamicSamplingConfig
from reroll.config.scheduling import AsyncTrainingConfig, SchedulerConfig, TailBatchingConfig
from reroll.config.schema import RLRunConfig, RolloutConfig


@dataclass(frozen=True)
class SourceSettings:
    rollout: RolloutConfig
    """Groups per step and their size (`rollout.prompts_per_step`, `rollout.group_size`)."""
    scheduler: SchedulerConfig
    async_training: AsyncTrainingConfig
    tail_batching: TailBatchingConfig
    seed: int
    """The requests' sampling seeds derive from it (a domain's is offset from the run's)."""
    dynamic_sampling: DynamicSamplingConfig | None
    """The keep test of a group (`algorithm.dynamic_sampling`; a domain may set its own)."""
    max_prompt_tokens: int | None = None
    """The prompts' token budget (`data.max_prompt_tokens`); None where the source encodes no
    prompt rows itself (an environment or an agent renders its own prompt)."""

    @classmethod
    def of(cls, config: RLRunConfig, max_prompt_tokens: int | None = None) -> SourceSettings:
        return cls(config.rollout, config.scheduler, config.async_training,
                   config.tail_batching, config.seed, config.algorithm.dynamic_sampling,
                   max_prompt_tokens)

    @property
    def refill_filter(self) -> DynamicSamplingConfig | None:
        """The filter a group must pass to be kept, when dropped groups are refilled
        (`scheduler.refill_filtered`); without refills every group is kept (and filtered
        later, in the step)."""
        return self.dynamic_sampling if self.scheduler.refill_filtered else None

    def prompt_budget(self) -> int:
        if self.max_prompt_tokens is None:
            raise ValueError("this source was built without a prompt budget: it runs no "
                             "prompt rows (an environment or an agent renders the prompts)")
        return self.max_prompt_tokens
