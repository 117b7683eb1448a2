"""A two-environment agentic run (`envs:`) through `reroll train` and `reroll eval`: each step's
groups split by weight, metrics per environment in the run's metrics and in its evaluation, and
a resumed run that draws what the uninterrupted one drew."""

import json
import shutil

import pytest
import yaml

from reroll.cli import main

pytestmark = pytest.mark.e2e


def two_envs(tmp_path, tiny_model, eval_episodes: int, **sections) -> str:
    """guess_number (weight 2) and frozen_lake (weight 1), 3 groups a step; `sections` replace
    the config's."""
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "agentic", "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 2,
        "model": {"path": tiny_model},
        "envs": [{"name": "guess", "id": "guess_number", "kwargs": {"high": 4}, "max_turns": 2,
                  "max_context_tokens": 96, "eval_episodes": eval_episodes, "weight": 2},
                 {"name": "lake", "id": "frozen_lake", "kwargs": {"size": 3}, "max_turns": 3,
                  "max_context_tokens": 256, "eval_episodes": eval_episodes}],
        "rollout": {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 3},
        "train": {"micro_batch_size": 6, "num_threads": 1}, "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 1},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 6}} | sections))
    return str(config)


def test_two_envs_train_and_evaluate_per_env(tmp_path, tiny_model, capsys):
    config = two_envs(tmp_path, tiny_model, eval_episodes=2)
    assert main(["train", str(config)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    for row in rows:
        assert (row["train/guess/groups"], row["train/lake/groups"]) == (2.0, 1.0)  # 2:1
        for env, turns in (("guess", 2), ("lake", 3)):
            for key in ("reward_mean", "success_rate", "infra_failure_frac", "env_errors"):
                assert f"train/{env}/{key}" in row
            assert 1 <= row[f"train/{env}/turns_mean"] <= turns  # each env's own turn limit
    last = rows[-1]
    assert {f"eval/{e}/success_rate" for e in ("guess", "lake")} <= set(last)
    assert "eval/success_rate" in last
    capsys.readouterr()

    # Resumed from step 1, step 2 draws the same env seeds, split and episodes (the mixer's
    # credit and each env's seed stream are in the checkpoint).
    step_2 = tmp_path / "run" / "rollouts" / "step_2.jsonl"
    uninterrupted = step_2.read_text()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_2")
    step_2.unlink()  # written again by the resumed run
    assert main(["train", str(config), "resume=true"]) == 0, capsys.readouterr().err
    assert step_2.read_text() == uninterrupted
    assert {json.loads(line)["env"] for line in uninterrupted.splitlines()} == {"guess", "lake"}
    capsys.readouterr()

    # `reroll eval` over the run's checkpoint plays each env with its own settings.
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tmp_path / "run" / "checkpoints" / "step_2"),
                 "--threads", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    results = json.loads(out.read_text())
    assert results["taken_from_run"]["envs"] == "envs" and results["prompts"] == 4
    assert set(results["envs"]) == {"guess", "lake"}
    for env, turns in (("guess", 2), ("lake", 3)):
        assert results["envs"][env]["prompts"] == 2
        assert 1 <= results["envs"][env]["env/turns_mean"] <= turns
        assert {f"eval/{env}/reward_mean", f"eval/{env}/success_rate"} <= set(results)


def trained_groups(run, steps) -> list[list[tuple[str, int]]]:
    """Each step's (env, env seed) groups in the order the trainer took them."""
    return [list(dict.fromkeys((r["env"], r["reward_info"]["env_seed"]) for r in map(
        json.loads, (run / "rollouts" / f"step_{n}.jsonl").read_text().splitlines())))
        for n in steps]


def test_async_two_envs_split_by_weight_and_resume_with_every_episode_once(tmp_path,
                                                                           tiny_model):
    """Issue 46: async training with several environments. One producer draws each block of
    groups split 2:1 by the envs' weights and plays each group in its own env; a run killed
    after its step-1 checkpoint (groups buffered and in flight) resumes to train the
    uninterrupted run's env seeds, step by step: none lost, none trained twice."""
    run = tmp_path / "run"
    config = two_envs(tmp_path, tiny_model, eval_episodes=0, steps=3,
                      async_training={"enabled": True, "max_staleness": 2, "max_ahead": 1,
                                      "order": "start"},
                      checkpoint={"every_steps": 1, "keep_last": 3})
    assert main(["train", str(config)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert (row["train/guess/groups"], row["train/lake/groups"]) == (2.0, 1.0)
        assert row["staleness/max"] <= 2 and "train/lake/success_rate" in row
    whole = trained_groups(run, (1, 2, 3))
    assert all(sorted(env for env, _ in step) == ["guess", "guess", "lake"] for step in whole)
    for n in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{n}")
    assert main(["train", str(config), "resume=true"]) == 0
    resumed = trained_groups(run, (2, 3))
    assert resumed == whole[1:]
    trained = sum(whole[:1] + resumed, [])
    assert len(set(trained)) == len(trained) == 9
