"""Runs that cannot learn say so (exit 1, the step and the cause) instead of finishing "fine":
a reward that is NaN/inf or crashes on every call, and updates whose loss comes out non-finite.
A reward that is NaN on some samples is counted and the run goes on with finite numbers. Every
JSON file written stays strict JSON; no checkpoint holds non-finite weights."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.cli import main

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent  # rewards_for_tests.py


@pytest.fixture
def helpers():
    sys.path.insert(0, str(HERE))
    yield
    sys.path.remove(str(HERE))


def strict(text: str):
    def refuse(name):
        raise ValueError(f"bare {name} in JSON")
    return json.loads(text, parse_constant=refuse)


def run(tmp_path: Path, model: str, data: dict, function: str, capsys, **sections) -> tuple:
    config = {
        "pipeline": "rlvr", "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 2,
        "model": {"path": model}, "data": {"train": data["train"], "eval": data["eval"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 16},
        "eval": {"every_steps": 0, "max_prompts": 8},
        "reward": {"type": "custom", "function": function, "timeout_s": 5},
        "tracking": {"progress": False, "tensorboard": False},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["train", str(path)])
    return code, capsys.readouterr().err, tmp_path / "run"


def check_json_files(run_dir: Path) -> list[dict]:
    """Every JSON file of the run parses strictly; returns the metrics rows."""
    for path in run_dir.rglob("*.json*"):
        for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            if line.strip():
                strict(line)
    metrics = run_dir / "metrics.jsonl"
    return [strict(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.mark.parametrize("function", ["nan_reward", "inf_reward", "always_crashes"])
def test_a_reward_that_fails_on_every_call_stops_the_run(tmp_path, tiny_model, arithmetic,
                                                         capsys, helpers, function):
    code, err, run_dir = run(tmp_path, tiny_model, arithmetic, f"rewards_for_tests:{function}",
                             capsys)
    assert code == 1, err
    assert "run stopped" in err and "step 1" in err and "failed on" in err
    assert "Traceback" not in err
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "summary.json").exists()
    check_json_files(run_dir)


def test_nan_on_some_samples_is_counted_and_the_run_stays_finite(tmp_path, tiny_model, arithmetic,
                                                                 capsys, helpers):
    code, err, run_dir = run(tmp_path, tiny_model, arithmetic, "rewards_for_tests:nan_on_some",
                             capsys, rollout={"group_size": 8}, train={"micro_batch_size": 32})
    assert code == 0, err
    rows = check_json_files(run_dir)
    assert rows[-1]["reward/nonfinite"] >= 1 and rows[-1]["reward/errors"] >= 1
    for row in rows:
        assert all(v is None or not isinstance(v, float) or math.isfinite(v) for v in row.values())
        assert row["train/loss"] is not None and row["train/skipped_updates"] == 0
    summary = strict((run_dir / "summary.json").read_text())
    assert math.isfinite(summary["eval_reward_end"])
    weights = load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_non_finite_losses_skip_updates_then_stop_the_run(tmp_path, tiny_model, arithmetic,
                                                          capsys, helpers):
    """Rewards of +-3e38 are finite, but the group's advantages overflow float32: every loss is
    non-finite. Three updates are skipped (weights untouched), then the run stops."""
    code, err, run_dir = run(tmp_path, tiny_model, arithmetic, "rewards_for_tests:huge_reward",
                             capsys, steps=5, checkpoint={"every_steps": 1})
    assert code == 1, err
    assert "run stopped" in err and "step 3" in err and "non-finite" in err
    rows = check_json_files(run_dir)
    assert [r["train/skipped_updates"] for r in rows] == [1.0, 2.0]
    before = load_file(Path(tiny_model) / "model.safetensors")
    for step in (1, 2):
        saved = load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")
        assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not (run_dir / "checkpoints" / "step_3").exists()


def test_eval_counts_non_finite_rewards_and_writes_strict_json(tmp_path, tiny_model, arithmetic,
                                                               capsys, helpers):
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", tiny_model, "--task", arithmetic["eval"], "--n", "2",
                 "--max-prompts", "8", "--max-new-tokens", "12", "--reward", "custom",
                 "--reward-function", "rewards_for_tests:nan_reward", "--out", str(out)])
    assert code == 0
    results = strict(out.read_text())
    assert results["reward_errors"] == 16 and results["reward_nonfinite"] == 16
    assert results["mean@2"] == 0.0
    for line in out.with_suffix(".samples.jsonl").read_text().splitlines():
        assert "non-finite" in strict(line)["reward_info"]["error"]
    assert not math.isnan(strict(capsys.readouterr().out.strip().splitlines()[-1])["mean@2"])
