"""A LoRA policy behind Ray actors: the engine actor receives the adapter alone (`model.lora.sync:
auto`), or the merged weights (`merged`, here as deltas against the version the actor holds),
each sync checked by fingerprint, and the KL term's reference is the policy actor's own base
model with the adapter off; the run reproduces the one-process LoRA run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from reroll.config import load_config
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PIPELINE_TESTS = Path(__file__).parent.parent / "pipelines"  # parity_reward.py lives there


@pytest.fixture(autouse=True)
def parity_reward():
    """A reward the random-init model earns half the time (arithmetic answers it never gets
    right would give zero advantages, and the adapter would never move)."""
    sys.path.insert(0, str(PIPELINE_TESTS))
    yield
    sys.path.remove(str(PIPELINE_TESTS))


def lora_config(tmp_path, tiny_model, arithmetic, name: str, sync: str = "auto", **distributed):
    data = {
        "name": name, "output_dir": str(tmp_path / name), "seed": 3, "steps": 3,
        "model": {"path": tiny_model, "lora": {"rank": 4, "alpha": 8, "sync": sync}},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "reward": {"type": "custom", "function": "parity_reward:odd_length"},
        "algorithm": {"kl": {"coef": 0.05}},
        "optimizer": {"lr": 1e-2}, "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 0},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 0},
        "distributed": distributed,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@pytest.mark.parametrize("weight_sync, sync", [("object_store", "auto"), ("delta", "merged")])
def test_lora_policy_actor_reproduces_the_local_lora_run(ray_session, tmp_path, tiny_model,
                                                         arithmetic, weight_sync, sync):
    train(lora_config(tmp_path, tiny_model, arithmetic, "local"))
    train(lora_config(tmp_path, tiny_model, arithmetic, "ray", sync, executor="ray",
                      rollout={"num_cpus": 0.5}, weight_sync=weight_sync))
    local, ray_rows = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["step"] for r in ray_rows] == [1, 2, 3]
    assert all(r["time/weight_sync_s"] > 0 for r in ray_rows)  # fingerprint-checked each step
    if sync == "auto":  # the adapter alone every step (before: merged weights)
        assert all(r["weight_sync/adapter_fallbacks"] == 0 for r in ray_rows)
        assert all(r["weight_sync/bytes"] == local[0]["weight_sync/bytes"] for r in ray_rows)
    else:  # merged weights, after the first full sync as deltas (what the adapter changed)
        assert ray_rows[-1]["weight_sync/delta_syncs"] >= 1
        assert all(r["weight_sync/delta_fallbacks"] == 0 for r in ray_rows)
        assert ray_rows[-1]["weight_sync/bytes"] < ray_rows[-1]["weight_sync/full_bytes"]
    assert ray_rows[0]["train/reward_mean"] == local[0]["train/reward_mean"]
    for key in ("train/loss", "actor/kl_ref"):
        assert ray_rows[0][key] == pytest.approx(local[0][key], abs=1e-5), key
    assert any(r["actor/kl_ref"] > 0 for r in ray_rows)  # the adapter-off reference
