"""An agentic run's learned reward (`reward: {type: model}`) placed by `distributed.reward`
(`executor: ray`): the reward model is built inside the reward's Ray actors, episodes are scored
there, and the run scores as the one-process run does."""

from __future__ import annotations

import pytest
import yaml
from small_runs import watch_reward_actors

from reroll.config.loading import load_config
from reroll.pipelines.agentic import train_agentic
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


def agentic_run(tmp_path, tiny_model, reward_model, name, **distributed):
    data = {
        "pipeline": "agentic", "name": name, "output_dir": str(tmp_path / name),
        "seed": 3, "steps": 1, "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 0},
        "reward": {"type": "model", "path": reward_model, "weight": 0.5},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "checkpoint": {"every_steps": 0},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 8},
        "distributed": distributed,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_a_reward_model_of_episodes_placed_by_distributed_reward_runs_in_its_actors(
        ray_session, tmp_path, tiny_model, reward_model, monkeypatch):
    train_agentic(agentic_run(tmp_path, tiny_model, reward_model, "local"))
    seen = watch_reward_actors(monkeypatch)
    train_agentic(agentic_run(tmp_path, tiny_model, reward_model, "placed", executor="ray",
                              reward={"num_workers": 1, "num_cpus": 1}))
    assert "reroll-placed-reward-0" in seen["actors"]
    [one], [actors] = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "placed")
    assert actors["reward/errors"] == actors["reward/timeouts"] == 0
    # the same episodes, scored alike (batches may group them otherwise: float32 round-off)
    for key in ("train/learned_reward_mean", "train/env_return_mean", "train/reward_mean"):
        assert actors[key] == pytest.approx(one[key], abs=1e-4), key
    assert actors["train/reward_mean"] == pytest.approx(
        actors["train/env_return_mean"] + 0.5 * actors["train/learned_reward_mean"], abs=1e-4)
