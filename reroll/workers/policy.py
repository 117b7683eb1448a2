"""PolicyWorker: one data-parallel rank of the policy (trainer).

One rank trains with `LocalStrategy`; several ranks shard the model with FSDP2. Every method
is called on all ranks together (the FSDP2 collectives need it); rank 0 returns the full
weights, writes the HF-format checkpoint and, for `weight_sync: broadcast`, broadcasts the
weights to the engines. `offload()`/`reload()` let a colocated engine take the devices in turn.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from reroll.config.lora import LoRAConfig
from reroll.config.schema import OptimizerConfig, TrainConfig
from reroll.distributed.collective import broadcast_buckets, join_group
from reroll.distributed.packing import TensorSlot, pack
from reroll.engines.base import fingerprint
from reroll.models.loading import load_model
from reroll.training.fsdp2 import FSDP2Strategy
from reroll.training.local import LocalStrategy, LossFn
from reroll.training.offload import OptimizerOffload


class PolicyWorker:
    def __init__(self, *, rank: int, world_size: int, model_path: str, dtype: str,
                 optimizer: OptimizerConfig, train: TrainConfig, total_steps: int,
                 param_dtype: str = "float32", attn_implementation: str = "auto",
                 dropout: bool = False, device: str = "cpu", autocast_bf16: bool | None = None,
                 lora: LoRAConfig | None = None):
        self.rank = rank
        model = load_model(model_path, dtype, attn_implementation, dropout)
        if world_size == 1:
            self.strategy: Any = LocalStrategy(model, optimizer, train, total_steps, device,
                                               autocast_bf16, lora)
        else:  # (a LoRA policy has one rank: RLRunConfig refuses more)
            self.strategy = FSDP2Strategy(model, optimizer, train, total_steps, param_dtype)
        # LocalStrategy has no offload of its own; FSDP2Strategy's moves its DTensor shards.
        self.optimizer_offload = getattr(self.strategy, "optimizer_offload", None) \
            or OptimizerOffload(self.strategy.optimizer)
        self.sync_group: Any = None  # the weight-broadcast group with the engines (rank 0 only)
        self._packed: Any = None

    def forward_logprobs(self, shard: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        return self.strategy.forward_logprobs(shard, temperature)

    def routing(self, shard: TensorDict) -> torch.Tensor:
        """A mixture-of-experts policy's routing of the shard (`LocalStrategy.routing`)."""
        return self.strategy.routing(shard)

    def reference_logprobs(self, shard: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """With `model.lora`: the base model's logprobs (the adapter switched off)."""
        return self.strategy.reference_logprobs(shard, temperature)

    def train_step(self, shard: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer_offload.offloaded:
            raise RuntimeError("train_step while the optimizer state is offloaded for a colocated "
                               "engine: the pipeline must take the train turn (reload) first")
        return self.strategy.train_step(shard, loss_fn)

    def offload(self) -> int:
        """Free the devices for a colocated engine; returns the bytes moved (0 on CPU)."""
        return self.optimizer_offload.offload()

    def reload(self) -> None:
        self.optimizer_offload.reload()

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """The full weights at rank 0 ({} elsewhere)."""
        return dict(self.strategy.state_dict_for_sync())

    def adapter_for_sync(self) -> dict[str, torch.Tensor]:
        """With `model.lora`: the adapter alone (one process holds it: LoRA trains in one)."""
        return self.strategy.adapter_for_sync()

    def packed_weights_with_fingerprint(self) -> tuple[Any, Any, str | None]:
        """`packed_weights` plus the fingerprint of exactly those weights."""
        weights = self.state_dict_for_sync()
        if not weights:
            return None, None, None
        slots, flat = pack(weights.items())
        return slots, flat.numpy(), fingerprint(weights.items())

    def weights_fingerprint(self) -> str | None:
        weights = self.state_dict_for_sync()
        return fingerprint(weights.items()) if weights else None

    # -- weight broadcast to the engines (`weight_sync: broadcast`) -------------------------------

    def join_weight_group(self, address: tuple[str, int], world_size: int, backend: str) -> None:
        """Rank 0 (only) hosts the group, as its rank 0; the engines join as ranks 1..N."""
        self.sync_group = join_group(address, 0, world_size, backend)

    def prepare_broadcast(self) -> tuple[list[TensorSlot] | None, str | None]:
        """Collective (every rank gathers its shards): rank 0 packs the full weights for
        `broadcast_weights` and returns their layout and fingerprint."""
        weights = self.state_dict_for_sync()
        if not weights:
            return None, None
        slots, self._packed = pack(weights.items())
        return slots, fingerprint(weights.items())

    def broadcast_weights(self, bucket_bytes: int, backend: str) -> None:
        flat, self._packed = self._packed, None
        broadcast_buckets(self.sync_group, flat, bucket_bytes, backend)

    # -- checkpoints -------------------------------------------------------------------------------

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        with self._state_resident():
            self.strategy.save(directory, extra)

    def load(self, directory: Path) -> dict[str, Any]:
        with self._state_resident():
            return self.strategy.load(directory)

    @contextlib.contextmanager
    def _state_resident(self):
        """Checkpoints read and replace the optimizer state where it trains."""
        offloaded = self.optimizer_offload.offloaded
        self.reload()
        try:
            yield
        finally:
            if offloaded:
                self.offload()

    def close(self) -> None:
        close = getattr(self.strategy, "close", None)
        if close:
            close()
