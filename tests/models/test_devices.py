"""Every device decision, on a machine without GPUs: `plan_devices` with fake device counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from reroll.config.errors import ConfigError
from reroll.config.loading import load_config
from reroll.config.schema import RLConfig
from reroll.models.devices import RoleDevice, plan_devices, resolve_device, trainer_device

pytestmark = pytest.mark.unit

BASE = {"name": "t", "steps": 1, "model": {"path": "models/tiny"},
        "data": {"train": "data/train.jsonl"}}


def config(**sections) -> RLConfig:
    return RLConfig.model_validate(BASE | sections)


def test_without_cuda_every_role_stays_on_the_cpu_as_configured():
    plan = plan_devices(config(), cuda_count=0, bf16_supported=False)
    assert set(plan) == {"policy", "reference", "critic", "rollout"}
    assert all(p == RoleDevice("cpu", False, "auto") for p in plan.values())
    # bf16 on the CPU is the user's choice only
    plan = plan_devices(config(train={"bf16_autocast": True}, rollout={"dtype": "bfloat16"}),
                        cuda_count=0, bf16_supported=False)
    assert plan["policy"] == RoleDevice("cpu", True) and plan["rollout"].engine_dtype == "bfloat16"


def test_auto_with_one_gpu_puts_every_role_on_it_in_bf16():
    plan = plan_devices(config(), cuda_count=1, bf16_supported=True)
    assert {p.device for p in plan.values()} == {"cuda:0"}
    assert plan["policy"].autocast_bf16 and plan["reference"].autocast_bf16
    assert plan["critic"].autocast_bf16
    assert plan["rollout"] == RoleDevice("cuda:0", False, "bfloat16")


def test_a_gpu_without_bf16_computes_in_float32():
    plan = plan_devices(config(), cuda_count=1, bf16_supported=False)
    assert plan["policy"] == RoleDevice("cuda:0", False)
    assert plan["rollout"].engine_dtype == "auto"


def test_explicit_settings_win():
    plan = plan_devices(config(distributed={"device": "cpu"}), cuda_count=8, bf16_supported=True)
    assert {p.device for p in plan.values()} == {"cpu"}
    plan = plan_devices(config(rollout={"dtype": "float32"}), cuda_count=1, bf16_supported=True)
    assert plan["rollout"].engine_dtype == "float32"


def test_cuda_asked_for_on_a_machine_without_it_is_a_config_error():
    with pytest.raises(ConfigError, match="distributed.device: cuda"):
        plan_devices(config(distributed={"device": "cuda"}), cuda_count=0, bf16_supported=False)
    assert resolve_device("cuda", 2) == "cuda:0"
    with pytest.raises(Exception, match="device"):
        config(distributed={"device": "tpu"})


def test_ray_roles_follow_their_placement():
    c = config(distributed={"executor": "ray", "policy": {"devices": [0, 1], "num_workers": 2},
                            "rollout": {"devices": [2], "num_workers": 1}})
    plan = plan_devices(c, cuda_count=0, bf16_supported=True)  # the driver may have no GPU
    assert plan["policy"].device == plan["rollout"].device == "cuda:0"
    assert plan["reference"].device == "cuda:0"  # colocated with the policy by default
    c = config(distributed={"executor": "ray", "policy": {"num_cpus": 1},
                            "rollout": {"num_cpus": 1}})
    assert {p.device for p in plan_devices(c, 4, True).values()} == {"cpu"}


@pytest.mark.parametrize(("example", "cuda_count", "devices"), [
    ("one_gpu.yaml", 1, {"cuda:0"}),
    ("one_gpu.yaml", 0, {"cpu"}),  # the same file on a laptop
    ("one_node_8_gpus.yaml", 8, {"cuda:0"}),
    ("nodes.yaml", 0, {"cuda:0"}),  # the driver on a CPU-only head node
])
def test_the_documented_gpu_examples_get_the_documented_placement(example, cuda_count, devices):
    config = load_config(Path(__file__).parents[2] / "examples" / "gpu" / example, [])
    plan = plan_devices(config, cuda_count, bf16_supported=True)
    assert {p.device for p in plan.values()} == devices
    if example == "one_gpu.yaml" and cuda_count:
        assert plan["policy"].autocast_bf16 and plan["rollout"].engine_dtype == "bfloat16"


def test_the_one_process_pipelines_train_where_the_rl_policy_would():
    """SFT, distillation, DPO and reward models (`device`): CUDA with bf16 autocast when there
    is a GPU, the CPU as configured when there is none or `device: cpu` says so."""
    assert trainer_device("auto", False, 1, True) == RoleDevice("cuda:0", True)
    assert trainer_device("auto", False, 1, False) == RoleDevice("cuda:0", False)
    assert trainer_device("auto", False, 0, False) == RoleDevice("cpu", False)
    assert trainer_device("auto", True, 0, False) == RoleDevice("cpu", True)
    assert trainer_device("cpu", False, 4, True) == RoleDevice("cpu", False)
    with pytest.raises(ConfigError, match="^device: cuda, but torch sees no CUDA device"):
        trainer_device("cuda", False, 0, False)
