"""The roles of a run seen from the driver, over a `Cluster` of their workers (in this process
or Ray actors): `PolicyGroup` is used as one Strategy, `ReferenceGroup` gives reference logprobs,
`CriticProxy` is used as one Critic. The pipeline builds them (`reroll.pipelines.roles`)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from reroll.distributed.cluster import Cluster, Dispatch, LocalExecutor
from reroll.training.local import LossFn


class PolicyGroup:
    """The policy's data-parallel workers, used as one Strategy by the pipeline."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.in_process = isinstance(cluster.executor, LocalExecutor)

    @property
    def data_parallel_size(self) -> int:
        """Ranks a train_step's batch is split over (it must divide the batch)."""
        return self.cluster.num_workers

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        return self.cluster.call("forward_logprobs", batch, temperature, dispatch=Dispatch.SPLIT)

    def routing(self, batch: TensorDict) -> torch.Tensor:
        """A mixture-of-experts policy's routing [B, L, layers, k] of the batch, now."""
        return self.cluster.call("routing", batch, dispatch=Dispatch.SPLIT)

    def reference_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """With `model.lora`: the base model's logprobs (the adapter switched off)."""
        return self.cluster.call("reference_logprobs", batch, temperature,
                                 dispatch=Dispatch.SPLIT)

    def train_step(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        per_rank = self.cluster.call("train_step", batch, loss_fn, dispatch=Dispatch.SPLIT)
        return combine_rank_metrics(per_rank)

    def state_dict_for_sync(self):
        return iter(self.cluster.call("state_dict_for_sync")[0].items())

    def adapter_for_sync(self) -> dict[str, torch.Tensor]:
        """With `model.lora`: the adapter alone (rank 0's: LoRA trains in one process)."""
        return self.cluster.call("adapter_for_sync")[0]

    def offload(self) -> None:
        """Every rank moves its optimizer state off the devices (a colocated engine's turn)."""
        self.cluster.call("offload")

    def reload(self) -> None:
        self.cluster.call("reload")

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        # The driver's own RNG streams are part of the run's state too.
        extra = extra | {"driver_rng": (torch.get_rng_state(), random.getstate())}
        self.cluster.call("save", directory.resolve(), extra)

    def load(self, directory: Path) -> dict[str, Any]:
        extra = self.cluster.call("load", directory.resolve())[0]
        torch_rng, python_rng = extra.pop("driver_rng")
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
        return extra


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' losses are parts of one global loss (summed); their other metrics are means
    over equal shards (averaged); grad norm and lr are the same on every rank."""
    combined = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank]
        if key == "train/loss":
            combined[key] = sum(values)
        elif key in ("train/grad_norm", "train/lr"):
            combined[key] = values[0]
        else:
            combined[key] = sum(values) / len(values)
    return combined


class ReferenceGroup:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        return self.cluster.call("logprobs", batch, temperature, dispatch=Dispatch.SPLIT)

    def top_k(self, batch: TensorDict, k: int, temperature: float = 1.0) -> TensorDict:
        """{"ids", "logprobs"} [B, L, k]: the top-k next tokens at each response position."""
        return self.cluster.call("top_k", batch, k, temperature, dispatch=Dispatch.SPLIT)


class CriticProxy:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.num_critics = cluster.call("num_critics", dispatch=Dispatch.RANK0)

    def values(self, batch: TensorDict) -> torch.Tensor:
        return self.cluster.call("values", batch, dispatch=Dispatch.RANK0)

    def update(self, batch: TensorDict, updates_per_batch: int) -> dict[str, float]:
        return self.cluster.call("update", batch, updates_per_batch, dispatch=Dispatch.RANK0)

    def save(self, directory: Path) -> None:
        self.cluster.call("save", directory.resolve(), dispatch=Dispatch.RANK0)

    def load(self, directory: Path) -> None:
        self.cluster.call("load", directory.resolve(), dispatch=Dispatch.RANK0)
