"""Policy -> engine weight sync, verified: after every sync the engine's weights fingerprint must
equal the policy's, or the run stops (an engine sampling from stale weights silently ruins
on-policy training). This is the driver's side; which sync a run gets is decided where its roles
are built (`reroll.pipelines.roles`), and the collective transport that runs inside the worker
and actor processes is `collective.py`.

`InProcessSync`: the engine takes the policy's weights in memory (colocated, or an engine actor
fed by an in-process policy, which packs the weights itself, or by Ray policy workers through
the driver for `distributed.weight_sync: delta`: the actor is sent what changed since the
version it holds); with `model.lora`, the adapter alone when the engine takes adapters
(`model.lora.sync`), merged weights otherwise.
`AdapterFirst`: a LoRA run's adapter alone to engine actors fed by Ray policy workers (it is
small: it goes through the driver), the object store or broadcast sending merged weights when
an engine refuses it.
`PublishedSync`: asynchronous training with in-flight updates hands the weights over.
`ObjectStoreSync`: the policy's rank 0 packs the full weights into one flat buffer in Ray's
object store and the engine actor takes it from there (the driver never touches the bytes).
`BroadcastSync`: the policy's rank 0 and the engine actors form a torch.distributed group of
their own (apart from the policy's FSDP2 group; gloo on CPU, NCCL between separate GPUs) and
rank 0 broadcasts the flat buffer in buckets of `distributed.bucket_mb`; only the small layout
travels through Ray.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from reroll.config.distributed import DistributedConfig
from reroll.config.errors import ConfigError
from reroll.distributed.engine_actor import ActorEngine
from reroll.distributed.engine_pool import EnginePool
from reroll.distributed.groups import PolicyGroup
from reroll.engines.base import (
    AdapterSyncError,
    Engine,
    WeightSyncError,
    adapter_bytes,
    fingerprint,
)

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    def __call__(self, version: int) -> dict[str, float]:
        """Push the policy's weights to the engine(s) as `version`; returns the sync's metrics."""
        ...


def _check(policy_fp: str, engine_fp: str, version: int) -> None:
    if policy_fp != engine_fp:
        raise WeightSyncError(
            f"after the weight sync of step {version} the engine's weights fingerprint does "
            f"not match the policy's: the engine would sample from stale weights")


def adapter_only(lora_sync: str | None, engine: Any) -> bool:
    """Whether a LoRA run's sync sends the adapter alone: `lora_sync` is `model.lora.sync` (None:
    no LoRA). `auto` does where the engine takes adapters; `adapter` with one that does not is a
    ConfigError naming it."""
    takes = bool(getattr(engine, "takes_adapters", False))
    if lora_sync == "adapter" and not takes:
        raise ConfigError(
            f"model.lora.sync: adapter, but the rollout engine ({type(engine).__name__}) cannot "
            f"take an adapter (the HF engine, vLLM and reroll's server can, in Ray engine actors "
            f"too; in-flight updates take merged weights): set model.lora.sync: auto or merged")
    return lora_sync in ("auto", "adapter") and takes


class AdapterFirst:
    """LoRA: the adapter alone, checked by its fingerprint; an adapter the engine did not take
    is counted (`weight_sync/adapter_fallbacks`) and `merged` sends merged weights instead,
    which overwrite whatever the engine holds."""

    def __init__(self, policy: Any, engine: Engine, merged: WeightSync):
        self.policy, self.engine, self.merged = policy, engine, merged
        self.fallbacks = 0

    def __call__(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.send(version)
        if metrics is None:
            metrics = self.merged(version)
        return metrics | {"weight_sync/adapter_fallbacks": self.fallbacks,
                          "time/weight_sync_s": time.perf_counter() - t0,
                          "policy_version": version}

    def send(self, version: int) -> dict[str, float] | None:
        """The adapter's sync metrics; None when it did not take (counted)."""
        adapter = self.policy.adapter_for_sync()
        try:
            self.engine.load_adapter(adapter.items(), version)
            if self.engine.weights_fingerprint() != fingerprint(adapter.items()):
                raise AdapterSyncError(f"after adapter version {version} the engine's "
                                       f"fingerprint is not the adapter's")
        except AdapterSyncError as e:
            self.fallbacks += 1
            log.warning("adapter-only weight sync of step %d fell back to merged weights "
                        "(%d so far): %s", version, self.fallbacks, e)
            return None
        return {"weight_sync/bytes": adapter_bytes(adapter)}


class InProcessSync:
    def __init__(self, policy: Any, engine: Engine, lora_sync: str | None = None):
        """`lora_sync`: `model.lora.sync` of a LoRA run (None: full fine-tuning)."""
        self.policy, self.engine = policy, engine
        self.adapter = AdapterFirst(policy, engine, self.merged) \
            if adapter_only(lora_sync, engine) else None

    @property
    def adapter_only(self) -> bool:
        return self.adapter is not None

    def __call__(self, version: int) -> dict[str, float]:
        return self.adapter(version) if self.adapter is not None else self.merged(version)

    def merged(self, version: int) -> dict[str, float]:
        """The full (with LoRA, merged) weights; an engine that sends deltas reports its bytes
        and counters (`sync_metrics`)."""
        t0 = time.perf_counter()
        weights = dict(self.policy.state_dict_for_sync())
        self.engine.load_weights(weights.items(), version)
        _check(fingerprint(weights.items()), self.engine.weights_fingerprint(), version)
        metrics = {"weight_sync/bytes": adapter_bytes(weights)} | sync_metrics(self.engine)
        return metrics | {"time/weight_sync_s": time.perf_counter() - t0,
                          "policy_version": version}


def sync_metrics(engine: Any) -> dict[str, float]:
    """What the engine reports of its last sync (engine actors: bytes sent, delta counters)."""
    return engine.sync_metrics() if hasattr(engine, "sync_metrics") else {}


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
    """From the Ray workers of `policy` to the engine actor `engine` (or every engine of an
    `EnginePool`, which all take the same buffer from the object store)."""

    def __init__(self, policy: PolicyGroup, engine: ActorEngine | EnginePool):
        self.policy, self.engine = policy, engine
        self.engines = engine_actors(engine)

    def __call__(self, version: int) -> dict[str, float]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        t0 = time.perf_counter()
        executor = self.policy.cluster.executor
        # Every rank takes part (gathering FSDP2 shards is collective); rank 0 holds the result.
        refs = [executor.run_refs(r, "packed_weights_with_fingerprint", 3)
                for r in range(self.policy.cluster.num_workers)]
        slots, flat, policy_fp = refs[0]
        loaded = [e.actor.load_weights.remote(slots, flat, version) for e in self.engines]
        ray.get([ref for rank in refs[1:] for ref in rank])
        for engine, held in zip(self.engines, ray.get(loaded), strict=True):
            engine.loaded(version, held)  # the version and fingerprint taken at load
            _check(ray.get(policy_fp), engine.weights_fingerprint(), version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


class BroadcastSync:
    """From the Ray workers of `policy` to the engine actors `engines`."""

    def __init__(self, policy: PolicyGroup, engines: list[ActorEngine], backend: str,
                 bucket_mb: int):
        self.policy, self.engines, self.backend = policy, engines, backend
        self.bucket_bytes = bucket_mb << 20
        self.joined = False

    def join(self) -> None:
        """Policy rank 0 hosts the group's store; each engine joins it (all at once: joining
        blocks until every member has arrived)."""
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        executor = self.policy.cluster.executor
        address = ray.get(executor.actors[0].address.remote())
        world = 1 + len(self.engines)
        ray.get([executor.run_refs(0, "join_weight_group", 1, address, world, self.backend)]
                + [e.actor.join_weight_group.remote(address, i + 1, world, self.backend)
                   for i, e in enumerate(self.engines)])
        self.joined = True

    def __call__(self, version: int) -> dict[str, float]:
        import ray  # deferred: Ray is heavy to import and only Ray runs get here

        t0 = time.perf_counter()
        if not self.joined:
            self.join()
        executor = self.policy.cluster.executor
        prepared = [executor.run_refs(r, "prepare_broadcast", 1)
                    for r in range(self.policy.cluster.num_workers)]
        slots, policy_fp = ray.get(prepared)[0]
        held = ray.get([executor.run_refs(0, "broadcast_weights", 1, self.bucket_bytes,
                                          self.backend)]
                       + [e.actor.receive_weights.remote(slots, version, self.bucket_bytes,
                                                         self.backend) for e in self.engines])
        for engine, engine_held in zip(self.engines, held[1:], strict=True):
            engine.loaded(version, engine_held)
            _check(policy_fp, engine.weights_fingerprint(), version)
        return {"time/weight_sync_s": time.perf_counter() - t0, "policy_version": version}


def sync_method(config: DistributedConfig) -> tuple[str, str]:
    """(`object_store` | `broadcast` | `delta`, process-group backend) for an engine actor fed
    by Ray policy workers. NCCL needs the policy and the engines on different GPUs (one process
    per GPU); roles sharing devices or on CPUs broadcast with gloo through host memory."""
    policy, rollout = set(config.policy.devices), set(config.rollout.devices)
    separate_gpus = bool(policy) and bool(rollout) and not policy & rollout \
        and not config.rollout.colocate_with
    method = config.weight_sync
    if method == "auto":
        method = "broadcast" if separate_gpus else "object_store"
    return method, "nccl" if separate_gpus else "gloo"


def engine_actors(engine: ActorEngine | EnginePool) -> list[ActorEngine]:
    return list(engine.engines) if isinstance(engine, EnginePool) else [engine]


def actor_weight_sync(policy: PolicyGroup, engine: ActorEngine | EnginePool,
                      config: DistributedConfig, lora_sync: str | None = None) -> WeightSync:
    """For engine actors fed by Ray policy workers: the object store, a broadcast, or deltas
    through the driver (the actors were started with a `DeltaPolicy`), as `config.weight_sync`
    (and the placement, for `auto`) says; for a LoRA run (`lora_sync`, `model.lora.sync`) the
    adapter first where the engines take one."""
    method, backend = sync_method(config)
    if method == "delta":
        return InProcessSync(policy, engine, lora_sync)
    if method == "broadcast":
        full: WeightSync = BroadcastSync(policy, engine_actors(engine), backend,
                                         config.bucket_mb)
    else:
        full = ObjectStoreSync(policy, engine)
    return AdapterFirst(policy, engine, full) if adapter_only(lora_sync, engine) else full
