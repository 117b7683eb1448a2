"""`model.lora`: train a LoRA adapter (PEFT) instead of every weight of the policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from reroll.config.base import Section


class LoRAConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on the policy's linear layers: only the adapter's
    parameters get gradients and optimizer state, the base weights stay frozen. The reference
    of a KL term is the same model with the adapter switched off (no second copy in memory);
    engines receive the adapter alone or the merged weights `W + alpha/rank * B A` (`sync`,
    docs/lora.md)."""

    rank: int = Field(16, ge=1, le=4096)
    """Rank r of each adapter (`A` is r x in, `B` is out x r)."""
    alpha: float = Field(32.0, gt=0)
    """Scale of the adapter's output: `alpha / rank` (or `alpha / sqrt(rank)` with `rslora`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training. Off by default for the same reason as
    `model.dropout`: the trainer's logprobs of a sample should be the ones the engine sampled
    with (scoring passes run without it)."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Which linear layers get an adapter: `all-linear` (every linear layer but the output head),
    or names such as `[q_proj, v_proj]` (the last part of a module's name, or a longer dotted
    suffix). A name the model does not have is an error listing the model's linear layers."""
    vision: bool = False
    """On a vision-language model, adapters on the vision tower and its connector too. Off by
    default: the adapters go on the language model only and the vision side stays frozen (the
    usual VLM RL recipe; images are read as the base model read them)."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale by `alpha / sqrt(rank)` instead of `alpha / rank`."""
    sync: Literal["auto", "adapter", "merged"] = "auto"
    """What each weight sync sends the engines: `adapter` the adapter alone (a few MB; the HF
    engine merges it into its own copy of the base weights, vLLM applies it with its LoRA
    support), `merged` the full merged weights, `auto` the adapter where the engine takes one
    (the HF engine or vLLM, in the trainer's process or in Ray engine actors, reroll's server
    behind `elastic`) and merged weights elsewhere (in-flight updates). `adapter` with an engine
    that cannot take it is an error. docs/lora.md says when each wins."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("name at least one module, or use all-linear")
            bad = [name for name in value if not name or name != name.strip(". ")]
            if bad:
                raise ValueError(f"not a module name: {bad[0]!r}")
        return value
