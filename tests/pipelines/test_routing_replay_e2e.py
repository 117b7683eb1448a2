"""GRPO on a tiny Qwen3-MoE with routing replay: the engine's routing (`rollout`) or pi_old's
(`old_policy`) is replayed in the trainer's forwards, the router losses are logged (and trained
on), and the trainer still agrees with the engine."""

import pytest
import torch
import yaml

from reroll.config import load_config
from reroll.models.factory import make_model
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("moe"), "tiny", seed=0,
                          architecture="qwen3_moe"))


@pytest.mark.parametrize("replay, steps", [("rollout", 1), ("old_policy", 1)])
def test_grpo_with_routing_replay(moe_model, arithmetic, tmp_path, replay, steps):
    torch.set_num_threads(2)
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": steps,
        "model": {"path": moe_model}, "data": {"train": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "eval": {"max_prompts": 2},
        "algorithm": {"routing_replay": replay, "updates_per_batch": 2,
                      "router_aux_loss_coef": 0.01},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4},
        "checkpoint": {"every_steps": 0}, "tracking": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_config(path))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert abs(row["actor/behaviour_kl_k3"]) < 1e-3, row["actor/behaviour_kl_k3"]
        assert row["actor/router_aux_loss"] > 0 and row["actor/router_z_loss"] > 0
        # every token but each sample's last (never fed to the engine) had its routing forced
        assert row["actor/routing_replayed"] > 0.8, row["actor/routing_replayed"]


def test_agentic_episodes_replay_every_turns_routing(tiny_moe, tmp_path):
    """`pipeline: agentic` with `routing_replay: rollout`: each multi-turn episode carries the
    engine's routing of all its tokens (prompt, replies, observations), and the update forces
    it on every token the engine fed, as a single-turn step does."""
    torch.set_num_threads(1)
    config = {
        "pipeline": "agentic", "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 1,
        "model": {"path": tiny_moe},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "algorithm": {"routing_replay": "rollout"},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4},
        "eval": {"every_steps": 0}, "checkpoint": {"every_steps": 0},
        "tracking": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_config(path))
    row = read_metrics(tmp_path / "run")[-1]
    assert row["env/turns_mean"] > 1 and row["env/errors"] == 0
    assert abs(row["actor/behaviour_kl_k3"]) < 1e-3, row["actor/behaviour_kl_k3"]
    # every token but each episode's last reply token (and an observation no turn read)
    assert row["actor/routing_replayed"] > 0.8, row["actor/routing_replayed"]
