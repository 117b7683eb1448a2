"""Placement (ROLL's device mapping): per role, the Ray options of each of its workers.

GPU roles: one placement group holds one bundle per device any role names ({GPU: 1, CPU: 1});
worker r of a role given `devices` runs in the bundle of its r-th device, taking
1/k of the GPU when k roles share that device (they are colocated and take turns). Ray makes
that GPU visible to the worker as its only device. CPU roles reserve `num_cpus` per worker;
a role with `colocate_with: policy` goes where the policy's workers are and reserves nothing.
A mapping the cluster cannot satisfy is a ConfigError naming the role.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from reroll.config.distributed import DistributedConfig, RolePlacement
from reroll.config.errors import ConfigError

ROLES = ("policy", "rollout", "reference", "critic")


def role_placement(config: DistributedConfig, role: str) -> RolePlacement:
    placement = getattr(config, role)
    return config.policy if placement.colocate_with == "policy" else placement


def colocated_with_policy(config: DistributedConfig, role: str) -> bool:
    """True when `role` shares devices (or, colocated on CPUs, the policy's processes' CPUs) with
    the policy, so the two must take turns rather than run at the same time."""
    placement = getattr(config, role)
    return placement.colocate_with == "policy" or bool(set(placement.devices)
                                                       & set(config.policy.devices))


def check_resources(config: DistributedConfig, roles: tuple[str, ...], available: dict[str, float]
                    ) -> None:
    """ConfigError when the roles ask for devices or CPUs that the Ray cluster (whose
    `ray.cluster_resources()` is `available`) does not have."""
    gpus = int(available.get("GPU", 0))
    for role in roles:
        devices = getattr(config, role).devices
        if devices and not gpus:
            raise ConfigError(
                f"distributed.{role}.devices {devices}: the Ray cluster has no GPUs; remove "
                f"distributed.{role}.devices to run {role} on CPUs (num_cpus), or join a cluster "
                f"with GPUs (distributed.ray_address)")
        missing = [d for d in devices if d >= gpus]
        if missing:
            raise ConfigError(
                f"distributed.{role}.devices {devices}: device(s) {missing} do not exist (the "
                f"Ray cluster has {gpus} GPU(s), indices 0-{gpus - 1}); use indices below {gpus}")
    needs = _cpu_reservations(config, roles)
    total, cpus = sum(needs.values()), float(available.get("CPU", 0))
    if total > cpus:
        parts = ", ".join(f"{role} {n:g}" for role, n in needs.items() if n)
        raise ConfigError(
            f"distributed: the roles reserve {total:g} CPUs ({parts}) but the Ray cluster has "
            f"{cpus:g}; lower distributed.<role>.num_cpus (fractions like 0.5 are fine), set "
            f"colocate_with: policy on a role, or give Ray more CPUs (distributed.num_cpus)")


def _cpu_reservations(config: DistributedConfig, roles: tuple[str, ...]) -> dict[str, float]:
    """CPUs each role reserves: num_cpus per worker on CPUs, one per device bundle for GPU roles
    (counted once per device however many roles share it), nothing when colocated."""
    needs: dict[str, float] = {}
    bundled: set[int] = set()
    for role in roles:
        p = getattr(config, role)
        if p.colocate_with:
            needs[role] = 0.0
        elif p.devices:
            needs[role] = float(len(set(p.devices) - bundled))
            bundled |= set(p.devices)
        else:
            needs[role] = p.num_cpus * p.num_workers
    return needs


def ray_options(config: DistributedConfig, roles: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """{role: [Ray actor options of worker r]} for the roles being built."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(config, roles, ray.cluster_resources())
    sharing = Counter(d for r in roles for d in role_placement(config, r).devices)
    devices = sorted(sharing)
    group = None
    if devices:
        group = ray.util.placement_group([{"GPU": 1, "CPU": 1} for _ in devices], strategy="PACK")
        ray.get(group.ready())
    options: dict[str, list[dict[str, Any]]] = {}
    for role in roles:
        p, own = role_placement(config, role), getattr(config, role)
        cpus = 0.0 if own.colocate_with else p.num_cpus
        if not p.devices:
            options[role] = [{"num_cpus": cpus}] * p.num_workers
            continue
        options[role] = [{
            "num_cpus": 0, "num_gpus": 1 / sharing[d],
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, devices.index(d)),
        } for d in p.devices]
    return options
