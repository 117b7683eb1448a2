"""Config schemas for every pipeline. Defaults live here and only here.

Every section forbids unknown keys (a typo is an error, never silently dropped), documents each
field in its docstring, and bounds what can be bounded. Cross-field rules that make a run
impossible (a batch that does not split into groups, ...) are validators on the section that
owns both fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)


def choice(key: str, default: str, *options: type[BaseModel]) -> Any:
    """A typed union of config models told apart by the literal field `key`, which defaults to
    `default` when the YAML leaves it out. Used wherever the user picks one algorithm by name."""

    def tag_of(value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get(key, default)
        return getattr(value, key, None)

    tag_of.__name__ = key  # pydantic names the field as "<name>()" in its error messages

    tagged = tuple(Annotated[o, Tag(o.model_fields[key].default)] for o in options)
    return Annotated[tagged[0] if len(tagged) == 1 else _union(tagged), Discriminator(tag_of)]


def _union(types: tuple[Any, ...]) -> Any:
    from functools import reduce
    from operator import or_

    return reduce(or_, types)


# ----------------------------------------------------------------------------------------------
# Shared sections


class ModelConfig(Section):
    path: str
    """A local folder in Hugging Face format (as written by `reroll make-model` or `save_pretrained`),
    or a hub id when the machine has network access."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trained weights. Keep float32 on CPU and use `train.bf16_autocast` for speed."""


class DataConfig(Section):
    train: str
    """Training prompts: a .jsonl or .parquet file with `prompt` and `answer` (or `messages`)."""
    eval: str | None = None
    """Held-out prompts in the same format; evaluated every `eval.every_steps`."""
    system_prompt: str | None = None
    """Prepended as a system message when a row has only `prompt`."""
    max_prompt_tokens: int = Field(256, ge=8)
    """Rows whose templated prompt is longer are reported as an error (never silently cut)."""


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0, le=1.0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (None: no clipping; the norm is still logged)."""


class TrainConfig(Section):
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward pass. Gradients are accumulated so that the update equals
    the full-batch update whatever this is (it trades memory for speed only)."""
    bf16_autocast: bool = False
    """Run forward passes under bfloat16 autocast (weights and optimizer stay float32)."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads for this process (None: all cores). Set it when several processes
    share a machine: oversubscribed threads slow each other down several-fold."""


class CheckpointConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Save `checkpoints/step_N/` every N steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Older checkpoints are deleted, keeping this many (the final one is always kept)."""


class TrackingConfig(Section):
    tensorboard: bool = True
    """Write tensorboard event files to `<run>/tensorboard/`."""
    progress: bool = True
    """Show a rich progress bar with the live reward (off automatically when not a terminal)."""
    record_rollouts: int = Field(8, ge=0)
    """Write this many trajectories of each step to `rollouts/step_N.jsonl` (0: none)."""


# ----------------------------------------------------------------------------------------------
# RL: rollout, reward, algorithm


class RolloutConfig(Section):
    engine: Literal["hf"] = "hf"
    """Inference engine that samples responses: `hf` (transformers, in-process)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled from the dataset per training step."""
    group_size: int = Field(8, ge=1)
    """Responses per prompt (GRPO's group, the `n` of sampling)."""
    max_new_tokens: int = Field(64, ge=1)
    """Maximum response length; longer responses stop with finish reason `length`."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature. Behaviour and training logprobs are both computed at this temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0: no limit)."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine decodes together."""


class MathReward(Section):
    """Correctness checked with math-verify against the row's `answer` (the response's last
    `\\boxed{...}`), plus an optional format bonus."""

    type: Literal["math"] = "math"
    format_weight: float = Field(0.0, ge=0, le=1)
    """Weight of the format reward (a `\\boxed{}` answer present); score = (1-w)*correct + w*format."""
    timeout_s: float = Field(5.0, gt=0)
    """Per-call time limit; a call past it scores 0 and counts in `reward/timeouts`."""
    num_workers: int = Field(1, ge=1, le=64)
    """Processes in the reward pool (math-verify uses signals, which fail in threads)."""


RewardConfig = choice("type", "math", MathReward)


class GRPOAdvantage(Section):
    """Group-normalised outcome reward (DeepSeekMath): (r - mean_group) / (std_group + eps)."""

    name: Literal["grpo"] = "grpo"
    scale_by_std: bool = True
    """Divide by the group std (False gives Dr. GRPO's mean-centred advantage)."""
    eps: float = Field(1e-6, gt=0)


AdvantageConfig = choice("name", "grpo", GRPOAdvantage)


class PPOLoss(Section):
    """PPO's clipped surrogate with separate low/high clip (DAPO's clip-higher) and optional dual clip."""

    name: Literal["ppo"] = "ppo"
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.2, ge=0, le=10)
    dual_clip: float | None = Field(None, gt=1)
    """For negative advantages also bound the loss by `dual_clip * |A|` (Ye et al. 2020); None: off."""


PolicyLossConfig = choice("name", "ppo", PPOLoss)


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of the KL(policy || reference) loss term. 0 turns it off and the reference model
    is not loaded at all."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator (Schulman's 'Approximating KL divergence')."""


class AlgorithmConfig(Section):
    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantage)
    """How rewards become per-token advantages; chosen by `name`."""
    policy_loss: PolicyLossConfig = Field(default_factory=PPOLoss)
    """The policy objective; chosen by `name`."""
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = "token_mean"
    """How per-token losses become one number; normalisers are global over the step's batch."""
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (entropy is always logged)."""
    updates_per_batch: int = Field(1, ge=1, le=16)
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches, one
    step each (PPO mini-batches). With 1 the update is exactly on-policy, so the old logprobs are
    the current ones and no extra forward pass is spent on them."""


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0)
    """Evaluate on `data.eval` every N steps, and always before the first and after the last step
    (0: only before the first and after the last)."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate on the first N eval prompts (None: all)."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses per eval prompt; the reported reward is their mean (mean@k)."""
    temperature: float = Field(0.0, ge=0)
    """0 means greedy decoding."""


class RLConfig(Section):
    """`reroll train CONFIG.yaml`: reinforcement learning with verifiable rewards (RLVR)."""

    pipeline: Literal["rlvr"] = "rlvr"
    name: str = Field("run", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set."""
    output_dir: str | None = None
    seed: int = 0
    """Seeds data order, sampling and initialisation; the same seed reproduces the same run on CPU."""
    steps: int = Field(..., ge=1)
    """Training steps (one rollout batch each)."""
    resume: bool | str = False
    """true: continue from the latest checkpoint of the run directory; a path: from that checkpoint."""
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=MathReward)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> RLConfig:
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.micro_batch_size:
            raise ValueError(
                f"train.micro_batch_size ({self.train.micro_batch_size}) must divide the step's "
                f"batch, rollout.prompts_per_step x rollout.group_size = {batch}"
            )
        if batch % self.algorithm.updates_per_batch:
            raise ValueError(f"algorithm.updates_per_batch ({self.algorithm.updates_per_batch}) "
                             f"must divide the step's batch of {batch} sequences")
        if (batch // self.algorithm.updates_per_batch) % self.train.micro_batch_size:
            raise ValueError("train.micro_batch_size must divide each update's mini-batch "
                             "(batch / algorithm.updates_per_batch)")
        if self.algorithm.advantage.name == "grpo" and self.rollout.group_size < 2:
            raise ValueError("algorithm.advantage grpo needs rollout.group_size >= 2 (a group of "
                             "one response has no baseline)")
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


# ----------------------------------------------------------------------------------------------
# SFT


class SFTData(Section):
    train: str
    """A .jsonl or .parquet file with `prompt` and the target response (see `response_key`), or
    `messages` ending with the assistant's message."""
    eval: str | None = None
    """Held-out rows in the same format; their response NLL is reported before and after."""
    response_key: str = "response"
    """The column holding the target response (falls back to `answer` when absent)."""
    system_prompt: str | None = None
    max_tokens: int = Field(512, ge=8)
    """Rows longer than this after templating are an error naming the row."""


class SFTConfig(Section):
    """`reroll sft CONFIG.yaml`: supervised fine-tuning on response tokens (prompt tokens masked)."""

    pipeline: Literal["sft"] = "sft"
    name: str = Field("sft", min_length=1)
    output_dir: str | None = None
    seed: int = 0
    model: ModelConfig
    data: SFTData
    epochs: float = Field(1.0, gt=0)
    """Passes over the training set (fractions allowed)."""
    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> SFTConfig:
        if self.batch_size % self.train.micro_batch_size:
            raise ValueError(f"train.micro_batch_size ({self.train.micro_batch_size}) must divide "
                             f"batch_size ({self.batch_size})")
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name
