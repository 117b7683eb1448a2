"""The Python API on the tiny model: a run with reward functions and datasets passed as objects
returns its summary, resumes to the same numbers with the same objects, refuses other objects,
and a CLI resume works exactly when the functions are importable; an environment class and an
SFT dataset passed as objects; a Ray-executor run with a lambda reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import reroll
from reroll.cli import main
from reroll.config.errors import ConfigError

pytestmark = pytest.mark.e2e

NUMERIC = ("time/",)


def digit_share(sample) -> float:
    """Share of the response's characters that are digits: varies per sample, so groups have
    a signal and the policy updates."""
    return sum(c.isdigit() for c in sample.response) / max(len(sample.response), 1)


def rows(n: int = 24) -> list[dict]:
    return [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": 1}
            for a in range(n // 4) for b in range(4)]


def config(tmp_path: Path, tiny_model: str, name: str, **extra) -> dict:
    return {"output_dir": str(tmp_path / name), "seed": 2, "steps": 4,
            "model": {"path": tiny_model},
            "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
            "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 16, "num_threads": 1},
            "eval": {"every_steps": 2, "temperature": 1.0},
            "checkpoint": {"every_steps": 2, "keep_last": 3},
            "tracking": {"progress": False, "tensorboard": False}, **extra}


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(NUMERIC)} for row in history]


def test_objects_run_return_a_summary_and_resume_to_the_same_numbers(tmp_path, tiny_model):
    datasets = pytest.importorskip("datasets")
    train_set = datasets.Dataset.from_list(rows())
    short = lambda s: float(len(s.response) < 20)  # noqa: E731 - a lambda is the point
    objects = dict(reward_funcs=[digit_share, short], reward_weights=[1.0, 0.5],
                   train_dataset=train_set, eval_dataset=rows()[:4])
    straight = reroll.train(config(tmp_path, tiny_model, "straight"), **objects)
    assert straight.pipeline == "rlvr" and straight.steps == 4
    assert [p.name for p in straight.checkpoints] == ["step_2", "step_4"]
    assert straight.final_checkpoint == straight.checkpoints[-1]
    assert straight.metrics["step"] == 4 and "eval/reward_mean" in straight.metrics
    assert straight["eval_reward_end"] == straight.metrics["eval/reward_mean"]
    assert straight.history()[-1] == straight.metrics
    # The score is the weighted sum of the functions', each recorded with the rollout.
    recorded = [json.loads(line) for line in
                (straight.run_dir / "rollouts" / "step_4.jsonl").open()]
    for row in recorded:
        parts = row["reward_info"]["rewards"]
        assert set(parts) == {f"{__name__}:digit_share", f"{__name__}:test_objects_run_return_a_"
                              "summary_and_resume_to_the_same_numbers.<locals>.<lambda>"}
        assert row["reward"] == pytest.approx(sum(w * s for w, s in
                                                  zip([1.0, 0.5], parts.values(), strict=True)))
    assert any(r["train/loss"] != 0 for r in straight.history())  # the policy was updated

    # Half the run, then resumed from Python with the same objects: the same numbers.
    trainer = reroll.Trainer(config(tmp_path, tiny_model, "halves"), overrides={"steps": 2},
                             **objects)
    first = trainer.train()
    assert first.steps == 2 and first.checkpoints[-1].name == "step_2"
    trainer.overrides = {"steps": 4}
    resumed = trainer.train(resume=True)
    assert resumed["resumed_from_step"] == 2
    assert comparable(resumed.history()) == comparable(straight.history())

    # Other objects for the same run are refused; so is a CLI resume of the lambda.
    with pytest.raises(ConfigError, match="reward_funcs, reward_weights and env: differs"):
        reroll.train(config(tmp_path, tiny_model, "halves", steps=6, resume=True),
                     **objects | {"reward_weights": [1.0, 1.0]})
    assert main(["train", str(resumed.run_dir / "config.yaml"), "resume=true", "steps=6"]) == 2


def test_a_cli_resume_rebuilds_importable_functions(tmp_path, tiny_model, capsys):
    first = reroll.train(config(tmp_path, tiny_model, "cli", steps=2), reward_funcs=digit_share,
                         train_dataset=rows())
    saved = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    assert saved["data"]["train"] == str(first.run_dir / "inputs" / "train.jsonl")
    assert saved["reward"]["functions"] == [f"{__name__}:digit_share"]
    # config.yaml names the function and the saved dataset: `reroll train` continues the run.
    assert main(["train", str(first.run_dir / "config.yaml"), "resume=true", "steps=3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3


class SayYes:
    """Answer `yes` within two turns to score 1."""

    def __init__(self, reward: float = 1.0):
        self.reward, self.turns = reward, 0

    def reset(self, seed=None):
        self.turns = 0
        return "Say yes.", {}

    def step(self, action):
        self.turns += 1
        won = "yes" in action
        done = won or self.turns >= 2
        return ("" if done else "Again."), self.reward * won, done, False, {"success": won}


def test_an_environment_class_runs_the_agentic_pipeline(tmp_path, tiny_model):
    summary = reroll.train({**config(tmp_path, tiny_model, "agentic", steps=2),
                            "env": {"kwargs": {"reward": 2.0}, "max_turns": 2,
                                    "eval_episodes": 2}},
                           env=SayYes)
    assert summary.pipeline == "agentic" and summary.steps == 2
    assert "train/success_rate" in summary.metrics and "eval/success_rate" in summary.metrics
    recorded = (summary.run_dir / "config.yaml").read_text()
    assert f"id: {__name__}:SayYes" in recorded
    notes = json.loads((summary.run_dir / "inputs" / "python_objects.json").read_text())
    assert notes["env"] == f"{__name__}:SayYes"


def test_sft_on_a_list_of_dicts(tmp_path, tiny_model):
    data = [dict(r, response=f"The answer is {r['answer']}.") for r in rows()]
    summary = reroll.sft({"pipeline": "sft", "output_dir": str(tmp_path / "sft"),
                          "model": {"path": tiny_model}, "batch_size": 8, "epochs": 1.0,
                          "train": {"micro_batch_size": 8, "num_threads": 1},
                          "tracking": {"progress": False, "tensorboard": False}},
                         train_dataset=data, eval_dataset=data[:4])
    assert summary.pipeline == "sft" and summary.steps == 3
    assert (summary.final_checkpoint / "config.json").is_file()
    assert summary["eval_nll_end"] < summary["eval_nll_start"]
    assert "sft/nll" in summary.metrics


@pytest.mark.ray
def test_a_lambda_reward_with_the_ray_executor(tmp_path, tiny_model):
    """Rewards run in the driver (their calls in its reward worker processes), so objects need
    no shipping to Ray actors: the policy and the engine there train as usual."""
    import ray

    from reroll.distributed.ray_runtime import ensure_ray

    ensure_ray(num_cpus=2)
    try:
        summary = reroll.train(config(tmp_path, tiny_model, "ray", steps=2,
                                      distributed={"executor": "ray"}),
                               reward_funcs=[lambda s: float(len(s.response) % 3 == 0)],
                               train_dataset=rows())
    finally:
        ray.shutdown()
    assert summary.steps == 2 and summary.metrics["reward/errors"] == 0
