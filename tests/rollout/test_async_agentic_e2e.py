"""Asynchronous agentic training end to end on the tiny model (issue 46): `reroll train` with
`pipeline: agentic` and `async_training` trains, and no trained episode holds tokens more than
`max_staleness` versions behind the trainer that took it."""

from __future__ import annotations

import json

import pytest
import yaml

from reroll.cli import main
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


def test_an_async_agentic_run_trains_within_the_staleness_bound(tiny_model, tmp_path):
    config = {
        "pipeline": "agentic", "name": "a", "output_dir": str(tmp_path / "run"), "steps": 3,
        "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "async_training": {"enabled": True, "max_staleness": 1},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4},
    }
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 and r["env/episodes"] == 4 for r in rows)
    assert "correction/tis_weight_mean" in rows[-1]  # the off-policy correction is on
    assert "eval/success_rate" in rows[-1]
    for step in (1, 2, 3):
        for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines():
            oldest, newest = json.loads(line)["reward_info"]["policy_versions"]
            assert step - 1 - oldest <= 1 and newest <= step - 1  # the trainer was at step - 1
