"""Every device decision, on a machine without GPUs: `plan_devices` with fake device counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from reroll.config.errors import ConfigError
from reroll.config.loading import load_config
from reroll.config.schema import RLConfig
from reroll.models import devices
from reroll.models.devices import (
    RoleDevice,
    cpu_bf16_support,
    plan_devices,
    resolve_device,
    trainer_device,
)

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).parents[2] / "examples"
BASE = {"name": "t", "steps": 1, "model": {"path": "models/tiny"},
        "data": {"train": "data/train.jsonl"}}


def config(**sections) -> RLConfig:
    return RLConfig.model_validate(BASE | sections)


def planned(c: RLConfig, cuda_count: int, bf16_supported: bool) -> dict[str, RoleDevice]:
    return plan_devices(c.distributed, c.train, c.rollout, cuda_count, bf16_supported)


def test_without_cuda_every_role_stays_on_the_cpu_as_configured():
    plan = planned(config(), cuda_count=0, bf16_supported=False)
    assert set(plan) == {"policy", "reference", "critic", "rollout"}
    assert all(p == RoleDevice("cpu", False, "auto") for p in plan.values())
    # bf16 on the CPU is the user's choice only
    plan = planned(config(train={"bf16_autocast": True}, rollout={"dtype": "bfloat16"}),
                        cuda_count=0, bf16_supported=False)
    assert plan["policy"] == RoleDevice("cpu", True) and plan["rollout"].engine_dtype == "bfloat16"


def test_auto_with_one_gpu_puts_every_role_on_it_in_bf16():
    plan = planned(config(), cuda_count=1, bf16_supported=True)
    assert {p.device for p in plan.values()} == {"cuda:0"}
    assert plan["policy"].autocast_bf16 and plan["reference"].autocast_bf16
    assert plan["critic"].autocast_bf16
    assert plan["rollout"] == RoleDevice("cuda:0", False, "bfloat16")


def test_a_gpu_without_bf16_computes_in_float32():
    plan = planned(config(), cuda_count=1, bf16_supported=False)
    assert plan["policy"] == RoleDevice("cuda:0", False)
    assert plan["rollout"].engine_dtype == "auto"


def test_explicit_settings_win():
    plan = planned(config(distributed={"device": "cpu"}), cuda_count=8, bf16_supported=True)
    assert {p.device for p in plan.values()} == {"cpu"}
    plan = planned(config(rollout={"dtype": "float32"}), cuda_count=1, bf16_supported=True)
    assert plan["rollout"].engine_dtype == "float32"


def test_cuda_asked_for_on_a_machine_without_it_is_a_config_error():
    with pytest.raises(ConfigError, match="distributed.device: cuda"):
        planned(config(distributed={"device": "cuda"}), cuda_count=0, bf16_supported=False)
    assert resolve_device("cuda", 2) == "cuda:0"
    with pytest.raises(Exception, match="device"):
        config(distributed={"device": "tpu"})


def test_ray_roles_follow_their_placement():
    c = config(distributed={"executor": "ray", "policy": {"devices": [0, 1], "num_workers": 2},
                            "rollout": {"devices": [2], "num_workers": 1}})
    plan = planned(c, cuda_count=0, bf16_supported=True)  # the driver may have no GPU
    assert plan["policy"].device == plan["rollout"].device == "cuda:0"
    assert plan["reference"].device == "cuda:0"  # colocated with the policy by default
    c = config(distributed={"executor": "ray", "policy": {"num_cpus": 1},
                            "rollout": {"num_cpus": 1}})
    assert {p.device for p in planned(c, 4, True).values()} == {"cpu"}


@pytest.mark.parametrize(("example", "cuda_count", "devices"), [
    ("one_gpu.yaml", 1, {"cuda:0"}),
    ("one_gpu.yaml", 0, {"cpu"}),  # the same file on a laptop
    ("one_node_8_gpus.yaml", 8, {"cuda:0"}),
    ("nodes.yaml", 0, {"cuda:0"}),  # the driver on a CPU-only head node
])
def test_the_documented_gpu_examples_get_the_documented_placement(example, cuda_count, devices):
    config = load_config(EXAMPLES / "gpu" / example, [])
    plan = planned(config, cuda_count, bf16_supported=True)
    assert {p.device for p in plan.values()} == devices
    if example == "one_gpu.yaml" and cuda_count:
        assert plan["policy"].autocast_bf16 and plan["rollout"].engine_dtype == "bfloat16"


def test_the_one_process_pipelines_train_where_the_rl_policy_would():
    """SFT, distillation, DPO and reward models (`device`): CUDA with bf16 autocast when there
    is a GPU, the CPU as configured when there is none or `device: cpu` says so."""
    assert trainer_device("auto", "auto", 1, True) == RoleDevice("cuda:0", True)
    assert trainer_device("auto", "auto", 1, False) == RoleDevice("cuda:0", False)
    assert trainer_device("auto", "auto", 0, False) == RoleDevice("cpu", False)
    assert trainer_device("auto", True, 0, False) == RoleDevice("cpu", True)
    assert trainer_device("cpu", "auto", 4, True) == RoleDevice("cpu", False)
    with pytest.raises(ConfigError, match="^device: cuda, but torch sees no CUDA device"):
        trainer_device("cuda", False, 0, False)


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Fake this CPU's bf16 capability: `cpu_bf16(True)` native, `cpu_bf16(False)` absent."""
    def fake(fast: bool) -> None:
        flags = {"avx2", "amx_bf16"} if fast else {"avx2"}
        monkeypatch.setattr(devices, "cpu_bf16", lambda: cpu_bf16_support(flags, False))
        monkeypatch.setattr(devices, "_warned", set())
    return fake


def test_cpu_bf16_support_from_the_flags_and_onednn():
    fast, detail = cpu_bf16_support({"avx512f", "avx512_bf16", "amx_bf16"}, True)
    assert fast and detail.startswith("native bf16 (amx_bf16, avx512_bf16)")
    fast, detail = cpu_bf16_support({"avx512f"}, True)  # AVX-512 without bf16: emulated
    assert not fast and "no faster than float32" in detail
    fast, detail = cpu_bf16_support({"avx2"}, False)  # the AVX2 EPYC of the slow demo
    assert not fast and "many times slower" in detail


def test_bf16_asked_for_on_a_cpu_without_it_is_used_with_one_warning(cpu_bf16, caplog):
    cpu_bf16(False)
    c = config(train={"bf16_autocast": True}, rollout={"dtype": "bfloat16"})
    for _ in range(2):
        plan = planned(c, cuda_count=0, bf16_supported=False)
    assert plan["policy"].autocast_bf16 and plan["rollout"].engine_dtype == "bfloat16"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # one per setting, not one per role or per call
    assert all("many times slower" in w for w in warnings)
    assert any(w.startswith("train.bf16_autocast: true on this CPU") for w in warnings)


def test_bf16_on_a_cpu_with_native_bf16_warns_nothing(cpu_bf16, caplog):
    cpu_bf16(True)
    plan = planned(config(train={"bf16_autocast": True}), cuda_count=0, bf16_supported=False)
    assert plan["policy"].autocast_bf16
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("fast", [True, False])
def test_auto_keeps_any_cpu_in_float32_and_warns_nothing(cpu_bf16, caplog, fast):
    cpu_bf16(fast)
    plan = planned(config(), cuda_count=0, bf16_supported=False)
    assert all(p == RoleDevice("cpu", False, "auto") for p in plan.values())
    assert trainer_device("auto", "auto", 0, False) == RoleDevice("cpu", False)
    assert not caplog.records


def test_bf16_autocast_false_is_float32_on_a_gpu_too():
    """An explicit false wins over the GPU's bf16 (it was bf16 whatever the setting)."""
    plan = planned(config(train={"bf16_autocast": False}), cuda_count=1, bf16_supported=True)
    assert plan["policy"] == RoleDevice("cuda:0", False)
    assert trainer_device("auto", False, 1, True) == RoleDevice("cuda:0", False)
    assert trainer_device("auto", "auto", 1, True) == RoleDevice("cuda:0", True)


@pytest.mark.parametrize("example", ["sft.yaml", "grpo.yaml"])
def test_the_real_model_examples_leave_bf16_to_auto(cpu_bf16, caplog, example):
    """`make demo-real` on a CPU without native bf16 ran 230 s a step in bf16 (2.7 expected)."""
    cpu_bf16(False)
    c = load_config(EXAMPLES / "real" / example, [])
    assert c.train.bf16_autocast == "auto"
    assert trainer_device("auto", c.train.bf16_autocast, 0, False) == RoleDevice("cpu", False)
    assert trainer_device("auto", c.train.bf16_autocast, 1, True) == RoleDevice("cuda:0", True)
    assert not caplog.records
