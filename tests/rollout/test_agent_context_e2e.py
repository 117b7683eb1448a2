"""Context management end to end on the tiny model: under `env.context: drop_oldest` an episode
outgrows `env.max_context_tokens` and keeps playing; the run trains on each episode's last
token chain (the requests the engine got after the edit), and counts the edits."""

from __future__ import annotations

import json

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e


def test_drop_oldest_keeps_episodes_going_past_the_context(tiny_model, tmp_path):
    config = {
        "pipeline": "agentic", "name": "ctx", "output_dir": str(tmp_path / "run"), "steps": 1,
        "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 1000}, "max_turns": 10,
                "max_context_tokens": 200, "eval_episodes": 0,
                "context": {"policy": "drop_oldest", "target_fraction": 0.5}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3},
        "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4},
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["env/context_edits"] > 0 and last["env/chains_dropped"] > 0
    assert last["env/context_limit_frac"] == 0.0 and last["env/errors"] == 0
    rows = [json.loads(line) for line in (run / "rollouts" / "step_1.jsonl").read_text()
            .splitlines()]
    edited = [r for r in rows if "chain" in r["reward_info"]]
    assert edited
    for row in edited:
        # The episode went on past the context: more turns than its last chain holds, the
        # conversation whole, and the trained sample starting at the task after the edit.
        assert row["reward_info"]["turns"] > len(row["reward_info"]["chain"]["calls"])
        assert len(row["messages"]) > 2 * len(row["reward_info"]["chain"]["calls"]) + 1
        assert "Guess my number" in row["prompt"]
        assert "".join(s["text"] for s in row["segments"]) == row["response"]
    assert last["step"] == 1 and last["env/turns_mean"] == 10  # every episode played out
