"""Config schemas of the preference pipelines: `reroll dpo` (the DPO family) and `reroll rm`
(a Bradley–Terry reward model). Both read pairs of `prompt` (or `messages`) + `chosen` +
`rejected` responses."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from reroll.config.base import Section, choice
from reroll.config.schema import RunConfig, TrainConfig


class PreferenceData(Section):
    """Preference pairs: a .jsonl or .parquet file whose rows have `prompt` (or `messages`, the
    conversation before the answer), `chosen` and `rejected` (each a string, or a list holding
    one assistant message). A row with a missing or empty response, or with chosen equal to
    rejected, is an error naming the file and line."""

    train: str
    """Training pairs."""
    eval: str | None = None
    """Held-out pairs: loss, reward margin and preference accuracy are reported on them before
    training, every `eval_every_steps` and at the end."""
    system_prompt: str | None = None
    """Prepended as a system message when a row has only `prompt`."""
    max_tokens: int = Field(512, ge=8)
    """Longest templated prompt + response; a longer pair is an error naming its row."""


class SigmoidLoss(Section):
    """DPO (Rafailov et al. 2023); with `label_smoothing` > 0, conservative DPO (cDPO)."""

    name: Literal["sigmoid"] = "sigmoid"
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL to the reference: the reward is beta * log(pi / pi_ref)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO: the assumed probability that a pair's label is flipped (0: plain DPO)."""


class IPOLoss(Section):
    """IPO (Azar et al. 2023): regress the token-averaged log-ratio margin to 1/(2 beta)."""

    name: Literal["ipo"] = "ipo"
    beta: float = Field(0.1, gt=0)
    """Sets the target margin 1/(2 beta); smaller beta: a larger margin, further from the
    reference."""


class SimPOLoss(Section):
    """SimPO (Meng et al. 2024): reference-free, length-normalised rewards with a target margin."""

    name: Literal["simpo"] = "simpo"
    beta: float = Field(2.0, gt=0)
    """Scale of the reward beta * mean token log-probability."""
    gamma: float = Field(0.5, ge=0)
    """Target reward margin between chosen and rejected."""


class ORPOLoss(Section):
    """ORPO (Hong et al. 2024): reference-free; SFT on the chosen response plus an odds-ratio term."""

    name: Literal["orpo"] = "orpo"
    lam: float = Field(0.1, gt=0)
    """Weight (lambda) of the odds-ratio term against the chosen response's NLL."""


PreferenceLossConfig = choice("name", "sigmoid", SigmoidLoss, IPOLoss, SimPOLoss, ORPOLoss)

REFERENCE_FREE = ("simpo", "orpo")
"""Losses that need no reference model (no reference log-probabilities are computed)."""


class PreferenceRunConfig(RunConfig):
    """What `reroll dpo` and `reroll rm` share: the run, the model, pairs, steps, optimisation."""

    name: str = Field("pref", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    data: PreferenceData
    steps: int | None = Field(None, ge=1)
    """Optimizer steps (the pairs are reshuffled at each pass); wins over `epochs` when set."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training pairs (fractions allowed); used when `steps` is not set."""
    batch_size: int = Field(16, ge=1)
    """Pairs per optimizer step (each pair is two sequences, chosen and rejected)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains (and the reference scores): `auto` is CUDA when torch sees a GPU
    (float32 weights, bf16 autocast where the GPU has it), else CPU; as `distributed.device` in
    RL runs."""
    eval_every_steps: int = Field(0, ge=0)
    """Evaluate the held-out pairs every N steps, besides before the first and after the last
    step (0: only then)."""
    sample_prompts: int = Field(4, ge=0)
    """Held-out prompts (the first of `data.eval`) the policy answers greedily before the first
    and after the last step, kept in `rollouts/eval_step_N.jsonl` for `reroll view`: a model
    that forgot what it knew shows there, whatever its preference accuracy says (0: none;
    `reroll rm` trains a scorer, which answers nothing)."""
    sample_max_new_tokens: int = Field(64, ge=1)
    """Longest sampled answer of `sample_prompts`."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """`train.micro_batch_size` counts sequences (2 per pair): it must be even, so that a pair's
    chosen and rejected responses share a micro-batch (and one forward of their prompt)."""

    @model_validator(mode="after")
    def _check_micro_batches(self) -> PreferenceRunConfig:
        micro = self.train.micro_batch_size
        if micro % 2 or (2 * self.batch_size) % micro:
            raise ValueError(f"train.micro_batch_size ({micro}) must be even and divide the "
                             f"{2 * self.batch_size} sequences of batch_size={self.batch_size} "
                             f"pairs (a pair's two responses share a micro-batch)")
        return self

    def total_steps(self, train_pairs: int) -> int:
        """The run's optimizer steps: `steps`, or `epochs` passes over `train_pairs` pairs."""
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.epochs * train_pairs / self.batch_size))


class DPOConfig(PreferenceRunConfig):
    """`reroll dpo CONFIG.yaml`: direct preference optimisation of the policy on pairs."""

    pipeline: Literal["dpo"] = "dpo"
    """Which pipeline this config is for."""
    name: str = Field("dpo", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    loss: PreferenceLossConfig = Field(default_factory=SigmoidLoss)
    """The preference loss, chosen by `name`: `sigmoid` (DPO; cDPO with label smoothing),
    `ipo`, or the reference-free `simpo` and `orpo`. Its keys are below."""
    reference: str | None = None
    """Folder of the reference model (Hugging Face format, same tokenizer). None: the policy as
    it starts (the usual choice). Its log-probabilities of every pair are computed once before
    training and kept in the run directory (`reference_logprobs.pt`); reference-free losses skip
    this."""


class RMConfig(PreferenceRunConfig):
    """`reroll rm CONFIG.yaml`: a Bradley–Terry reward model (the causal LM with a scalar head),
    saved to `final/` in Hugging Face format, loadable as `AutoModelForSequenceClassification`."""

    pipeline: Literal["rm"] = "rm"
    """Which pipeline this config is for."""
    name: str = Field("rm", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    center_coef: float = Field(0.0, ge=0)
    """Weight of (s_chosen + s_rejected)^2, which keeps the scores centred on 0 (TRL's
    `center_rewards_coefficient`; 0.01 is common). 0: off."""

    @model_validator(mode="after")
    def _whole_model(self) -> RMConfig:
        if self.model.lora is not None:
            raise ValueError("model.lora: `reroll rm` trains the whole reward model (its new "
                             "scalar head with the backbone); remove the lora section")
        return self
