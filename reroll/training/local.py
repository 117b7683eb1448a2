"""The one-process training strategy: AdamW, warm-up + cosine/constant schedule, gradient
clipping, micro-batch accumulation, optional bf16 autocast, and exact checkpoints.

A loss function passed to `train_step` must already divide by normalisers computed over the
whole batch (see `reroll.algorithms.aggregation`), so the gradients accumulated over
micro-batches add up to the full-batch gradient, whatever the micro-batch size.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from reroll.config.errors import ConfigError, RunStopped
from reroll.config.lora import LoRAConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.data.batch import split_micro_batches
from reroll.models.files import share_like_siblings
from reroll.models.logprobs import batched_logprobs, load_weights
from reroll.models.lora import LoRAAdapter, is_adapter_dir
from reroll.models.routing import batched_routing
from reroll.training.memory import limit_heap_fragmentation

LossFn = Callable[[torch.nn.Module, TensorDict],
                  tuple[torch.Tensor, dict[str, float | torch.Tensor]]]
"""(model, micro-batch) -> (loss, metrics): a metric is a float or a scalar tensor (read once a
step, `accumulate_gradients`)."""
TRAINER_STATE = "trainer_state.pt"


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def accumulate_gradients(model: torch.nn.Module, batch: TensorDict, loss_fn: LossFn,
                         micro_batch_size: int,
                         autocast: Callable[[], contextlib.AbstractContextManager],
                         loss_scale: float = 1.0, device: torch.device | None = None
                         ) -> tuple[float, dict[str, float]]:
    """Backward of `loss_fn` over the micro-batches of `batch` (gradients add up); returns the
    summed loss and the batch mean of every metric.

    The loss and the metrics given as tensors add up where they are and are read once at the
    end: on a GPU, reading each one per micro-batch would wait for the device every time."""
    totals: dict[str, torch.Tensor | float] = {}
    loss_sum: torch.Tensor | float = 0.0
    for micro in split_micro_batches(batch, micro_batch_size):
        micro = micro.to(device) if device is not None else micro
        with autocast():
            loss, metrics = loss_fn(model, micro)
        (loss * loss_scale).backward()
        loss_sum = loss_sum + loss.detach().float()
        share = micro.batch_size[0] / batch.batch_size[0]
        for key, value in metrics.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            totals[key] = totals.get(key, 0.0) + share * value
    loss_value, *values = read_once([loss_sum, *totals.values()])
    return loss_value, dict(zip(totals, values, strict=True))


def read_once(values: list[torch.Tensor | float]) -> list[float]:
    """Python floats of scalars, the tensors among them read from their device in one copy."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.reshape(()).to(tensors[0].device) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def optimizer_step(strategy: Any, batch: TensorDict, loss_fn: LossFn, loss_scale: float = 1.0,
                   device: torch.device | None = None) -> dict[str, float]:
    """One optimizer step of `strategy` (its model, optimizer, scheduler, grad_clip, train
    config, autocast) over `batch`, accumulated over micro-batches and clipped by the global
    gradient norm (a sharded model's norm is gathered over its shards).

    A non-finite loss or gradient norm skips the step: the gradients are dropped and the weights,
    optimizer and schedule stay as they were; `train/update_skipped` says so (the pipeline counts
    skips in a row and stops the run, `train.max_skipped_updates`)."""
    strategy.model.train()
    strategy.optimizer.zero_grad(set_to_none=True)
    loss_sum, totals = accumulate_gradients(
        strategy.model, batch, loss_fn, strategy.train_config.micro_batch_size,
        strategy.autocast, loss_scale=loss_scale, device=device)
    params = [p for p in strategy.model.parameters() if p.grad is not None]
    max_norm = strategy.grad_clip if strategy.grad_clip is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    bad_loss, bad_norm = nonfinite_flags(loss_sum, grad_norm, device)
    if bad_loss or bad_norm:
        # One NaN step would make every weight (and the optimizer's moments) NaN for good.
        strategy.optimizer.zero_grad(set_to_none=True)
    else:
        strategy.optimizer.step()
        strategy.scheduler.step()
    return {**totals, "train/loss": loss_sum, "train/grad_norm": grad_norm,
            "train/lr": strategy.scheduler.get_last_lr()[0],
            "train/update_skipped": float(bad_loss or bad_norm),
            "train/nonfinite_loss": float(bad_loss), "train/nonfinite_grad_norm": float(bad_norm)}


def nonfinite_flags(loss: float, grad_norm: float, device: torch.device | None
                    ) -> tuple[bool, bool]:
    """(loss non-finite, gradient norm non-finite). Data-parallel ranks agree (any rank's flag
    counts), so that they all skip or all step together and stay identical."""
    flags = torch.tensor([not math.isfinite(loss), not math.isfinite(grad_norm)],
                         dtype=torch.float32, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def adamw(params: list[torch.nn.Parameter], optimizer: OptimizerConfig,
          device: torch.device) -> torch.optim.AdamW:
    """AdamW over `params`; on a GPU its fused kernel: one launch updates every parameter, where
    the default (foreach) launches several per step and op, and a small model's step is bound by
    the host's launches (transformers' Trainer, so TRL, takes the fused one there too). The same
    update up to float rounding; a checkpoint of either loads into the other."""
    return torch.optim.AdamW(params, lr=optimizer.lr, betas=optimizer.betas,
                             weight_decay=optimizer.weight_decay,
                             fused=device.type == "cuda" or None)


def enable_gradient_checkpointing(model: torch.nn.Module, train: TrainConfig) -> None:
    """`train.gradient_checkpointing`: transformers' activation checkpointing, non-reentrant
    (the reentrant variant needs inputs that require grad and breaks with frozen embeddings).
    transformers checkpoints a layer only while the model is in train mode and gradients are
    on, so scoring under no_grad runs as before."""
    if not train.gradient_checkpointing:
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.gradient_checkpointing: {type(model).__name__} does not "
                          f"support activation checkpointing; set it to false")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class LocalStrategy:
    data_parallel_size = 1
    """One process holds the whole batch (see PolicyGroup.data_parallel_size)."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, train: TrainConfig,
                 total_steps: int, device: str = "cpu", autocast_bf16: bool | None = None,
                 lora: LoRAConfig | None = None):
        """`device`: where the model and its micro-batches go (batches come and results return
        on the CPU); `autocast_bf16`: None is `train.bf16_autocast is True` (models.devices plans
        both); `lora`: train a LoRA adapter on the frozen model (`model.lora`)."""
        self.device = torch.device(device)
        # The adapter is injected into `model` itself: the trainer calls the same module.
        self.adapter = LoRAAdapter(model, lora) if lora is not None else None
        self.model = model.to(self.device).train() if self.device.type != "cpu" else model.train()
        self.autocast_bf16 = train.bf16_autocast is True if autocast_bf16 is None else autocast_bf16
        enable_gradient_checkpointing(model, train)
        limit_heap_fragmentation(sum(p.numel() for p in model.parameters()))
        self.train_config = train
        # Only trained parameters get AdamW state (with LoRA: the adapter's, a few MB).
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(trained, optimizer, self.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, optimizer.warmup_steps, total_steps, optimizer.schedule,
                                optimizer.min_lr_ratio))
        self.grad_clip = optimizer.grad_clip

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs [B, L] of every token under the current weights, computed in micro-batches."""
        if self.adapter is not None:
            self.model.eval()  # no adapter dropout in scoring passes (train_step turns it back)
        with self.autocast():
            return batched_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                    self.train_config.micro_batch_size, temperature,
                                    batch["response_mask"], batch.get("model_inputs"),
                                    batch.get("routed_experts"))

    def routing(self, batch: TensorDict) -> torch.Tensor:
        """A mixture-of-experts policy's routing [B, L, layers, k] of the batch under the current
        weights (pi_old's, for `algorithm.routing_replay: old_policy`)."""
        with self.autocast():
            return batched_routing(self.model, batch["input_ids"], batch["attention_mask"],
                                   self.train_config.micro_batch_size)

    def reference_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """With `model.lora`: logprobs [B, L] of the base model, the adapter switched off (the
        reference policy of a KL term, without a second copy of the model)."""
        if self.adapter is None:
            raise RuntimeError("reference_logprobs needs model.lora (the adapter to switch off)")
        with self.adapter.disabled():
            return self.forward_logprobs(batch, temperature)

    def train_step(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over `batch`, accumulated over micro-batches."""
        return optimizer_step(self, batch, loss_fn,
                              device=self.device if self.device.type != "cpu" else None)

    def state_dict_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights under the plain model's names; with LoRA, merged (what the engines
        must hold, and what the weight sync's fingerprint check compares)."""
        if self.adapter is not None:
            return iter(self.adapter.merged_state_dict().items())
        return iter(self.model.state_dict().items())

    def adapter_for_sync(self) -> dict[str, torch.Tensor]:
        """With `model.lora`: the adapter alone, as engines that take adapters merge it
        (`LoRAAdapter.adapter_tensors`)."""
        if self.adapter is None:
            raise RuntimeError("adapter_for_sync needs model.lora")
        return self.adapter.adapter_tensors()

    def save_model(self, directory: Path) -> None:
        """A transformers model folder of the current weights (with LoRA: merged)."""
        if self.adapter is not None:
            self.adapter.save_merged(directory)
        else:
            self.model.save_pretrained(directory)
        share_like_siblings(directory)

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        """HF-format weights (with LoRA: the adapter in PEFT's format) plus optimizer, scheduler,
        RNG states and `extra` (data position, ...). Weights that are not all finite are never
        written (RunStopped)."""
        bad = next((name for name, p in self.model.named_parameters()
                    if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            raise RunStopped(f"checkpoint {directory} not written: parameter {bad} holds NaN/inf")
        directory.mkdir(parents=True, exist_ok=True)
        if self.adapter is not None:
            self.adapter.save(directory)
        else:
            self.model.save_pretrained(directory)
        torch.save({
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "extra": extra,
        }, directory / TRAINER_STATE)

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore everything `save` wrote; returns its `extra`."""
        if self.adapter is not None:
            self.adapter.load(directory)
        elif is_adapter_dir(directory):
            raise ConfigError(f"model.lora is null, but checkpoint {directory} holds a LoRA "
                              f"adapter: resume the run with the model.lora it trained with")
        else:
            weights = {}
            for shard in sorted(directory.glob("*.safetensors")):
                weights.update(load_file(shard))
            load_weights(self.model, weights, f"checkpoint {directory}")
        state = torch.load(directory / TRAINER_STATE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        return state["extra"]
