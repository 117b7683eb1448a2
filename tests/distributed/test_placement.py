"""Bad device mappings are ConfigErrors naming the field and what to do, before anything starts
(no Ray needed: `check_resources` takes the cluster's resources as a dict)."""

from __future__ import annotations

import pytest

from reroll.config import ConfigError
from reroll.config.distributed import DistributedConfig
from reroll.config.loading import validate
from reroll.config.schema import RLConfig
from reroll.distributed.placement import (
    NodeInfo,
    check_nodes,
    check_resources,
    colocated_with_policy,
)
from reroll.distributed.weight_sync import sync_method
from reroll.pipelines.roles import ray_role_names

pytestmark = pytest.mark.unit
CPU_MACHINE = {"CPU": 4.0}
GPU_NODE = {"CPU": 16.0, "GPU": 4.0}


def rl_error(distributed: dict, **sections) -> str:
    data = {"steps": 2, "model": {"path": "m"}, "data": {"train": "t.jsonl"},
            "distributed": distributed, **sections}
    with pytest.raises(ConfigError) as info:
        validate(RLConfig, data, "config.yaml")
    return str(info.value)


def resources_error(distributed: dict, roles=("policy", "rollout"), available=CPU_MACHINE) -> str:
    with pytest.raises(ConfigError) as info:
        check_resources(DistributedConfig(**distributed), roles, available)
    return str(info.value)


def test_gpu_devices_on_a_cpu_only_cluster():
    message = resources_error({"executor": "ray", "policy": {"num_workers": 2, "devices": [0, 1]}})
    assert "distributed.policy.devices [0, 1]" in message
    assert "no GPUs" in message and "remove distributed.policy.devices" in message


def test_more_devices_than_the_cluster_has():
    message = resources_error({"executor": "ray", "policy": {"num_workers": 2, "devices": [0, 1]},
                               "rollout": {"num_workers": 2, "devices": [4, 5]}},
                              available=GPU_NODE)
    assert "distributed.rollout.devices [4, 5]" in message
    assert "[4, 5] do not exist" in message and "4 GPU(s)" in message


def test_more_cpus_than_the_cluster_has_names_each_role():
    message = resources_error({"executor": "ray", "policy": {"num_workers": 3, "num_cpus": 1},
                               "rollout": {"num_cpus": 2}})
    assert "reserve 5 CPUs (policy 3, rollout 2)" in message and "has 4" in message
    assert "distributed.<role>.num_cpus" in message and "colocate_with: policy" in message


def test_each_teacher_reserves_what_the_reference_placement_asks():
    """On-policy distillation's teachers are placed as `distributed.reference` says, one more
    role there per teacher; the messages name the section that places them."""
    distributed = {"executor": "ray", "policy": {"num_cpus": 1}, "rollout": {"num_cpus": 1},
                   "reference": {"num_cpus": 0.75}}
    check_resources(DistributedConfig(**distributed), ("policy", "rollout", "teacher"),
                    CPU_MACHINE)  # 2.75 of 4
    message = resources_error(distributed, ("policy", "rollout", "teacher", "teacher", "teacher"))
    assert "reserve 4.25 CPUs (policy 1, rollout 1, teacher (distributed.reference) 2.25)" \
        in message
    message = resources_error({"executor": "ray", "reference": {"devices": [0]}},
                              ("policy", "rollout", "teacher"))
    assert "distributed.reference.devices [0]: the Ray cluster has no GPUs" in message
    nodes = [NodeInfo({"CPU": 4.0})]
    with pytest.raises(ConfigError, match=r"distributed\.reference\.labels: no node .* pool=cpu"):
        check_nodes(DistributedConfig(executor="ray", reference={"labels": {"pool": "cpu"}}),
                    ("policy", "rollout", "teacher"), nodes)


def test_colocated_and_gpu_roles_reserve_what_they_share_once():
    both_on_cpus = {"executor": "ray", "policy": {"num_workers": 4},
                    "rollout": {"colocate_with": "policy"}}
    check_resources(DistributedConfig(**both_on_cpus), ("policy", "rollout"), CPU_MACHINE)
    shared_gpus = {"executor": "ray", "policy": {"num_workers": 4, "devices": [0, 1, 2, 3]},
                   "rollout": {"num_workers": 4, "devices": [0, 1, 2, 3]}}
    check_resources(DistributedConfig(**shared_gpus), ("policy", "rollout"),
                    {"CPU": 4.0, "GPU": 4.0})  # one CPU per device bundle, not per role
    # The reference is only counted when the run builds it.
    reference = DistributedConfig(**{**both_on_cpus, "reference": {"num_cpus": 8}})
    check_resources(reference, ("policy", "rollout"), CPU_MACHINE)
    with pytest.raises(ConfigError, match="reference 8"):
        check_resources(reference, ("policy", "rollout", "reference"), CPU_MACHINE)


def test_executor_local_rejects_what_needs_separate_processes():
    message = rl_error({"policy": {"num_workers": 2}})
    assert "distributed.policy: 2 workers" in message and "set distributed.executor: ray" in message
    for setting, field in (({"ray_address": "auto"}, "distributed.ray_address"),
                           ({"weight_sync": "broadcast"}, "distributed.weight_sync"),
                           ({"num_cpus": 8}, "distributed.num_cpus"),
                           ({"rollout": {"devices": [0]}}, "distributed.rollout")):
        message = rl_error(setting)
        assert field in message and "set distributed.executor: ray" in message, message


def test_a_role_with_neither_cpus_nor_devices():
    message = rl_error({"executor": "ray", "rollout": {"num_cpus": 0}})
    assert "distributed.rollout has neither devices nor CPUs" in message
    assert "num_cpus > 0" in message and "colocate_with: policy" in message


@pytest.mark.parametrize("role, placement, expected", [
    ("policy", {"num_workers": 2, "devices": [0]}, "distributed.policy: Value error, devices [0] "
                                                   "gives 1 workers but num_workers is 2"),
    ("rollout", {"num_workers": 2, "devices": [1, 1]}, "repeats a device"),
    ("rollout", {"devices": [-1]}, "indices start at 0"),
    ("reference", {"colocate_with": "policy", "devices": [0]}, "leave devices and num_workers unset"),
    ("policy", {"colocate_with": "policy"}, "distributed.policy.colocate_with"),
])
def test_inconsistent_role_placement(role, placement, expected):
    assert expected in rl_error({"executor": "ray", role: placement})


def test_policy_workers_must_split_each_mini_batch():
    message = rl_error({"executor": "ray", "policy": {"num_workers": 3}},
                       rollout={"prompts_per_step": 4, "group_size": 4})
    assert "distributed.policy.num_workers" in message


def test_colocation_and_weight_sync_method_follow_the_placement():
    on_cpus = DistributedConfig(executor="ray", rollout={"colocate_with": "policy"})
    assert colocated_with_policy(on_cpus, "rollout") and not colocated_with_policy(
        DistributedConfig(executor="ray"), "rollout")
    shared = DistributedConfig(executor="ray", policy={"num_workers": 2, "devices": [0, 1]},
                               rollout={"num_workers": 2, "devices": [1, 2]})
    assert colocated_with_policy(shared, "rollout")
    assert sync_method(shared) == ("object_store", "gloo")  # NCCL cannot pair ranks on one GPU
    separate = DistributedConfig(executor="ray", policy={"devices": [0]}, rollout={"devices": [1]})
    assert sync_method(separate) == ("broadcast", "nccl")
    assert sync_method(DistributedConfig(executor="ray")) == ("object_store", "gloo")
    assert sync_method(DistributedConfig(executor="ray", weight_sync="broadcast")) == (
        "broadcast", "gloo")


# Multi-node placement by custom node resources and labels (no Ray needed: `check_nodes` takes
# each live node's total resources and labels).
THREE_NODES = [NodeInfo({"CPU": 1.0, "train": 1.0, "node:10.0.0.1": 1.0, "memory": 1e9},
                        {"ray.io/node-id": "abc"}),
               NodeInfo({"CPU": 2.0, "rollout": 1.0}, {"pool": "gpu"}),
               NodeInfo({"CPU": 1.0, "reward": 2.0}, {"pool": "cpu"})]


def nodes_error(distributed: dict, roles=("policy", "rollout"), nodes=THREE_NODES) -> str:
    with pytest.raises(ConfigError) as info:
        check_nodes(DistributedConfig(**distributed), roles, nodes)
    return str(info.value)


def test_roles_pinned_to_the_nodes_that_offer_their_resources():
    placed = {"executor": "ray", "policy": {"resources": {"train": 1}},
              "rollout": {"num_cpus": 2, "resources": {"rollout": 1}},
              "reward": {"num_workers": 2, "resources": {"reward": 1}}}
    check_nodes(DistributedConfig(**placed), ("policy", "rollout", "reward"), THREE_NODES)
    # the same placement asking for more than the one `train` node has is refused
    too_much = {**placed, "policy": {"resources": {"train": 2}}}
    with pytest.raises(ConfigError, match="distributed.policy"):
        check_nodes(DistributedConfig(**too_much), ("policy", "rollout", "reward"), THREE_NODES)


def test_a_resource_no_node_offers_names_the_role_and_the_resource():
    message = nodes_error({"executor": "ray", "rollout": {"resources": {"gpu_h100": 1}}})
    assert "distributed.rollout.resources" in message and "'gpu_h100'" in message
    assert "['reward', 'rollout', 'train']" in message  # what the nodes do offer
    assert "ray start --resources='{\"gpu_h100\": 1}'" in message


def test_cpus_and_resources_must_be_on_one_node():
    message = nodes_error({"executor": "ray", "rollout": {"num_cpus": 2, "resources":
                                                          {"train": 1}}})
    assert "distributed.rollout: no single node has {CPU: 2, train: 1}" in message
    assert "{CPU: 1, train: 1}" in message and "node:" not in message and "memory" not in message


def test_roles_placed_by_node_labels():
    check_nodes(DistributedConfig(executor="ray", reward={"num_workers": 4, "labels": {"pool":
                                                                                     "cpu"}}),
                ("policy", "rollout", "reward"), THREE_NODES)  # labels reserve nothing
    message = nodes_error({"executor": "ray", "rollout": {"labels": {"pool": "tpu"}}})
    assert "distributed.rollout.labels: no node of the Ray cluster has the label pool=tpu" in message
    assert "['pool=cpu', 'pool=gpu']" in message and "ray.io" not in message
    assert "ray start --labels=pool=tpu" in message
    message = nodes_error({"executor": "ray", "rollout": {"num_cpus": 2, "labels": {"pool": "cpu"}}})
    assert "no single node has {CPU: 2} with labels {'pool': 'cpu'}" in message
    assert "{CPU: 1, reward: 2} labels {'pool': 'cpu'}" in message


def test_more_of_a_resource_than_every_node_together():
    message = nodes_error({"executor": "ray", "policy": {"resources": {"reward": 1}},
                          "reward": {"num_workers": 2, "resources": {"reward": 1}}},
                         roles=("policy", "rollout", "reward"))
    assert "distributed.policy/reward.resources" in message
    assert "reserve 3 of 'reward'" in message and "offer 2" in message


@pytest.mark.parametrize("distributed, expected", [
    ({"executor": "ray", "rollout": {"resources": {"CPU": 2}}}, "ask for CPUs with num_cpus"),
    ({"executor": "ray", "rollout": {"resources": {"rollout": 0}}}, "amounts must be > 0"),
    ({"executor": "ray", "rollout": {"devices": [0], "resources": {"rollout": 1}}},
     "resources or labels with devices"),
    ({"executor": "ray", "rollout": {"devices": [0], "labels": {"pool": "gpu"}}},
     "resources or labels with devices"),
    ({"executor": "ray", "critic": {"colocate_with": "policy", "labels": {"a": "b"}}},
     "resources and labels empty"),
    ({"rollout": {"labels": {"pool": "gpu"}}}, "distributed.rollout.labels is only used"),
    ({"executor": "ray", "reference": {"colocate_with": "policy", "resources": {"a": 1}}},
     "resources and labels empty"),
    ({"executor": "ray", "reward": {"colocate_with": "policy"}}, "distributed.reward runs on CPUs"),
    ({"executor": "ray", "reward": {"num_cpus": 0}}, "distributed.reward has neither"),
    ({"reward": {"num_cpus": 1}}, "distributed.reward is only used by the ray executor"),
    ({"rollout": {"resources": {"rollout": 1}}}, "distributed.rollout.resources is only used"),
])
def test_inconsistent_node_placement(distributed, expected):
    assert expected in rl_error(distributed)


def test_an_agentic_run_places_a_reward_role_only_for_its_learned_reward():
    from reroll.config.agentic import AgenticConfig

    data = {"pipeline": "agentic", "steps": 2, "model": {"path": "m"},
            "env": {"id": "guess_number"}, "distributed": {"executor": "ray", "reward": {}}}
    with pytest.raises(ConfigError, match="which this agentic run has none of"):
        validate(AgenticConfig, data, "config.yaml")
    config = validate(AgenticConfig, data | {"reward": {"type": "model", "path": "rm"}},
                      "config.yaml")
    assert "reward" in ray_role_names(config)


def test_ray_joins_the_cluster_named_by_the_config_or_ray_address(monkeypatch):
    from reroll.distributed.ray_runtime import init_kwargs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = init_kwargs(None, 3)
    assert local["num_cpus"] == 3 and local["address"] == "local"  # never a stray cluster
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    joined = init_kwargs(None, 3)
    assert joined["address"] == "10.0.0.1:6379" and "num_cpus" not in joined
    assert init_kwargs("ray://head:10001", None)["address"] == "ray://head:10001"  # config wins
