"""Every common architecture, random-init and small, through `reroll check-model` and a 2-step
GRPO run whose engine and trainer agree (`actor/behaviour_kl_k3` below 1e-3)."""

import pytest
import torch
import yaml

from reroll.check_model import run_checks
from reroll.config import load_config
from reroll.models.devices import cpu_bf16
from reroll.models.factory import make_model
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e

ARCHITECTURES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text",
                 "phi3", "olmo2", "gpt2", "gpt_neox"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {a: str(make_model(root / a, "tiny", seed=0, architecture=a)) for a in ARCHITECTURES}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_check_model_passes(models, architecture):
    summary = run_checks(models[architecture], vllm=False)
    statuses = {c["name"]: c["status"] for c in summary["checks"]}
    assert summary["passed"], summary["checks"]
    # every engine check ran (none skipped): packing is on for every one of these
    for name in ("engine_greedy", "logprobs_padded", "logprobs_packed", "weight_sync"):
        assert statuses[name] == "pass", (name, summary["checks"])
    # the routing agreement is checked on the MoE model, skipped on dense ones
    assert statuses["routing"] == ("pass" if architecture == "qwen3_moe" else "skip")
    # the CPU's bf16 is reported, never failed: pass where native, skip (keep float32) where not
    fast, detail = cpu_bf16()
    bf16 = next(c for c in summary["checks"] if c["name"] == "cpu_bf16")
    assert bf16 == {"name": "cpu_bf16", "status": "pass" if fast else "skip", "detail": detail}
    expected = "eager" if architecture == "gemma2" else "sdpa"  # soft-capping needs eager
    assert summary["attn_implementation"] == expected


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_grpo_steps_engine_matches_trainer(models, architecture, arithmetic, tmp_path):
    torch.set_num_threads(2)
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 2, "model": {"path": models[architecture]},
        "data": {"train": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 16},
        "checkpoint": {"every_steps": 0}, "tracking": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_config(path))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert abs(row["actor/behaviour_kl_k3"]) < 1e-3, row["actor/behaviour_kl_k3"]
