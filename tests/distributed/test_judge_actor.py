"""An LLM judge placed by `distributed.reward` (`executor: ray`): the judge model and its engine
are built inside the reward's Ray actors, and the run scores as the one-process run does."""

from __future__ import annotations

import pytest
from small_runs import small_run_config, watch_reward_actors

from reroll.pipelines.rlvr import train
from reroll.tracking import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


def judge_run(tmp_path, tiny_model, arithmetic, judge_model, name, **distributed):
    judge = {"type": "judge", "model": judge_model, "verdict": "score",
             "score_pattern": r"(\d)", "score_min": 0, "score_max": 9, "max_new_tokens": 3}
    return small_run_config(tmp_path, tiny_model, arithmetic, name, steps=1, task_reward=judge,
                            **distributed)


def test_a_judge_placed_by_distributed_reward_runs_in_its_actors(
        ray_session, tmp_path, tiny_model, arithmetic, digit_judge, monkeypatch):
    local = judge_run(tmp_path, tiny_model, arithmetic, digit_judge, "local")
    train(local)
    seen = watch_reward_actors(monkeypatch)
    train(judge_run(tmp_path, tiny_model, arithmetic, digit_judge, "placed", executor="ray",
                    reward={"num_workers": 1, "num_cpus": 1}))
    assert "reroll-placed-reward-0" in seen["actors"]
    [one], [actors] = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "placed")
    assert actors["reward/judge_requests"] > 0 and actors["reward/errors"] == 0
    assert actors["train/reward_std"] > 0  # the verdicts differ between samples
    for key in ("train/reward_mean", "reward/judge_requests", "reward/judge_parse_failures",
                "reward/errors"):
        assert actors[key] == one[key], key
