"""Policy -> engine weight sync, verified: after every sync the engine's weights fingerprint must
equal the policy's, or the run stops (an engine sampling from stale weights silently ruins
on-policy training).

`InProcessSync`: the engine shares the policy's process (colocated): an in-memory handoff.
`ObjectStoreSync`: the policy's rank 0 packs the full weights into one flat buffer in Ray's
object store and the engine actor takes it from there (the driver never touches the bytes).
`BroadcastSync`: the policy's rank 0 and the engine actors form a torch.distributed group of
their own (apart from the policy's FSDP2 group; gloo on CPU, NCCL between separate GPUs) and
rank 0 broadcasts the flat buffer in buckets of `distributed.bucket_mb`; only the small layout
travels through Ray.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from reroll.config.distributed import DistributedConfig
from reroll.engines.base import Engine, WeightSyncError, fingerprint

GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def _check(policy_fp: str, engine_fp: str, version: int) -> None:
    if policy_fp != engine_fp:
        raise WeightSyncError(
            f"after the weight sync of step {version} the engine's weights fingerprint does "
            f"not match the policy's: the engine would sample from stale weights")


class InProcessSync:
    def __init__(self, policy: Any, engine: Engine):
        self.policy, self.engine = policy, engine

    def __call__(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.load_weights(self.policy.state_dict_for_sync(), version)
        _check(fingerprint(self.policy.state_dict_for_sync()), self.engine.weights_fingerprint(),
               version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


class PublishedSync:
    """Asynchronous training with in-flight updates: the trainer hands its weights to the rollout
    producer and goes on training; the producer loads them between decoding steps and checks
    the fingerprint there (`_ProducerEngine.publish_weights`)."""

    def __init__(self, policy: Any, engine: Any):
        self.policy, self.engine = policy, engine

    def __call__(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.publish_weights(self.policy.state_dict_for_sync(), version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


class ObjectStoreSync:
    """`policy` is a `PolicyGroup` on the Ray executor, `engine` an `ActorEngine`."""

    def __init__(self, policy: Any, engine: Any):
        self.policy, self.engine = policy, engine

    def __call__(self, version: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        executor = self.policy.cluster.executor
        # Every rank takes part (gathering FSDP2 shards is collective); rank 0 holds the result.
        refs = [executor.run_refs(r, "packed_weights_with_fingerprint", 3)
                for r in range(self.policy.cluster.num_workers)]
        slots, flat, policy_fp = refs[0]
        loaded = self.engine.actor.load_weights.remote(slots, flat, version)
        ray.get([ref for rank in refs[1:] for ref in rank])
        _check(ray.get(policy_fp), ray.get(loaded), version)  # the engine's, taken at load
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


class BroadcastSync:
    """`policy` is a `PolicyGroup` on the Ray executor, `engines` `ActorEngine`s."""

    def __init__(self, policy: Any, engines: list[Any], backend: str, bucket_mb: int):
        self.policy, self.engines, self.backend = policy, engines, backend
        self.bucket_bytes = bucket_mb << 20
        self.joined = False

    def join(self) -> None:
        """Policy rank 0 hosts the group's store; each engine joins it (all at once: joining
        blocks until every member has arrived)."""
        import ray

        executor = self.policy.cluster.executor
        address = ray.get(executor.actors[0].address.remote())
        world = 1 + len(self.engines)
        ray.get([executor.run_refs(0, "join_weight_group", 1, address, world, self.backend)]
                + [e.actor.join_weight_group.remote(address, i + 1, world, self.backend)
                   for i, e in enumerate(self.engines)])
        self.joined = True

    def __call__(self, version: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        if not self.joined:
            self.join()
        executor = self.policy.cluster.executor
        prepared = [executor.run_refs(r, "prepare_broadcast", 1)
                    for r in range(self.policy.cluster.num_workers)]
        slots, policy_fp = ray.get(prepared)[0]
        ray.get([executor.run_refs(0, "broadcast_weights", 1, self.bucket_bytes, self.backend)]
                + [e.actor.receive_weights.remote(slots, version, self.bucket_bytes, self.backend)
                   for e in self.engines])
        for engine in self.engines:
            _check(policy_fp, engine.weights_fingerprint(), version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


def join_group(address: tuple[str, int], rank: int, world_size: int, backend: str) -> Any:
    """A process group of its own (rank 0 hosts the rendezvous at `address`), independent of any
    default group this process is in (the policy's FSDP2 ranks)."""
    import torch.distributed as dist

    store = dist.TCPStore(address[0], address[1], world_size, is_master=rank == 0,
                          timeout=GROUP_TIMEOUT)
    store = dist.PrefixStore("reroll-weight-sync", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)


def _buckets(size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(start + bucket_bytes, size)) for start in range(0, size, bucket_bytes)]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def broadcast_buckets(group: Any, flat: torch.Tensor, bucket_bytes: int, backend: str) -> None:
    """Send `flat` (uint8, host memory) from rank 0, one bucket at a time (through the GPU when
    the group is NCCL's)."""
    for start, end in _buckets(flat.numel(), bucket_bytes):
        bucket = flat[start:end]
        _broadcast(group, bucket.cuda() if backend == "nccl" else bucket)


def receive_buckets(group: Any, size: int, bucket_bytes: int, backend: str) -> torch.Tensor:
    """The receiving side of `broadcast_buckets`: the flat buffer in host memory."""
    flat = torch.empty(size, dtype=torch.uint8)
    for start, end in _buckets(size, bucket_bytes):
        if backend == "nccl":
            bucket = torch.empty(end - start, dtype=torch.uint8, device="cuda")
            _broadcast(group, bucket)
            flat[start:end].copy_(bucket)
        else:
            _broadcast(group, flat[start:end])
    return flat


def sync_method(config: DistributedConfig) -> tuple[str, str]:
    """(`object_store` | `broadcast`, process-group backend) for an engine actor fed by Ray
    policy workers. NCCL needs the policy and the engines on different GPUs (one process per
    GPU); roles sharing devices or on CPUs broadcast with gloo through host memory."""
    policy, rollout = set(config.policy.devices), set(config.rollout.devices)
    separate_gpus = bool(policy) and bool(rollout) and not policy & rollout \
        and not config.rollout.colocate_with
    method = config.weight_sync
    if method == "auto":
        method = "broadcast" if separate_gpus else "object_store"
    return method, "nccl" if separate_gpus else "gloo"


def make_weight_sync(policy: Any, engine: Engine, config: DistributedConfig | None = None
                     ) -> InProcessSync | PublishedSync | ObjectStoreSync | BroadcastSync:
    """For an engine actor fed by Ray policy workers: the object store or a broadcast, as
    `config.weight_sync` says; for an async producer with in-flight updates, a hand-over;
    otherwise the in-memory handoff (an engine actor fed by an in-process policy packs the
    weights itself)."""
    from reroll.distributed.engine_actor import ActorEngine
    from reroll.distributed.roles import PolicyGroup

    if getattr(engine, "publishes_weights", False):
        return PublishedSync(policy, engine)
    if not (isinstance(policy, PolicyGroup) and isinstance(engine, ActorEngine)
            and not policy.in_process):
        return InProcessSync(policy, engine)
    method, backend = sync_method(config or DistributedConfig())
    if method == "broadcast":
        return BroadcastSync(policy, [engine], backend, (config or DistributedConfig()).bucket_mb)
    return ObjectStoreSync(policy, engine)
