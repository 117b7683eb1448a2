"""Trackers chosen in `tracking:`: wandb (offline, no network) and trackio receive the same metrics
as metrics.jsonl; a tracker that cannot start is a clear error (exit 2), never a silent no-op."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import yaml

pytestmark = pytest.mark.unit

LOG_THREE_STEPS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from reroll.config.schema import TrackingConfig
    from reroll.tracking import Tracker
    tracking = TrackingConfig(**eval(sys.argv[2]))
    tracker = Tracker(Path(sys.argv[1]), tracking, run_config={"name": "demo", "seed": 3})
    for step in (1, 2, 3):
        tracker.log(step, {"train/reward_mean": step / 10, "time/step_s": 0.5})
    tracker.close()
""")


def run_tracker(run_dir, tracking: dict, env: dict) -> subprocess.CompletedProcess:
    # A fresh process: trackio reads its storage folder (TRACKIO_DIR) when first imported.
    return subprocess.run([sys.executable, "-c", LOG_THREE_STEPS, str(run_dir), repr(tracking)],
                          capture_output=True, text=True, timeout=180, env={**os.environ, **env})


def test_wandb_offline_and_trackio_record_the_metrics(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = tmp_path / "trackio"
    result = run_tracker(run_dir, {"tensorboard": True, "wandb": True, "trackio": True,
                                   "project": "proj"},
                         {"TRACKIO_DIR": str(store), "WANDB_BASE_URL": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr

    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["train/reward_mean"] for row in jsonl] == [0.1, 0.2, 0.3]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"train/reward_mean" in wandb_file.read_bytes()

    db = sqlite3.connect(store / "proj.db")
    rows = db.execute("select run_name, step, metrics from metrics order by step").fetchall()
    assert [(name, step) for name, step, _ in rows] == [("demo", 1), ("demo", 2), ("demo", 3)]
    assert [json.loads(m)["train/reward_mean"] for _, _, m in rows] == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("tracking, env, named", [
    ({"wandb": True, "wandb_mode": "online"},
     {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}, "tracking.wandb"),
    ({"trackio": True, "trackio_space_id": "nobody/nowhere"}, {}, "tracking.trackio"),
])
def test_a_tracker_that_cannot_start_is_an_error(tmp_path, tracking, env, named):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_tracker(run_dir, tracking, {"TRACKIO_DIR": str(tmp_path / "t"), **env})
    assert result.returncode != 0
    assert "TrackerError" in result.stderr and named in result.stderr


@pytest.mark.e2e
def test_train_stops_with_exit_2_when_wandb_cannot_start(tmp_path, tiny_model, arithmetic):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "steps": 1, "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"]},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        "train": {"micro_batch_size": 4, "num_threads": 1},
        "tracking": {"progress": False, "tensorboard": False, "wandb": True,
                     "wandb_mode": "online"}}))
    env = {**os.environ, "WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}
    result = subprocess.run([sys.executable, "-m", "reroll.cli", "train", str(config)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    assert "tracking.wandb" in result.stderr and "Traceback" not in result.stderr
