"""Config schemas for every pipeline. Defaults live here and only here.

Every section forbids unknown keys (a typo is an error, never silently dropped), documents each
field in its docstring, and bounds what can be bounded. Cross-field rules that make a run
impossible (a batch that does not split into groups, ...) are validators on the section that
owns both fields.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from reroll.config.algorithm import AlgorithmConfig
from reroll.config.base import RunSection, Section
from reroll.config.distributed import DistributedConfig
from reroll.config.domains import DomainConfig
from reroll.config.engines import (
    EngineConfig,
    HFEngineConfig,
    ServingEndpointConfig,
    engine_from_sections,
)
from reroll.config.lora import LoRAConfig
from reroll.config.rewards import (  # noqa: F401 - the reward sections, importable from here too
    JUDGE_TEMPLATE,
    CodeReward,
    CustomReward,
    JudgeReward,
    MathReward,
    ModelReward,
    PythonReward,
    RewardConfig,
    RewardSection,
    RulesReward,
)
from reroll.config.scheduling import (
    AsyncTrainingConfig,
    SchedulerConfig,
    TailBatchingConfig,
    scheduling_errors,
)

# ----------------------------------------------------------------------------------------------
# Shared sections


class ModelConfig(Section):
    """The policy model (and its tokenizer, from the same folder)."""

    path: str
    """A local folder in Hugging Face format (as written by `reroll make-model` or `save_pretrained`),
    or a hub id when the machine has network access and `REROLL_ALLOW_HUB=1` is set (otherwise a
    path that is not a local folder is an error at once)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trained weights. Keep float32 and use `train.bf16_autocast` for speed (on a
    GPU, or a CPU with native bf16)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2",
                                 "flash_attention_3"] = "auto"
    """transformers' attention implementation for every role. `auto`: sdpa, unless the model
    declares an attention feature sdpa ignores (Gemma 2's attn_logit_softcapping), then eager. A
    choice that would ignore a declared feature is refused (`reroll check-model` lists them)."""
    dropout: bool = False
    """Keep the model's dropout during training. Off by default: RL needs the trainer's logprobs to
    be the ones the engine sampled with (with GPT-2's 0.1 dropout they differ by up to ~2 nats)."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter instead of all weights (None: full fine-tuning); see docs/lora.md."""


class DataConfig(Section):
    """Prompt datasets: one training set (`train`), or several domains (`domains`)."""

    train: str | None = None
    """Training prompts: a .jsonl or .parquet file with `prompt` and `answer` (or `messages`).
    Required unless `domains` is set (then each domain has its own)."""
    eval: str | None = None
    """Held-out prompts in the same format; evaluated every `eval.every_steps`."""
    system_prompt: str | None = None
    """Prepended as a system message when a row has only `prompt`."""
    max_prompt_tokens: int = Field(256, ge=8)
    """Rows whose templated prompt is longer are refused at start-up, naming the longest row's
    file and line (never silently cut). Every train and eval row is checked when loaded, also
    against the model's context (`max_position_embeddings`) with `rollout.max_new_tokens`; a
    `math` or `code` reward also needs every row's `answer`."""
    max_image_pixels: int | None = Field(None, ge=1)
    """The most pixels (width x height) an image in a row may have (None: no limit of reroll's;
    the model's processor still resizes to its own size). A larger image is handled as
    `oversize_images` says. Every train and eval image is checked when the rows load."""
    oversize_images: Literal["resize", "refuse"] = "resize"
    """An image over `max_image_pixels`: `resize`: scaled down to fit, aspect kept, when the
    processor reads it; `refuse`: the run stops before it starts, naming the row's file and line
    (exit 2)."""
    domains: list[DomainConfig] | None = None
    """Multi-domain RLVR (docs/multidomain.md): several domains trained together, each with its
    prompts (files or a reasoning-gym task), its reward, its share of every step's prompts, its
    eval set and its dynamic-sampling filter; metrics per domain under `train/<name>/` and
    `eval/<name>/`. Replaces `train`/`eval`."""
    reweight: Literal["fixed", "mean_reward"] = "fixed"
    """How the domains share each step's `rollout.prompts_per_step`: `fixed`: in proportion to
    their `weight` (shares that do not divide evenly are carried over, so over steps each
    domain's count stays within one prompt of its share); `mean_reward`: in proportion to
    `weight * max(reweight_floor, 1 - r)` where r is the domain's moving mean train reward
    (rewards in [0, 1]): domains with more left to learn get more prompts."""
    reweight_floor: float = Field(0.1, gt=0, le=1)
    """`mean_reward`: the smallest factor a solved domain's weight is multiplied by."""
    reweight_momentum: float = Field(0.8, ge=0, lt=1)
    """`mean_reward`: r <- momentum * r + (1 - momentum) * the step's mean reward."""

    @model_validator(mode="after")
    def _train_or_domains(self) -> DataConfig:
        if self.domains is None:
            if self.train is None:
                raise ValueError("data.train is required (or data.domains, a list of domains)")
            return self
        if self.train is not None or self.eval is not None:
            raise ValueError("data.train/data.eval and data.domains exclude each other: with "
                             "domains, each domain has its own `train` and `eval`")
        if not self.domains:
            raise ValueError("data.domains is empty")
        names = [d.name for d in self.domains]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.domains: names must be unique ({', '.join(twice)} repeated)")
        return self


class OptimizerConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-5, gt=0, le=1.0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule, as a fraction of `lr`."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (None: no clipping; the norm is still logged)."""


class TrainConfig(Section):
    """How the training strategy runs forward/backward passes."""

    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward pass. Gradients are accumulated so that the update equals
    the full-batch update whatever this is (it trades memory for speed only). Left unset, it
    becomes the largest size up to 16 that splits each worker's mini-batch (SFT: batch) evenly."""
    bf16_autocast: bool | Literal["auto"] = "auto"
    """Run forward and backward passes under bfloat16 autocast (weights and optimizer stay
    float32). auto: on a GPU that computes bf16, float32 on a CPU. true on a CPU is several times
    faster where it has native bf16 (AMX or AVX512-BF16; `reroll check-model` says) and many
    times slower where it has not (a warning says so once)."""

    gradient_checkpointing: bool = False
    """Activation checkpointing of the policy's decoder layers in its training forward
    (transformers' `gradient_checkpointing_enable`, non-reentrant): keeps each layer's input
    instead of all its activations and recomputes them in the backward, ~1/3 more compute for
    several times less memory (16x256 tokens of SmolLM2-135M: see docs/benchmarks.md). Scoring
    without gradients, the reference model and the engines are unaffected."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads for this process. None: every core this process may use, less
    the 1-minute load on them when the run starts (the machine's, by their share of its cores;
    at least 1; a line says so when that is fewer than the cores). Oversubscribed threads slow each other down several-fold: on a busy 2-core machine
    SmolLM2 steps took 95-150 s on every core against ~35 s with 1 thread, so a run whose steps
    meet a load a core beyond its cores says once that `num_threads: 1` is often faster. Set it
    to fix the count (unset with OMP_NUM_THREADS exported: torch follows that, nothing is
    detected)."""
    max_skipped_updates: int = Field(3, ge=1)
    """An optimizer update whose loss or gradient norm is NaN/inf is skipped (weights untouched,
    counted in `train/skipped_updates`); this many skipped in a row stop the run (exit 1)."""

    def fit_unset_micro_batch(self, share: int) -> None:
        """A small batch (2 prompts x 4 samples, 20 SFT rows) should not fail on a default the
        user never wrote: an unset micro-batch size shrinks to the largest divisor of `share`,
        the sequences one worker trains on per update."""
        if "micro_batch_size" not in self.model_fields_set:
            self.micro_batch_size = max(d for d in range(1, 17) if share % d == 0)


class CheckpointConfig(Section):
    """When to write `checkpoints/step_N/` (HF weights + trainer state, for resume)."""

    every_steps: int | None = Field(None, ge=0)
    """Save `checkpoints/step_N/` every N steps (0: only at the end). None: about every tenth of
    the run, at least every 50 steps (every step of a run under 20), so that a run stopped
    early has a recent checkpoint to resume from."""

    def every(self, steps: int) -> int:
        """The cadence of a run of `steps` steps (0: only the last)."""
        if self.every_steps is not None:
            return self.every_steps
        return max(1, min(50, steps // 10))
    keep_last: int = Field(2, ge=1)
    """Older checkpoints are deleted, keeping this many (the final one is always kept); those of
    `keep_steps` are kept besides and do not count here."""
    keep_steps: list[int] = Field(default_factory=list)
    """Steps whose checkpoints are written (whatever `every_steps` says) and never deleted. For
    `reroll replay RUN --step N`, which starts from the checkpoint of step N-1: the arithmetic
    demo keeps `[10, 20]` so that its documented `--step 11` and `--step 21` work. Steps past
    `steps` are ignored."""

    @model_validator(mode="after")
    def _positive_steps(self) -> CheckpointConfig:
        bad = [s for s in self.keep_steps if s < 1]
        if bad:
            raise ValueError(f"checkpoint.keep_steps: steps count from 1 (got {bad})")
        return self


class TrackingConfig(Section):
    """Where metrics and rollouts go (metrics.jsonl is always written)."""

    tensorboard: bool = True
    """Write tensorboard event files to `<run>/tensorboard/`."""
    wandb: bool = False
    """Also log to Weights & Biases (run files under `<run>/wandb/`). A tracker that fails to
    start stops the run with an error naming it."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: no network, upload later with `wandb sync <run>/wandb/offline-run-*`; online:
    stream to the wandb server (needs `wandb login`)."""
    wandb_entity: str | None = None
    """wandb team or user to log under (None: your default entity)."""
    trackio: bool = False
    """Also log to trackio (a local database, `trackio show --project <project>` to browse)."""
    trackio_space_id: str | None = None
    """Hugging Face Space to sync the trackio logs to (needs network); None: local only."""
    project: str = Field("reroll", min_length=1)
    """Project name in wandb and trackio; the run's name there is the config's `name`."""
    progress: bool = True
    """Show progress with the live reward: a rich bar on a terminal; when stderr is not a
    terminal (a log file, a pipe), a plain line (step/total, reward, elapsed, eta) at the first
    and last step, every tenth of the run and at least every 30 s. Before the first step, a line
    as each phase starts (`reroll: ...` loading the model, evaluating the held-out set before
    step 1, step 1's first phase), which can take minutes. false: none of it."""
    record_rollouts: int = Field(8, ge=0)
    """Write this many trajectories of each step, as text, to `rollouts/step_N.jsonl` for
    `reroll view` (0: none)."""
    record_eval_rollouts: int = Field(64, ge=0)
    """Write up to this many held-out samples of each evaluation (in the eval set's order, so a
    prompt can be followed from one evaluation to the next) to `rollouts/eval_step_N.jsonl`,
    shown beside the training rollouts by `reroll view` (0: none). Step 0 is before training."""
    record_batch_every: int = Field(1, ge=0)
    """Every N steps, store the step's whole batch (token ids, behaviour logprobs, rewards) in
    `rollouts/step_N.batch.pt`, so `reroll replay --step N` can recompute its losses (0: never).
    About 12 bytes per token; raise N to bound disk use on long runs."""


# ----------------------------------------------------------------------------------------------
# RL: rollout, reward, algorithm


class RolloutConfig(Section):
    """How responses are sampled for training."""

    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """Inference engine that samples responses, chosen by `type`: `hf` (transformers, in-process,
    any machine), `vllm` (vLLM's async engine; `make vllm` installs it on CPU) or `remote`
    (OpenAI-compatible endpoints; evaluation only), each with its own settings. `engine: vllm`
    alone picks one with its defaults; the earlier `engine: vllm` + `vllm:` section form still
    loads. See docs/engines.md."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled from the dataset per training step."""
    group_size: int = Field(8, ge=1)
    """Responses per prompt (GRPO's group, the `n` of sampling)."""
    max_new_tokens: int = Field(64, ge=1)
    """Maximum response length; longer responses stop with finish reason `length`."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature. Behaviour and training logprobs are both computed at this temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0: no limit)."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine decodes together."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype the `hf` and `vllm` engines hold their weights in (auto: `model.dtype`). bfloat16
    halves the bytes read per decoding step (on CPU, decoding is bound by reading the weights)
    while training stays in `model.dtype`; weights synced from the trainer are cast on load.
    Behaviour logprobs then differ from the trainer's by bf16 rounding (see docs/engines.md);
    decoupled_ppo or `algorithm.correction` account for it."""
    serving_endpoint: ServingEndpointConfig | None = None
    """ROSE: also generate on a serving endpoint's spare capacity, within its latency objective
    (None: the rollout engine alone). Not with `engine: remote`."""

    @model_validator(mode="after")
    def _lending_needs_an_owned_engine(self) -> RolloutConfig:
        if self.serving_endpoint is not None and self.engine.type == "remote":
            raise ValueError("rollout.serving_endpoint lends rollouts beside an hf or vllm "
                             "engine; with engine: remote list the endpoint there instead")
        return self

    @model_validator(mode="before")
    @classmethod
    def _engine_sections(cls, data: Any) -> Any:
        return engine_from_sections(data)


class EvalConfig(Section):
    """Held-out evaluation (mean reward): on `data.eval` in RLVR runs, on `env.eval_episodes`
    episodes with held-out seeds in agentic runs."""

    every_steps: int = Field(10, ge=0)
    """Evaluate every N steps, and always before the first and after the last step (0: only
    before the first and after the last). RLVR runs without `data.eval` never evaluate."""
    max_prompts: int | None = Field(None, ge=1)
    """RLVR: evaluate on the first N prompts of `data.eval` (None: all). Agentic runs set the
    number of episodes with `env.eval_episodes` instead."""
    samples_per_prompt: int = Field(1, ge=1)
    """Responses per eval prompt (agentic: per eval episode seed); the reported reward is their
    mean (mean@k)."""
    temperature: float = Field(0.0, ge=0)
    """0 means greedy decoding."""


class PromptEvalConfig(EvalConfig):
    """Held-out evaluation of an RLVR run (mean reward on `data.eval`)."""

    reward: RewardConfig | None = None
    """The reward of the held-out evaluation, when it is not the training reward (None: the
    run's `reward`). A run trained on a learned reward (`type: model` or `judge`) is measured
    here by the true verifier (`type: math`), so `eval/reward_mean` says whether the learned
    reward taught the task. Same keys as `reward`; its calls are counted in `eval_reward/*`
    and bounded by its own `max_failure_rate_*`. Not with `data.domains` (each domain has its
    own reward)."""


class RunConfig(RunSection):
    """What every pipeline's config has (RL, SFT, distillation, DPO, reward models): the run and
    its directory, the model, the optimisation, checkpoints and tracking. The loop that reads
    them is one for all (`reroll.pipelines.run`)."""

    pipeline: str
    """Which pipeline this config is for."""
    name: str = Field("run", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    output_dir: str | None = None
    """Run directory (default `runs/<name>/`); SFT, distillation, DPO and RM runs save the
    trained model to its `final/`."""
    seed: int = 0
    """Seeds data order, sampling and initialisation; the same seed reproduces the same run on CPU."""
    resume: bool | str = False
    """true: continue from the newest complete checkpoint of the run directory (data order,
    optimizer, schedule and RNG included: the resumed run is the uninterrupted one step for step;
    an async run trains the same prompts, its unfinished groups regenerated (docs/async.md);
    incomplete checkpoints are skipped with a message); a path: from that checkpoint. A run whose
    checkpoint is already at its last step is reported as finished and left unchanged; fewer
    steps than done is an error."""
    overwrite: bool = False
    """A run directory that already holds files is refused unless `resume` is set or this is
    true, which deletes the old run's files first (only in a reroll run directory)."""
    model: ModelConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """`checkpoints/step_N/` (weights and trainer state, for `resume`)."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    def max_restarts(self) -> int:
        """Restarts after a dead worker process (`distributed.max_restarts` in RL runs)."""
        return 0


class RLRunConfig(RunConfig):
    """What every RL pipeline's config has: the run, the model and its roles, the algorithm, the
    optimisation, scheduling (`scheduler`, `async_training`, `tail_batching`), evaluation,
    checkpoints and tracking. The task is a tagged union whose tag is `pipeline`: `rlvr`
    (`RLConfig`: prompts, `data.train`, or domains, `data.domains`) or `agentic`
    (`AgenticConfig`: one environment, `env`, several, `envs`, or an agent program, `agent`);
    exactly one variant per config. The rollout sources read only the narrow sections they use
    (`reroll.rollout.settings.SourceSettings`)."""

    steps: int = Field(..., ge=1)
    """Training steps (one rollout batch each)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """How responses are sampled. Agentic runs: `prompts_per_step` env resets (groups) per step,
    `group_size` episodes per reset, `max_new_tokens` the limit of one turn."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator, policy loss, KL, filters and corrections (docs/algorithms.md); agentic
    runs also have turn-level credit assignment: `rebn`, `gigpo`, `ipa_chunk`."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    """Rollout runs on while the trainer updates (docs/async.md): a step's prompts (RLVR) or
    episodes (agentic) up to `max_staleness` weight versions old are trained on."""
    tail_batching: TailBatchingConfig = Field(default_factory=TailBatchingConfig)

    def max_restarts(self) -> int:
        return self.distributed.max_restarts

    def batch_errors(self) -> list[str]:
        """The step's batch must split into updates, data-parallel shards and micro-batches."""
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        self._fit_default_micro_batch(batch)
        updates, micro = self.algorithm.updates_per_batch, self.train.micro_batch_size
        shards = self.distributed.policy.num_workers * micro
        if batch % updates:
            return [f"algorithm.updates_per_batch ({updates}) must divide the step's batch, "
                    f"rollout.prompts_per_step x rollout.group_size = {batch} sequences"]
        if (batch // updates) % shards:
            return [f"each update's mini-batch ({batch // updates} sequences = rollout."
                    f"prompts_per_step x rollout.group_size / algorithm.updates_per_batch) must "
                    f"split evenly into distributed.policy.num_workers x train.micro_batch_size "
                    f"= {shards}"]
        return self.algorithm.rollout_errors(self.rollout.group_size, self.rollout.max_new_tokens)

    def _fit_default_micro_batch(self, batch: int) -> None:
        workers = self.distributed.policy.num_workers
        if batch % (self.algorithm.updates_per_batch * workers) == 0:  # else batch_errors says so
            self.train.fit_unset_micro_batch(batch // self.algorithm.updates_per_batch // workers)

    def off_policy_reasons(self) -> list[str]:
        """Why the trained samples can come from a distribution other than the trainer's pi_old
        (empty: they are on-policy up to float noise); `algorithm.correction.auto` reads it."""
        engine = self.rollout.engine.type
        reasons = [f"rollout.engine: {engine} samples with its own logprobs"] \
            if engine != "hf" else []
        if self.async_training.enabled:
            reasons.append(f"async_training trains on samples up to "
                           f"{self.async_training.max_staleness} versions old")
        return reasons

    @model_validator(mode="after")
    def _resolve_correction(self) -> RLRunConfig:
        if self.rollout.engine.type == "remote":
            raise ValueError("rollout.engine: remote cannot train: reroll cannot push the trained "
                             "weights to remote endpoints (the first weight sync would fail). Use "
                             "rollout.engine: hf or vllm, and keep remote endpoints for `reroll "
                             "eval`, judges and teachers")
        self.algorithm.resolve_correction(self.off_policy_reasons())
        if self.algorithm.routing_replay == "rollout" and self.rollout.engine.type != "hf":
            raise ValueError(f"algorithm.routing_replay: rollout replays the experts the engine "
                             f"routed, which only the hf engine records (rollout.engine: "
                             f"{self.rollout.engine.type} does not expose them, docs/moe.md): use "
                             f"rollout.engine: hf, or routing_replay: off")
        if self.model.lora is not None and self.distributed.policy.num_workers > 1:
            raise ValueError("model.lora trains in one policy process: set "
                             "distributed.policy.num_workers: 1 (FSDP2 sharding of a LoRA "
                             "policy is not supported yet)")
        if self.distributed.weight_sync == "delta" and self.rollout.engine.type != "hf":
            raise ValueError(f"distributed.weight_sync: delta patches the weights the engine "
                             f"holds, which only the hf engine exposes (rollout.engine: "
                             f"{self.rollout.engine.type} keeps them in its own process): use "
                             f"rollout.engine: hf, or weight_sync: auto")
        return self


class RLConfig(RLRunConfig):
    """`reroll train CONFIG.yaml`: reinforcement learning with verifiable rewards (RLVR)."""

    pipeline: Literal["rlvr"] = "rlvr"
    """Which pipeline this config is for."""
    data: DataConfig
    eval: PromptEvalConfig = Field(default_factory=PromptEvalConfig)
    reward: RewardConfig = Field(default_factory=MathReward)
    """How a response is scored, chosen by `type`: `math` (default; math-verify against the
    row's `answer`), `code` (the row's tests run in the sandbox), `custom` (your function,
    `module:function`; the contract is in docs/rewards.md), `model` (a reward model's score,
    docs/preferences.md) or `judge` (an LLM judge's verdict). Each type's keys are below."""

    def domain_errors(self) -> list[str]:
        """What multi-domain runs cannot combine with: tail batching's rounds defer a domain's
        long prompts out of the step the mixer gave them to."""
        if self.data.domains is None:
            return []
        if self.eval.reward is not None:
            return ["eval.reward cannot be combined with data.domains: each domain's eval set "
                    "is scored by that domain's reward (data.domains[].reward)"]
        if self.tail_batching.enabled:
            return ["data.domains cannot be combined with tail_batching.enabled (it defers long "
                    "prompts to rounds of their own, out of the step whose share the domain "
                    "mixer gave them to); turn it off, or use async_training for long tails"]
        return []

    @model_validator(mode="after")
    def _check_combinations(self) -> RLConfig:
        problems = self.batch_errors() + scheduling_errors(self) + self.domain_errors()
        if self.distributed.env is not None:
            problems.append("distributed.env places environments, which only agentic runs have "
                            "(pipeline: agentic); remove it")
        if problems:
            raise ValueError("; ".join(problems))
        return self


# ----------------------------------------------------------------------------------------------
# SFT


class SFTData(Section):
    """SFT datasets."""

    train: str
    """A .jsonl or .parquet file with `prompt` and the target response (see `response_key`), or
    `messages` ending with the assistant's message. A multi-turn `messages` row (several
    assistant turns, OpenAI-style `tool_calls` and `tool` results, a `tools` column of
    schemas) trains every assistant turn, the rest masked (docs/agentic.md, "Multi-turn SFT
    data")."""
    eval: str | None = None
    """Held-out rows in the same format; their response NLL is reported before and after."""
    response_key: str = "response"
    """The column holding the target response (falls back to `answer` when absent)."""
    system_prompt: str | None = None
    """Prepended as a system message when a row has only `prompt`."""
    max_tokens: int = Field(512, ge=8)
    """Rows longer than this after templating are an error naming the row."""
    train_turns: Literal["auto", "all", "last"] = "auto"
    """Which assistant turns of a `messages` row are trained: `all` (every assistant turn, the
    rest masked), `last` (only the final message, the earlier turns are its prompt), or `auto`:
    all for a tool conversation (tool calls, tool results or a `tools` column), the last for a
    plain chat, whose earlier turns are usually a prefix that other rows train (the per-turn rows
    of `reroll make-episodes` for an env without tools)."""


class SFTConfig(RunConfig):
    """`reroll sft CONFIG.yaml`: supervised fine-tuning on response tokens (prompt tokens masked)."""

    pipeline: Literal["sft"] = "sft"
    """Which pipeline this config is for."""
    name: str = Field("sft", min_length=1)
    """Run name; the run directory is `runs/<name>/` unless `output_dir` is set, whose folder
    name is then the default name."""
    data: SFTData
    steps: int | None = Field(None, ge=1)
    """Optimizer steps of the run (the data is reshuffled at each pass); when set it wins over
    `epochs` (e.g. `reroll sft CONFIG.yaml steps=50`). None: as many as `epochs` take."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training set (fractions allowed); used when `steps` is not set."""
    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model trains: `auto` is CUDA when torch sees a GPU (float32 weights, bf16
    autocast where the GPU has it), else CPU; as `distributed.device` in RL runs."""

    @model_validator(mode="after")
    def _check_combinations(self) -> SFTConfig:
        self.train.fit_unset_micro_batch(self.batch_size)
        if self.batch_size % self.train.micro_batch_size:
            raise ValueError(f"train.micro_batch_size ({self.train.micro_batch_size}) must divide "
                             f"batch_size ({self.batch_size})")
        return self

    def total_steps(self, train_rows: int) -> int:
        """The run's optimizer steps: `steps`, or `epochs` passes over `train_rows` rows."""
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.epochs * train_rows / self.batch_size))
