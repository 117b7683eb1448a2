"""The agentic pipeline end to end on the tiny model: `reroll train` with `pipeline: agentic`
runs episodes, trains on them, records per-turn segments and evaluates success."""

from __future__ import annotations

import json
import shutil

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


def test_a_judge_scores_episodes_and_a_resumed_run_continues_exactly(tiny_model, digit_judge,
                                                                     tmp_path):
    """`reward: {type: judge}` in an agentic run: every finished episode is one judge request
    (the first observation as {question}, the rest with its outcome as {response}), its verdict
    joins the return; the learned reward's counters and `eval_start` come back on resume, so
    the resumed run's metrics are the uninterrupted run's."""
    from reroll.tracking import read_metrics

    config = {
        "pipeline": "agentic", "name": "judged", "output_dir": str(tmp_path / "run"),
        "seed": 1, "steps": 4, "model": {"path": tiny_model},
        "env": {"id": "guess_number", "kwargs": {"high": 8}, "max_turns": 2,
                "max_context_tokens": 200, "eval_episodes": 4},
        "reward": {"type": "judge", "model": digit_judge, "verdict": "score",
                   "score_pattern": r"(\d)", "score_min": 0, "score_max": 9,
                   "max_new_tokens": 3, "cache": False,
                   "template": "Task: {question}\nEpisode: {response}\nScore 0-9:"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 8, "num_threads": 1},
        "eval": {"every_steps": 2}, "checkpoint": {"every_steps": 2, "keep_last": 3},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 8},
    }
    path = tmp_path / "judged.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    full = read_metrics(run)
    # 8 episodes a step, 4 an evaluation (before step 1, after step 2: a step's row is written
    # before its evaluation's requests, which count in the next row)
    assert [r["reward/judge_requests"] for r in full] == [4 + 8, 20, 20 + 4 + 8, 40]
    assert all(r["reward/errors"] == r["reward/judge_parse_failures"] == 0 for r in full)
    episodes = [json.loads(line) for line in
                (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    scores = {e["reward_info"]["learned_reward"]["score"] for e in episodes}
    assert len(scores) > 1 and scores <= {d / 9 for d in range(10)}
    for e in episodes:
        assert e["reward"] == pytest.approx(e["reward_info"]["env_return"]
                                            + e["reward_info"]["learned_reward"]["score"])
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval_start"]) >= {"eval/success_rate", "eval/learned_reward_mean"}

    # the run dies after step 3: the step-2 checkpoint and metrics up to step 3 remain
    interrupted = tmp_path / "interrupted"
    shutil.copytree(run, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_4")
    lines = (interrupted / "metrics.jsonl").read_text().splitlines()[:3]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    path.write_text(yaml.safe_dump(config | {"output_dir": str(interrupted)}))
    assert main(["train", str(path), "resume=true"]) == 0
    resumed = read_metrics(interrupted)
    for a, b in zip(full, resumed, strict=True):
        timing = ("time/", "env/step_s")
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == \
               {k: v for k, v in b.items() if not k.startswith(timing)}, a["step"]
    assert json.loads((interrupted / "summary.json").read_text())["eval_start"] == \
        summary["eval_start"]
