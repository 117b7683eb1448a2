"""Building the RL roles from the config: in this process (`executor: local`, exactly the
one-process objects of a laptop run) or as Ray actors (`executor: ray`), behind the same
interfaces, so the pipeline code does not change between them.

policy     Strategy-like (`forward_logprobs`, `train_step`, `state_dict_for_sync`, `save`, `load`)
reference  `.logprobs(batch, temperature)`
critic     Critic-like (`values`, `update`, `save`, `load`, `num_critics`)
engine     Engine
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from reroll.config.schema import RLConfig
from reroll.distributed.cluster import Cluster, Dispatch, LocalExecutor, RayExecutor, WorkerSpec
from reroll.training.local import LossFn


@dataclass
class Roles:
    policy: Any
    reference: Any | None
    critic: Any | None
    engine: Any
    clusters: list[Any]

    def shutdown(self) -> None:
        for cluster in self.clusters:
            cluster.shutdown()
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


def policy_spec(c: RLConfig, total_steps: int) -> WorkerSpec:
    from reroll.workers.policy import PolicyWorker

    return WorkerSpec(PolicyWorker, dict(
        model_path=c.model.path, dtype=c.model.dtype, optimizer=c.optimizer, train=c.train,
        total_steps=total_steps, param_dtype=c.distributed.fsdp_param_dtype,
        attn_implementation=c.model.attn_implementation, dropout=c.model.dropout), role="policy")


def reference_spec(c: RLConfig) -> WorkerSpec:
    from reroll.workers.reference import ReferenceWorker

    return WorkerSpec(ReferenceWorker, dict(model_path=c.model.path, dtype=c.model.dtype,
                                            micro_batch_size=c.train.micro_batch_size,
                                            attn_implementation=c.model.attn_implementation),
                      role="reference")


def critic_spec(c: RLConfig, total_steps: int) -> WorkerSpec:
    from reroll.workers.critic import CriticWorker

    return WorkerSpec(CriticWorker, dict(
        config=c.algorithm.critic, policy_path=c.model.path, dtype=c.model.dtype,
        optimizer=c.optimizer, train=c.train, total_steps=total_steps), role="critic")


def build_roles(c: RLConfig, total_steps: int, pad_token_id: int) -> Roles:
    if c.distributed.executor == "ray":
        return _ray_roles(c, total_steps, pad_token_id)
    return _local_roles(c, total_steps, pad_token_id)


def _local_roles(c: RLConfig, total_steps: int, pad_token_id: int) -> Roles:
    from reroll.distributed.placement import colocated_with_policy
    from reroll.engines import build_engine
    from reroll.models.loading import load_model
    from reroll.training.critic import Critic
    from reroll.training.local import LocalStrategy

    if colocated_with_policy(c.distributed, "rollout"):
        # Taking turns needs the worker's offload()/reload(); numerically the same strategy.
        policy = PolicyGroup(Cluster(policy_spec(c, total_steps), 1, LocalExecutor()))
    else:
        policy = LocalStrategy(load_model(c.model.path, c.model.dtype, c.model.attn_implementation,
                                          c.model.dropout), c.optimizer, c.train,
                               total_steps=total_steps)
    # The reference model exists only when a KL term needs it, the critic only for gae.
    reference = ReferenceGroup(Cluster(reference_spec(c), 1, LocalExecutor())) \
        if c.algorithm.kl.coef else None
    critic = Critic(c.algorithm.critic, c.model.path, c.model.dtype, c.optimizer, c.train,
                    total_steps) if c.algorithm.critic else None
    engine = build_engine(c.rollout, c.model.path, c.model.dtype, pad_token_id, c.seed,
                          c.model.attn_implementation)
    return Roles(policy, reference, critic, engine, [])


def _ray_roles(c: RLConfig, total_steps: int, pad_token_id: int) -> Roles:
    from reroll.distributed.engine_actor import start_engine_actor
    from reroll.distributed.placement import ray_options
    from reroll.distributed.ray_runtime import ensure_ray
    from reroll.engines import engine_factory

    d = c.distributed
    ensure_ray(d.ray_address, d.num_cpus)
    wanted = ("policy", "rollout") + (("reference",) if c.algorithm.kl.coef else ()) \
        + (("critic",) if c.algorithm.critic else ())
    options = ray_options(d, wanted)
    prefix = f"reroll-{c.name}"

    def cluster(spec: WorkerSpec, role: str) -> Cluster:
        executor = RayExecutor(options[role], getattr(d, role).num_threads
                               if not getattr(d, role).colocate_with else d.policy.num_threads,
                               name_prefix=prefix)
        return Cluster(spec, len(options[role]), executor)

    policy = PolicyGroup(cluster(policy_spec(c, total_steps), "policy"))
    clusters = [policy.cluster]
    reference = critic = None
    if c.algorithm.kl.coef:
        reference = ReferenceGroup(cluster(reference_spec(c), "reference"))
        clusters.append(reference.cluster)
    if c.algorithm.critic:
        critic = CriticProxy(cluster(critic_spec(c, total_steps), "critic"))
        clusters.append(critic.cluster)
    rollout = options["rollout"][0]
    engine = start_engine_actor(
        engine_factory(c.rollout, c.model.path, c.model.dtype, pad_token_id, c.seed,
                       c.model.attn_implementation),
        num_cpus=rollout["num_cpus"], num_threads=d.rollout.num_threads,
        name=f"{prefix}-rollout-0", ray_options=rollout)
    return Roles(policy, reference, critic, engine, clusters)


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

    def train_step(self, batch: TensorDict, loss_fn: LossFn) -> dict[str, float]:
        per_rank = self.cluster.call("train_step", batch, loss_fn, dispatch=Dispatch.SPLIT)
        return combine_rank_metrics(per_rank)

    def state_dict_for_sync(self):
        return iter(self.cluster.call("state_dict_for_sync")[0].items())

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
