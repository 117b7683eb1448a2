"""The agentic pipeline end to end on the tiny model: `reroll train` with `pipeline: agentic`
runs episodes, trains on them, records per-turn segments and evaluates success."""

from __future__ import annotations

import json

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e


def test_agentic_run_trains_and_records_segments(tiny_model, tmp_path):
    config = {
        "pipeline": "agentic", "name": "t", "output_dir": str(tmp_path / "run"), "steps": 2,
        "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 3,
                "max_context_tokens": 200, "eval_episodes": 4},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "algorithm": {"advantage": {"name": "rebn"}},
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 2},
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 2 and "eval/success_rate" in last and "train/success_rate" in last
    assert last["env/errors"] == 0 and last["env/turns_mean"] >= 1
    episode = json.loads((run / "rollouts" / "step_2.jsonl").read_text().splitlines()[0])
    kinds = [segment["policy"] for segment in episode["segments"]]
    assert kinds[0] is True and False in kinds[:-1] or len(kinds) == 1
    assert "".join(s["text"] for s in episode["segments"]) == episode["response"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and (run / "checkpoints" / "step_2").is_dir()
