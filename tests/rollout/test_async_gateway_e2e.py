"""Asynchronous training of an agent program through the gateway (issue 46): `reroll train`
with `agent:` and `async_training` on the tiny model, driven by an unmodified `openai` SDK
harness (`chat_harness`). The producer plays a batch ahead, so episodes are trained one version
after the weights that sampled them; every policy token the gateway recorded carries its
version; a crashing harness is masked and counted, and a resumed run trains the uninterrupted
run's tasks, none lost or trained twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from chat_harness import TASKS

from reroll.cli import main
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent


def agent_config(tiny_model, tmp_path, **sections) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config = {
        "pipeline": "agentic", "name": "a", "output_dir": str(tmp_path / "run"), "steps": 3,
        "model": {"path": tiny_model},
        "agent": {"entrypoint": "chat_harness:chat", "tasks": str(tasks), "time_limit_s": 60,
                  "max_context_tokens": 256, "eval_tasks": str(tasks)},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
        "async_training": {"enabled": True, "max_staleness": 1, "max_ahead": 1},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 4},
    } | sections
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rollouts(run: Path, steps) -> list[list[dict]]:
    return [[json.loads(line) for line in (run / "rollouts" / f"step_{n}.jsonl").read_text()
             .splitlines()] for n in steps]


def test_an_async_agent_run_trains_on_versioned_tokens_within_the_bound(tiny_model, tmp_path,
                                                                         monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # the harness module, as a user's would be
    path = agent_config(tiny_model, tmp_path, steps=4,  # 8 groups: every task is drawn
                        eval={"every_steps": 4, "samples_per_prompt": 1})
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = read_metrics(run)
    steps = (1, 2, 3, 4)
    assert [r["step"] for r in rows] == list(steps)
    assert all(r["staleness/max"] <= 1 and r["gateway/episodes"] == 4 for r in rows)
    # The off-policy correction is on in every step that updated the policy. A step whose groups
    # were all dropped for the crashing harness updates nothing (which step that is depends on
    # the order episodes finish in: under the fresh clone's load it was step 4).
    trained = [r for r in rows if not r.get("train/policy_skipped")]
    assert trained and all("correction/tis_weight_mean" in r for r in trained)
    # Held-out episodes sample through the producer's engine too; the breaking task is not
    # counted as the policy's failure (1 of 7 episodes).
    assert rows[-1]["eval/infra_failure_frac"] == pytest.approx(1 / 7)
    versions = set()
    for step, episodes in zip(steps, rollouts(run, steps), strict=True):
        for e in episodes:
            if e["reward_info"]["agent_status"] != "ok":
                assert e["reward_info"]["agent_status"] == "crashed"
                continue
            oldest, newest = e["reward_info"]["policy_versions"]  # from the calls' tokens
            assert step - 1 - oldest <= 1 and newest <= step - 1  # the trainer was at step - 1
            versions |= {oldest, newest}
    assert len(versions) > 1  # the gateway's tokens span weight versions
    # Played a batch ahead: some step trained episodes sampled by the previous weights.
    assert any(r["staleness/max"] == 1 for r in rows), [r["staleness/max"] for r in rows]
    # The breaking harness (task 6) is an infrastructure failure: counted, not the policy's.
    broken = [e for step in rollouts(run, steps) for e in step if "Task 6" in e["prompt"]]
    assert broken and all(e["reward_info"]["agent_status"] == "crashed" for e in broken)
    assert sum(r["gateway/crashed"] for r in rows) == len(broken)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def trained_tasks(run: Path, steps) -> list[list[str]]:
    """Each step's task prompts, in the order the trainer took their groups."""
    return [list(dict.fromkeys(e["prompt"] for e in episodes))
            for episodes in rollouts(run, steps)]


def test_a_resumed_async_agent_run_trains_the_uninterrupted_runs_tasks(tiny_model, tmp_path,
                                                                       monkeypatch):
    """A run stopped after its step-1 checkpoint had groups buffered and in flight (the
    producer plays a batch ahead). In start order, the resumed run's steps 2 and 3 train the
    uninterrupted run's task rows, step by step: none lost, none trained twice (as
    `test_a_resumed_async_agentic_run_trains_the_uninterrupted_runs_episodes` for env:)."""
    monkeypatch.syspath_prepend(str(HERE))
    path = agent_config(tiny_model, tmp_path, checkpoint={"every_steps": 1, "keep_last": 3},
                        async_training={"enabled": True, "max_staleness": 2, "max_ahead": 1,
                                        "order": "start"})
    config = yaml.safe_load(path.read_text())
    config["tracking"]["record_rollouts"] = 8  # every episode of a step
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    whole = trained_tasks(run, (1, 2, 3))
    for n in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{n}")
    assert main(["train", str(path), "resume=true"]) == 0
    resumed = trained_tasks(run, (2, 3))
    assert all(len(step) == 2 for step in whole)
    assert resumed == whole[1:]
    tasks = sum(whole[:1] + resumed, [])
    assert len(set(tasks)) == len(tasks) == 6
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
