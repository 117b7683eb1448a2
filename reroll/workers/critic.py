"""CriticWorker: hosts `reroll.training.critic.LocalCritic` (one process; values and its update)."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from reroll.training.critic import LocalCritic


class CriticWorker:
    def __init__(self, *, rank: int, world_size: int, **critic_kwargs):
        self.critic = LocalCritic(**critic_kwargs)

    def num_critics(self) -> int:
        return self.critic.num_critics

    def values(self, batch: TensorDict) -> torch.Tensor:
        return self.critic.values(batch)

    def update(self, batch: TensorDict, updates_per_batch: int) -> dict[str, float]:
        return self.critic.update(batch, updates_per_batch)

    def save(self, directory: Path) -> None:
        self.critic.save(directory)

    def load(self, directory: Path) -> None:
        self.critic.load(directory)
