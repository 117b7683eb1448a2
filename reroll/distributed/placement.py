"""Placement (ROLL's device mapping): per role, the Ray options of each of its workers.

GPU roles: one placement group holds one bundle per device any role names ({GPU: 1, CPU: 1});
worker r of a role given `devices` runs in the bundle of its r-th device, taking
1/k of the GPU when k roles share that device (they are colocated and take turns). Ray makes
that GPU visible to the worker as its only device. CPU roles reserve `num_cpus` per worker;
a role with `colocate_with: policy` goes where the policy's workers are and reserves nothing.
Across nodes, `resources` (custom node resources, reserved) and `labels` (node labels, reserving
nothing) pin a CPU role to the nodes that offer them (RollArt's hardware-affine placement:
rollout on `rollout` nodes, rewards on CPU-only nodes),
and a colocated role is pinned to the node of the policy's rank 0 (`colocate_on_node`).
On-policy distillation's teachers are placed as `distributed.reference` says (`PLACED_AS`): each
teacher is one more role of that placement, so its CPUs, resources and share of a device are
counted like the reference's.
A mapping the cluster cannot satisfy is a ConfigError naming the role, checked against the live
nodes before any actor is started (an actor asking for what no node has would wait forever).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from reroll.config.distributed import DistributedConfig, RolePlacement
from reroll.config.errors import ConfigError

ROLES = ("policy", "rollout", "reference", "critic")

PLACED_AS = {"teacher": "reference"}
"""Roles without a section of their own, placed by another role's settings. A run with several
teachers names the role once per teacher."""


def placement_key(role: str) -> str:
    """The `distributed.<key>` section that places `role`."""
    return PLACED_AS.get(role, role)


def placement_config(config: DistributedConfig, role: str) -> RolePlacement:
    return getattr(config, placement_key(role))


def _placed_as(role: str) -> str:
    """` (distributed.<key>)` for a role placed by another's section, for messages."""
    return "" if placement_key(role) == role else f" (distributed.{placement_key(role)})"


def role_placement(config: DistributedConfig, role: str) -> RolePlacement:
    placement = placement_config(config, role)
    return config.policy if placement.colocate_with == "policy" else placement


@dataclass(frozen=True)
class NodeInfo:
    """What placement reads of one live Ray node: its total resources and its labels."""

    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)


def check_nodes(config: DistributedConfig, roles: tuple[str, ...], nodes: list[NodeInfo]) -> None:
    """ConfigError when a role's `labels` or `resources` cannot be met by the live `nodes`: a
    label or resource no node has, a worker's CPUs, resources and labels that no single node has
    together, or more of a resource than all nodes offer."""
    wanted: dict[str, float] = {}
    for role in roles:
        key, p = placement_key(role), placement_config(config, role)
        if not (p.resources or p.labels):
            continue
        _check_offered(key, p, nodes)
        need = {"CPU": p.num_cpus} | p.resources
        if not any(_fits(need, p.labels, node) for node in nodes):
            raise ConfigError(
                f"distributed.{key}: no single node has {_fmt(need)}"
                + (f" with labels {p.labels}" if p.labels else "") + " for one worker (nodes: "
                + "; ".join(_describe(n) for n in nodes) + f"); lower distributed.{key}.num_cpus "
                f"or its resources, or label a node so")
        for k, v in p.resources.items():
            wanted[k] = wanted.get(k, 0.0) + v * p.reserved_workers
    for name, amount in wanted.items():
        total = sum(node.resources.get(name, 0) for node in nodes)
        if amount > total:
            users = sorted({placement_key(r) for r in roles
                            if name in placement_config(config, r).resources})
            raise ConfigError(
                f"distributed.{'/'.join(users)}.resources: the workers reserve {amount:g} of "
                f"{name!r} but the Ray cluster's nodes offer {total:g}; fewer workers, smaller "
                f"amounts (fractions like 0.5 are fine), or more nodes with {name!r}")


def _check_offered(role: str, p: RolePlacement, nodes: list[NodeInfo]) -> None:
    """Each resource and label the role names exists on some node (the commonest mistake: a
    name typed differently from the one the nodes were started with)."""
    for name in p.resources:
        if not any(name in node.resources for node in nodes):
            offered = sorted({k for node in nodes for k in _shown(node.resources)} - _BUILTIN)
            raise ConfigError(
                f"distributed.{role}.resources: no node of the Ray cluster offers the resource "
                f"{name!r} (custom resources offered: {offered or 'none'}); start a node with "
                f"it (`ray start --resources='{{\"{name}\": 1}}'`) or change the placement")
    for key, value in p.labels.items():
        if not any(node.labels.get(key) == value for node in nodes):
            offered = sorted({f"{k}={v}" for node in nodes for k, v in _user_labels(node).items()})
            raise ConfigError(
                f"distributed.{role}.labels: no node of the Ray cluster has the label "
                f"{key}={value} (labels offered: {offered or 'none'}); start a node with it "
                f"(`ray start --labels={key}={value}`) or change the placement")


def _fits(need: dict[str, float], labels: dict[str, str], node: NodeInfo) -> bool:
    return all(node.resources.get(k, 0) >= v for k, v in need.items()) and all(
        node.labels.get(k) == v for k, v in labels.items())


def _user_labels(node: NodeInfo) -> dict[str, str]:
    """The labels a user gave the node (not Ray's own `ray.io/...` ones)."""
    return {k: v for k, v in node.labels.items() if not k.startswith("ray.io/")}


def _describe(node: NodeInfo) -> str:
    labels = _user_labels(node)
    return _fmt(_shown(node.resources)) + (f" labels {labels}" if labels else "")


_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}


def _shown(node: dict[str, float]) -> dict[str, float]:
    """A node's CPUs and custom resources (not its memory or its `node:<ip>` markers)."""
    return {k: v for k, v in node.items() if k in ("CPU", "GPU") or not (
        k in _BUILTIN or k.startswith("node:") or k.startswith("accelerator_type:"))}


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def live_nodes() -> list[NodeInfo]:
    """Total resources and labels of each live node of the Ray cluster this process is
    connected to."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    return [NodeInfo(dict(node["Resources"]), dict(node.get("Labels") or {}))
            for node in ray.nodes() if node.get("Alive")]


def colocated_with_policy(config: DistributedConfig, role: str) -> bool:
    """True when `role` shares devices (or, colocated on CPUs, the policy's processes' CPUs) with
    the policy, so the two must take turns rather than run at the same time."""
    placement = placement_config(config, role)
    return placement.colocate_with == "policy" or bool(set(placement.devices)
                                                       & set(config.policy.devices))


def check_resources(config: DistributedConfig, roles: tuple[str, ...], available: dict[str, float]
                    ) -> None:
    """ConfigError when the roles ask for devices or CPUs that the Ray cluster (whose
    `ray.cluster_resources()` is `available`) does not have."""
    gpus = int(available.get("GPU", 0))
    for role in roles:
        key, devices = placement_key(role), placement_config(config, role).devices
        if devices and not gpus:
            raise ConfigError(
                f"distributed.{key}.devices {devices}: the Ray cluster has no GPUs; remove "
                f"distributed.{key}.devices to run {role} on CPUs (num_cpus), or join a cluster "
                f"with GPUs (distributed.ray_address)")
        missing = [d for d in devices if d >= gpus]
        if missing:
            raise ConfigError(
                f"distributed.{key}.devices {devices}: device(s) {missing} do not exist (the "
                f"Ray cluster has {gpus} GPU(s), indices 0-{gpus - 1}); use indices below {gpus}")
    needs = _cpu_reservations(config, roles)
    total, cpus = sum(needs.values()), float(available.get("CPU", 0))
    if total > cpus:
        parts = ", ".join(f"{role}{_placed_as(role)} {n:g}" for role, n in needs.items() if n)
        raise ConfigError(
            f"distributed: the roles reserve {total:g} CPUs ({parts}) but the Ray cluster has "
            f"{cpus:g}; lower distributed.<role>.num_cpus (fractions like 0.5 are fine), set "
            f"colocate_with: policy on a role, or give Ray more CPUs (distributed.num_cpus)")


def _cpu_reservations(config: DistributedConfig, roles: tuple[str, ...]) -> dict[str, float]:
    """CPUs each role reserves: num_cpus per worker on CPUs, one per device bundle for GPU roles
    (counted once per device however many roles share it), nothing when colocated. A role named
    more than once (a teacher each) reserves once for each."""
    needs: dict[str, float] = {}
    bundled: set[int] = set()
    for role in roles:
        p = placement_config(config, role)
        if p.colocate_with:
            need = 0.0
        elif p.devices:
            need = float(len(set(p.devices) - bundled))
            bundled |= set(p.devices)
        else:
            need = p.num_cpus * p.reserved_workers
        needs[role] = needs.get(role, 0.0) + need
    return needs


def ray_options(config: DistributedConfig, roles: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """{role: [Ray actor options of worker r]} for the roles being built."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(config, roles, ray.cluster_resources())
    check_nodes(config, roles, live_nodes())
    sharing = Counter(d for r in roles for d in role_placement(config, r).devices)
    devices = sorted(sharing)
    group = None
    if devices:
        group = ray.util.placement_group([{"GPU": 1, "CPU": 1} for _ in devices], strategy="PACK")
        ray.get(group.ready())
    options: dict[str, list[dict[str, Any]]] = {}
    for role in roles:
        p, own = role_placement(config, role), placement_config(config, role)
        cpus = 0.0 if own.colocate_with else p.num_cpus
        if not p.devices:
            extra = {} if own.colocate_with else node_options(p)
            options[role] = [{"num_cpus": cpus} | extra] * p.num_workers
            continue
        options[role] = [{
            "num_cpus": 0, "num_gpus": 1 / sharing[d],
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, devices.index(d)),
        } for d in p.devices]
    return options


def colocate_on_node(options: dict[str, list[dict[str, Any]]], config: DistributedConfig,
                     policy_node: str) -> None:
    """Pin the CPU roles colocated with the policy to the node of its rank 0 (`policy_node`, a
    Ray node id): on several nodes, reserving nothing would otherwise let Ray put them anywhere,
    and taking turns only shares CPUs on the same node. GPU roles already share the policy's
    placement-group bundles."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for role, worker_options in options.items():
        placement = placement_config(config, role)
        if placement.colocate_with and not config.policy.devices:
            options[role] = [o | {"scheduling_strategy": NodeAffinitySchedulingStrategy(
                policy_node, soft=False)} for o in worker_options]


def role_options(config: DistributedConfig, roles: tuple[str, ...], role: str
                 ) -> list[dict[str, Any]]:
    """Ray options of each actor of a CPU role the task starts itself (`distributed.reward`,
    `distributed.env`), after checking the whole run's `roles` (this one among them) against
    the cluster: the task starts before the models, and its actors must not be the ones left
    waiting for a node."""
    import ray  # deferred: Ray is heavy to import and only Ray runs get here

    check_resources(config, roles, ray.cluster_resources())
    check_nodes(config, roles, live_nodes())
    p = placement_config(config, role)
    return [{"num_cpus": p.num_cpus} | node_options(p)] * p.reserved_workers


def node_options(p: RolePlacement) -> dict[str, Any]:
    """The Ray actor options that pin a worker to the nodes its placement names."""
    return ({"resources": dict(p.resources)} if p.resources else {}) | (
        {"label_selector": dict(p.labels)} if p.labels else {})
