"""The `distributed:` section: where each role runs (ROLL's device mapping), on which executor,
how weights travel from the policy to the engines, and how many times a failed run restarts.

The default (`executor: local`, one worker per role) is the one-process run of a laptop. With
`executor: ray` every role runs in Ray actors placed by `reroll.distributed.placement`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reroll.config.base import Section


class RolePlacement(Section):
    """Where one role's workers run."""

    num_workers: int = Field(1, ge=1, le=1024)
    """Workers of this role. Policy workers shard the model with FSDP2 and split each batch by
    data-parallel rank; rollout workers are engines (one actor each, on their own nodes or
    devices) behind one pool that sends each request to the least-loaded one; with `devices`
    set it must equal the number of devices."""
    devices: list[int] = Field(default_factory=list)
    """GPU indices (over the Ray cluster's GPUs) for this role, one per worker; empty: CPU only.
    Roles given the same devices are colocated and take turns on them."""
    num_cpus: float = Field(1.0, ge=0, le=1024)
    """CPUs reserved per worker (Ray scheduling). Colocated roles reserve theirs once."""
    num_threads: int = Field(1, ge=1, le=1024)
    """torch intra-op threads in each worker process."""
    colocate_with: Literal["policy"] | None = None
    """`policy`: run on the policy's devices and CPUs, taking turns with it (reserves nothing)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray node resources each worker reserves, which pin the role to the nodes that offer
    them (hardware-affine placement, RollArt): e.g. `{rollout: 1}` runs the engine on nodes
    started with `ray start --resources='{"rollout": 4}'`. Names, not device ids; a placement no
    live node can satisfy stops the run at start naming the role and the resource
    (docs/distributed.md). CPUs and GPUs are asked for with `num_cpus` and `devices`."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Node labels the worker's node must carry (exact values), e.g. `{pool: cpu}` for nodes
    started with `ray start --labels=pool=cpu`: like `resources`, but reserving nothing, so any
    number of workers may share a labelled node. Checked against the live nodes at start."""

    @model_validator(mode="after")
    def _check_devices(self) -> RolePlacement:
        if self.devices and len(self.devices) != self.num_workers:
            raise ValueError(f"devices {self.devices} gives {len(self.devices)} workers but "
                             f"num_workers is {self.num_workers}; set one per device")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices {self.devices} repeats a device")
        if any(d < 0 for d in self.devices):
            raise ValueError(f"devices {self.devices}: indices start at 0")
        if self.colocate_with and (self.devices or self.num_workers != 1 or self.resources
                                   or self.labels):
            raise ValueError("a role colocated with the policy takes the policy's devices and "
                             "node; leave devices and num_workers unset, and resources and labels empty")
        reserved = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if reserved:
            raise ValueError(f"resources {reserved}: ask for CPUs with num_cpus and GPUs with "
                             f"devices; resources names custom node resources")
        if self.devices and (self.resources or self.labels):
            raise ValueError("resources or labels with devices: GPU roles are placed by their "
                             "devices' placement group; pin CPU roles to nodes with resources "
                             "or labels")
        bad = {k: v for k, v in self.resources.items() if not v > 0}
        if bad:
            raise ValueError(f"resources {bad}: amounts must be > 0 (fractions like 0.5 are fine)")
        return self

    @property
    def reserved_workers(self) -> int:
        """Workers whose CPUs and resources are reserved at start."""
        return self.num_workers


class RewardServe(Section):
    """The reward as a Ray Serve deployment (`distributed.reward.serve`): replicas that Serve
    adds while calls queue up and removes when they are idle (RollArt's serverless rewards)."""

    min_replicas: int = Field(1, ge=1, le=1024)
    """Replicas kept running however idle the reward is (each reserves the placement's
    `num_cpus` and `resources`; the run checks at start that the cluster has them)."""
    max_replicas: int = Field(2, ge=1, le=1024)
    """At most this many replicas while calls queue up; those the cluster cannot place wait
    until it can (Serve's autoscaling), they never stop the run."""
    target_ongoing_requests: float = Field(2.0, gt=0, le=10000)
    """Calls per replica the autoscaler aims at: more in flight adds replicas, fewer removes."""
    max_ongoing_requests: int = Field(8, ge=1, le=100000)
    """Calls one replica takes at a time; the rest wait in the caller's queue."""
    upscale_delay_s: float = Field(1.0, ge=0, le=3600)
    """How long the load must stay above the target before a replica is added."""
    downscale_delay_s: float = Field(10.0, ge=0, le=3600)
    """How long the load must stay below the target before a replica is removed."""

    @model_validator(mode="after")
    def _check_range(self) -> RewardServe:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below min_replicas "
                             f"{self.min_replicas}")
        return self


class RewardPlacement(RolePlacement):
    """Where the reward function runs: Ray actors (`num_workers`), or a Ray Serve deployment
    with autoscaling replicas (`serve`), each placed by `num_cpus`, `resources` and `labels`."""

    serve: RewardServe | None = None
    """Set: the reward is a Ray Serve deployment of `serve.min_replicas` to `serve.max_replicas`
    replicas (leave `num_workers` unset) that the reward runner calls with the usual time limit.
    A replica lost mid-run costs only the calls it had in flight: they fail, are counted
    (`reward/errors`, `reward/lost_calls`) and score 0, as any failed call; Serve starts a new
    replica. `reward/replicas` logs how many are running. Needs `pip install 'ray[serve]'` (in
    the `serve` extra)."""

    @model_validator(mode="after")
    def _check_serve(self) -> RewardPlacement:
        if self.serve is not None and "num_workers" in self.model_fields_set:
            raise ValueError("num_workers with serve: the replicas are serve.min_replicas to "
                             "serve.max_replicas; remove num_workers")
        return self

    @property
    def reserved_workers(self) -> int:
        return self.serve.min_replicas if self.serve is not None else self.num_workers


def _colocated() -> RolePlacement:
    return RolePlacement(colocate_with="policy")


class DistributedConfig(Section):
    """Executor, per-role placement, weight sync and fault tolerance."""

    executor: Literal["local", "ray"] = "local"
    """`local`: every role in this process; `ray`: every role in Ray actors (one process per worker)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the local executor's roles compute. `auto`: CUDA when torch sees a GPU, else CPU;
    `cuda` when there is none is an error. On CUDA every role sits on `cuda:0`, the trainer in
    bf16 autocast over float32 weights and the engine in bf16 where the GPU has bf16
    (docs/gpus.md). With `executor: ray` a role's devices are `distributed.<role>.devices`."""
    ray_address: str | None = None
    """Join this Ray cluster (`auto`, or `ray://head:10001`) instead of starting a local instance
    sized to this machine. Unset (and no `RAY_ADDRESS`): always a local instance of its own,
    even beside a cluster started with `ray start` here. See docs/distributed.md for multi-node
    use."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local Ray instance (None: all of this machine's)."""
    policy: RolePlacement = Field(default_factory=RolePlacement)
    """Placement of the policy (trainer) workers."""
    rollout: RolePlacement = Field(default_factory=RolePlacement)
    """Placement of the inference engine(s) that sample responses."""
    reference: RolePlacement = Field(default_factory=_colocated)
    """Placement of the reference model (only built when a KL term needs it)."""
    critic: RolePlacement = Field(default_factory=_colocated)
    """Placement of the critic (only built for estimators that need values)."""
    reward: RewardPlacement | None = None
    """Placement of the reward function (prompt tasks): None runs it in the driver process (CPU-
    heavy verifiers in its own process pool); set, it runs in `num_workers` Ray actors (calls
    spread round-robin) placed like any role, e.g. on CPU-only nodes with `resources`. A reward
    actor whose node is lost is restarted by Ray on a live node and its calls retried (rewards
    are pure functions of the sample). With `serve` set, a Ray Serve deployment with autoscaling
    replicas instead. Needs `executor: ray`."""
    env: RolePlacement | None = None
    """Placement of the environments (agentic runs): None steps them beside the driver (in its
    threads, or in env processes: `env.isolation`); set, each episode's environment lives in one of `num_workers` Ray actors
    (the one with the fewest live environments) placed like any role, e.g. on CPU-only nodes
    with `labels: {pool: env}`, which steps it in threads of its own under `env.step_timeout_s`.
    The environment must be importable on those nodes. Needs `executor: ray`."""
    weight_sync: Literal["auto", "object_store", "broadcast", "delta"] = "auto"
    """How new weights reach engine actors: one flat buffer through the Ray object store, or a
    torch.distributed broadcast in buckets from the policy's rank 0 (NCCL when policy and rollout
    have devices of their own, else gloo). `auto`: broadcast for GPU roles on separate devices,
    else the object store. `delta`: through the driver, each actor is sent only the elements
    that changed (in its dtype) since the version it holds, and full weights when a delta would
    not be smaller, when it holds another version (it refuses the delta, counted in
    `weight_sync/delta_fallbacks`) and every `full_sync_every`-th sync. In-process engines
    always get an in-memory copy. A LoRA run sends the adapter alone first (`model.lora.sync`)."""
    full_sync_every: int = Field(10, ge=1, le=100000)
    """With `weight_sync: delta`, every this many syncs are full ones (1: all of them)."""
    bucket_mb: int = Field(256, ge=1, le=65536)
    """Size of one broadcast bucket, in MiB."""
    fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of the gathered parameters in forward/backward (gradients are
    reduced and the optimizer steps in float32)."""
    max_restarts: int = Field(0, ge=0, le=100)
    """When a worker process dies (killed, out of memory), restart every role and resume from the
    last checkpoint, at most this many times (0: the run stops with the error)."""

    @model_validator(mode="after")
    def _check_executor(self) -> DistributedConfig:
        roles = {"policy": self.policy, "rollout": self.rollout, "reference": self.reference,
                 "critic": self.critic}
        if self.executor == "local":
            errors = [f"distributed.{name}: {p.num_workers} workers / devices {p.devices} need "
                      f"separate processes" for name, p in roles.items()
                      if p.num_workers > 1 or p.devices]
            errors += [f"distributed.{key} is only used by the ray executor" for key, is_set in (
                ("ray_address", self.ray_address is not None),
                ("num_cpus", self.num_cpus is not None),
                ("weight_sync", self.weight_sync != "auto"),
                ("reward", self.reward is not None),
                ("env", self.env is not None)) if is_set]
            errors += [f"distributed.{name}.{key} is only used by the ray executor"
                       for name, p in roles.items()
                       for key in ("resources", "labels") if getattr(p, key)]
            if errors:
                raise ValueError("; ".join(errors) + ": set distributed.executor: ray (executor "
                                 "local runs one worker per role in this process)")
        if self.policy.colocate_with:
            raise ValueError("distributed.policy.colocate_with: the policy is what other roles "
                             "colocate with; remove it")
        cpu_roles = {name: p for name, p in (("reward", self.reward), ("env", self.env))
                     if p is not None}
        for name, p in cpu_roles.items():
            if p.colocate_with or p.devices:
                raise ValueError(f"distributed.{name} runs on CPUs: leave colocate_with and "
                                 f"devices unset (num_cpus, resources and labels place it)")
        for name, p in (roles | cpu_roles).items():
            if not p.colocate_with and not p.devices and p.num_cpus == 0 and self.executor == "ray":
                raise ValueError(f"distributed.{name} has neither devices nor CPUs (num_cpus: 0): "
                                 f"give it num_cpus > 0 (fractions like 0.5 are fine), devices, "
                                 f"or colocate_with: policy")
        return self
