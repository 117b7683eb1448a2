"""What the RL step asks of its trained and frozen models, whatever hosts them.

A role is one object in this process (`LocalStrategy`, `training.critic.LocalCritic`) or a group of
workers behind a `Cluster` (local or Ray actors); the step (`reroll.pipelines.rl`) sees only
these protocols, so go-to-definition on `policy.train_step` lands here, and a new host only has
to provide these methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from reroll.training.local import LossFn


@runtime_checkable
class Policy(Protocol):
    """The trained policy (DESIGN's `Strategy`)."""

    @property
    def data_parallel_size(self) -> int:
        """Ranks a batch is split over; a trained batch must hold a multiple of it."""
        ...

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Per-token logprobs [B, T] of the batch's tokens under the current weights (no grad)."""
        ...

    def train_step(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on `batch` (micro-batched inside); `loss_fn(model, micro)` returns
        (loss, metrics). Returns the step's metrics (`train/loss`, `train/grad_norm`, ...)."""
        ...

    def state_dict_for_sync(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of the full weights, as the engine loads them."""
        ...

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        """HF-format weights plus the trainer state (optimizer, scheduler, RNG, `extra`)."""
        ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore what `save` wrote; returns its `extra`."""
        ...


@runtime_checkable
class Reference(Protocol):
    """The frozen reference policy of a KL term."""

    def logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Per-token logprobs [B, T] of the batch's tokens under the reference weights."""
        ...


class Teacher(Reference, Protocol):
    """On-policy distillation's teacher: a reference over the teacher's weights that also gives
    its top-k next-token distribution (`algorithm.distill.mode: dense`)."""

    def top_k(self, batch: TensorDict, k: int, temperature: float = 1.0) -> TensorDict:
        """{"ids" [B, T, k] long, "logprobs" [B, T, k]}: the k likeliest next tokens at each
        response position and their log-probabilities (0 off the response)."""
        ...


class AdapterOffReference:
    """The reference of a LoRA policy: the policy's own base model with the adapter switched
    off (`reference_logprobs`), so a KL term needs no second copy of the model."""

    def __init__(self, policy: Any):
        self.policy = policy

    def logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        return self.policy.reference_logprobs(batch, temperature)


@runtime_checkable
class Critic(Protocol):
    """The value model(s) of token-level estimators (gae); M > 1 for AsyPPO's ensemble."""

    @property
    def num_critics(self) -> int:
        ...

    def values(self, batch: TensorDict) -> torch.Tensor:
        """Each critic's values [M, B, T] of the batch's tokens."""
        ...

    def update(self, batch: TensorDict, updates_per_batch: int) -> dict[str, float]:
        """Fit the values to `batch["returns"]`; returns the critic's metrics."""
        ...

    def save(self, directory: Path) -> None:
        ...

    def load(self, directory: Path) -> None:
        ...
