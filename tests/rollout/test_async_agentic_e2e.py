"""Asynchronous agentic training end to end on the tiny model (issue 46): `reroll train` with
`pipeline: agentic` and `async_training` trains, and no trained episode holds tokens more than
`max_staleness` versions behind the trainer that took it; a run killed after a checkpoint and
resumed trains the uninterrupted run's episodes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from reroll.cli import main
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


def async_config(tiny_model, run, **sections) -> dict:
    return {
        "pipeline": "agentic", "name": "a", "output_dir": str(run), "steps": 3,
        "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "async_training": {"enabled": True, "max_staleness": 1},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4},
    } | sections


def test_an_async_agentic_run_trains_within_the_staleness_bound(tiny_model, tmp_path):
    config = async_config(tiny_model, tmp_path / "run")
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


def trained_seeds(run, steps) -> list[list[int]]:
    """Each step's env seeds, in the order the trainer took their groups."""
    return [list(dict.fromkeys(json.loads(line)["reward_info"]["env_seed"] for line in
                               (run / "rollouts" / f"step_{n}.jsonl").read_text().splitlines()))
            for n in steps]


def test_a_resumed_async_agentic_run_trains_the_uninterrupted_runs_episodes(tiny_model,
                                                                            tmp_path):
    """A run killed after its step-1 checkpoint had episodes buffered and in flight (the
    producer plays a batch ahead). In start order, the resumed run's steps 2 and 3 train the
    uninterrupted run's env seeds, step by step: none lost, none trained twice. (A kill -9 after
    the checkpoint leaves what deleting the later checkpoints leaves: a checkpoint is written
    whole or not at all; the run directory's metrics and rollouts past it are cut on resume.)"""
    run = tmp_path / "run"
    config = async_config(tiny_model, run, checkpoint={"every_steps": 1, "keep_last": 3},
                          async_training={"enabled": True, "max_staleness": 2, "max_ahead": 1,
                                          "order": "start"})
    config["tracking"]["record_rollouts"] = 8  # every episode of a step
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    whole = trained_seeds(run, (1, 2, 3))
    for n in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{n}")
    assert main(["train", str(path), "resume=true"]) == 0
    resumed = trained_seeds(run, (2, 3))
    assert all(len(step) == 2 for step in whole)
    assert resumed == whole[1:]
    seeds = sum(whole[:1] + resumed, [])
    assert len(set(seeds)) == len(seeds) == 6
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
