"""Sharded data-parallel training with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each of N worker processes holds 1/N of every parameter, gradient and optimizer state; forward
and backward all-gather a layer's parameters just in time. The pipeline gives each rank an equal
shard of the batch and the same loss closure, whose normalisers are counts over the WHOLE batch
(see `reroll.algorithms.aggregation`), so the ranks' losses add up to the global loss: gradients
are therefore summed across ranks (each rank scales its loss by N before FSDP's average), and one step equals the
one-process step on the full batch. gloo on CPU, NCCL on GPUs.

Checkpoints: HF-format full weights written by rank 0 (the same files as `LocalStrategy`), the
optimizer state sharded with torch.distributed.checkpoint (every rank writes its own shard to
`optimizer/`, which must be on storage every rank can reach), and `trainer_state.pt`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.models.logprobs import batched_logprobs
from reroll.models.routing import batched_routing
from reroll.training.local import (
    TRAINER_STATE,
    LossFn,
    enable_gradient_checkpointing,
    lr_lambda,
    optimizer_step,
)
from reroll.training.memory import limit_heap_fragmentation
from reroll.training.offload import OptimizerOffload

OPTIMIZER_DIR = "optimizer"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_process_group() -> str:
    """Join the process group described by MASTER_ADDR/PORT, RANK, WORLD_SIZE (set by the
    executor); NCCL when this process sees a GPU, else gloo. Returns the device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray makes exactly this worker's GPU visible, as index 0
        device, backend = "cuda", "nccl"
    else:
        device, backend = "cpu", "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's decoder layers: `model.model.layers` for a causal LM, the text
    model's (`get_decoder()`: Idefics3's `model.text_model`, Qwen2-VL's `language_model`) for a
    VLM; [] when the model has none we know of."""
    decoder = None
    with contextlib.suppress(AttributeError, NotImplementedError):
        decoder = model.get_decoder()
    decoder = decoder if decoder is not None else getattr(model, "model", None)
    return list(getattr(decoder, "layers", None) or [])


def shard_model(model: torch.nn.Module, param_dtype: str = "float32") -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, norm, tied lm_head and a VLM's
    vision tower). The vision tower stays in the root's unit on purpose: its forward runs only on
    micro-batches with images, and a rank whose rows are text-only would skip the all-gathers of
    its own units that the other ranks wait on (a hang); the root is gathered on every forward."""
    # deferred: importing FSDP takes ~0.5 s, which single-rank policy workers never need
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


class FSDP2Strategy:
    """The `Strategy` of one FSDP2 rank; every rank must make the same calls in the same order."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, train: TrainConfig,
                 total_steps: int, param_dtype: str = "float32"):
        self.device = init_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        enable_gradient_checkpointing(model, train)
        limit_heap_fragmentation(sum(p.numel() for p in model.parameters()))
        self.model = shard_model(model.to(self.device).train(), param_dtype)
        self.train_config = train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optimizer.lr,
                                           betas=optimizer.betas,
                                           weight_decay=optimizer.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, optimizer.warmup_steps, total_steps,
                                                optimizer.schedule, optimizer.min_lr_ratio))
        self.grad_clip = optimizer.grad_clip
        self.optimizer_offload = OptimizerOffload(self.optimizer)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.train_config.bf16_autocast is True:  # `auto` stays float32 here (no device plan)
            return torch.autocast(device_type=self.device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs [B, L] of this rank's shard (all ranks call it with equal-sized shards), a
        routing record in the shard (`routed_experts`) replayed as in `LocalStrategy`."""
        with self.autocast():
            out = batched_logprobs(self.model, batch["input_ids"].to(self.device),
                                   batch["attention_mask"].to(self.device),
                                   self.train_config.micro_batch_size, temperature,
                                   batch["response_mask"].to(self.device),
                                   batch.get("model_inputs"), batch.get("routed_experts"))
        return out.cpu()

    def routing(self, shard: TensorDict) -> torch.Tensor:
        """A mixture-of-experts policy's routing [B, L, layers, k] of this rank's shard now
        (pi_old's, for `algorithm.routing_replay: old_policy`); collective like every forward."""
        with self.autocast():
            return batched_routing(self.model, shard["input_ids"], shard["attention_mask"],
                                   self.train_config.micro_batch_size)

    def train_step(self, shard: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """This rank's part of one optimizer step. `train/loss` is this rank's part of the global
        loss (the caller sums it); other metrics are shard means (the caller averages them);
        `train/grad_norm` is already global."""
        # FSDP averages gradients over ranks, but the ranks' losses are parts of one global
        # loss whose gradients must add up: scale by N (gloo has no pre-multiplied sum). The
        # clipping norm is over all shards (a rank's own norm would be too small).
        return optimizer_step(self, shard, loss_fn, loss_scale=self.world_size, device=self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the unsharded weights on CPU at rank 0 ({} on the other ranks)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def state_dict_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.full_state_dict().items())

    def offload(self) -> int:
        """Move this rank's optimizer shards to host memory while a colocated engine uses the
        device; returns the bytes moved (0 on CPU: see `reroll.distributed.colocation`)."""
        return self.optimizer_offload.offload()

    def reload(self) -> None:
        self.optimizer_offload.reload()

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        weights = self.full_state_dict()
        dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)},
                 checkpoint_id=str(directory / OPTIMIZER_DIR))
        if self.rank == 0:
            self.model.save_pretrained(directory, state_dict=weights)
            torch.save({"scheduler": self.scheduler.state_dict(),
                        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                        "extra": extra}, directory / TRAINER_STATE)
        dist.barrier()

    def load(self, directory: Path) -> dict[str, Any]:
        weights = {}
        for shard in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(shard))
        set_model_state_dict(self.model, weights,
                             options=StateDictOptions(full_state_dict=True, strict=False))
        optimizer = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(optimizer, checkpoint_id=str(directory / OPTIMIZER_DIR))
        set_optimizer_state_dict(self.model, self.optimizer, optimizer["optimizer"])
        state = torch.load(directory / TRAINER_STATE, weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        return state["extra"]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
