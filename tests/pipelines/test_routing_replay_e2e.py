"""Two GRPO steps on a tiny Qwen3-MoE with `algorithm.routing_replay: rollout`: the engine's
routing is replayed in pi_old's and the loss's forwards, the router losses are logged, and the
trainer still agrees with the engine."""

import pytest
import torch
import yaml

from reroll.config import load_config
from reroll.models.factory import make_model
from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


def test_two_grpo_steps_with_routing_replay(arithmetic, tmp_path):
    torch.set_num_threads(2)
    model = make_model(tmp_path / "moe", "tiny", seed=0, architecture="qwen3_moe")
    config = {
        "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 2, "model": {"path": str(model)},
        "data": {"train": arithmetic["eval"]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
        "algorithm": {"routing_replay": "rollout", "updates_per_batch": 2,
                      "router_aux_loss_coef": 0.01},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4},
        "checkpoint": {"every_steps": 0}, "tracking": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_config(path))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert abs(row["actor/behaviour_kl_k3"]) < 1e-3, row["actor/behaviour_kl_k3"]
        assert row["actor/router_aux_loss"] > 0 and row["actor/router_z_loss"] > 0
