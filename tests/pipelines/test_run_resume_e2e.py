"""Every kind of run goes through one loop (reroll/pipelines/run.py), so every kind resumes the
same way: a run stopped after a checkpoint and resumed is the uninterrupted run, metric for
metric and weight for weight. Three steps each on the tiny model: the cheapest run that has a
checkpoint to resume from and a step after it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from reroll.config import load_config
from reroll.data.preferences import write_arithmetic_preferences
from reroll.pipelines.run import train
from reroll.tracking import read_metrics
from reroll.viewer.rundata import load_run

pytestmark = pytest.mark.e2e

COMMON = {"seed": 3, "steps": 3, "optimizer": {"lr": 1e-3, "warmup_steps": 1},
          "checkpoint": {"every_steps": 1, "keep_last": 3},
          "tracking": {"progress": False, "tensorboard": False}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    paths = write_arithmetic_preferences(tmp_path_factory.mktemp("pairs"), train_size=40,
                                         eval_size=8, seed=0)
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model) -> str:
    """The tiny model with other weights (the same tokenizer) to distil from."""
    out = tmp_path_factory.mktemp("teacher") / "tiny"
    shutil.copytree(tiny_model, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
               for k, v in weights.items()}, out / "model.safetensors")
    return str(out)


def sections(kind: str, tiny_model: str, arithmetic: dict, pairs: dict, teacher: str) -> dict:
    sft_data = {"train": arithmetic["train"], "eval": arithmetic["eval"],
                "response_key": "solution"}
    pair_data = {"train": pairs["train"], "eval": pairs["eval"]}
    return {
        "rlvr": {"data": {"train": arithmetic["train"], "eval": arithmetic["eval"]},
                 "eval": {"max_prompts": 4, "every_steps": 2},
                 "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 8},
                 "train": {"micro_batch_size": 8, "num_threads": 1}},
        "sft": {"data": sft_data, "batch_size": 8, "train": {"micro_batch_size": 8}},
        "distill": {"data": sft_data, "batch_size": 8, "train": {"micro_batch_size": 8},
                    "teacher": {"path": teacher}, "distill": {"top_k": 4}},
        "dpo": {"data": pair_data, "batch_size": 4, "eval_every_steps": 2, "sample_prompts": 2,
                "sample_max_new_tokens": 4, "train": {"micro_batch_size": 8}},
        "rm": {"data": pair_data, "batch_size": 4, "train": {"micro_batch_size": 8}},
    }[kind]


def untimed(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_metrics(run)]


@pytest.mark.parametrize("kind", ["rlvr", "sft", "distill", "dpo", "rm"])
def test_a_resumed_run_is_the_uninterrupted_one(kind, tmp_path, tiny_model, arithmetic, pairs,
                                                teacher):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"pipeline": kind, "output_dir": str(tmp_path / "run"),
                                    "model": {"path": tiny_model}, **COMMON,
                                    **sections(kind, tiny_model, arithmetic, pairs, teacher)}))
    whole = train(load_config(path))
    run = Path(whole["run_dir"])
    assert whole["pipeline"] == kind and whole["steps"] == 3 and whole["eval_start"]
    metrics = untimed(run)
    last = load_file(run / "checkpoints" / "step_3" / "model.safetensors")

    # As if the run died during step 3: its checkpoint, final model and summary never written.
    shutil.rmtree(run / "checkpoints" / "step_3")
    shutil.rmtree(run / "final", ignore_errors=True)
    (run / "summary.json").unlink()
    resumed = train(load_config(path, ["resume=true"]))

    assert resumed["resumed_from_step"] == 2
    assert resumed["eval_start"] == whole["eval_start"]
    assert resumed["eval_end"] == whole["eval_end"]
    assert untimed(run) == metrics
    again = load_file(run / "checkpoints" / "step_3" / "model.safetensors")
    assert again.keys() == last.keys()
    assert all(torch.equal(again[k], last[k]) for k in again)


def one_step(kind: str, tmp_path: Path, tiny_model: str, arithmetic: dict, pairs: dict,
             teacher: str, **extra) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"pipeline": kind, "output_dir": str(tmp_path / "run"),
                                    "model": {"path": tiny_model}, **COMMON,
                                    **sections(kind, tiny_model, arithmetic, pairs, teacher),
                                    "steps": 1, **extra}))
    return path


def test_a_run_says_what_it_does_from_its_first_second(tmp_path, tiny_model, arithmetic, pairs,
                                                       teacher, capfd):
    """Loading, the evaluation before step 1 (minutes for a few agentic episodes) and step 1's
    rollouts are said as they start, before the progress bar has anything to show."""
    path = one_step("rlvr", tmp_path, tiny_model, arithmetic, pairs, teacher,
                    tracking={"progress": True, "tensorboard": False})
    train(load_config(path))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    said = [i for i, line in enumerate(lines) if line.startswith("reroll: ")
            and "machine is busy" not in line]  # said only when the test's machine is busy
    assert len(said) == 3, lines
    assert "loading" in lines[said[0]] and tiny_model in lines[said[0]]
    assert "evaluating on 4 held-out prompts before step 1" in lines[said[1]]
    assert "step 1 of 1: generating rollouts" in lines[said[2]]
    first_progress = next(i for i, line in enumerate(lines) if "step 1/1" in line)
    assert said[-1] < first_progress


def test_dpo_answers_held_out_prompts_greedily_before_and_after(tmp_path, tiny_model, arithmetic,
                                                                pairs, teacher):
    """Preference accuracy can rise while the model forgets what it knew: the policy's greedy
    answers to a few held-out prompts, before the first and after the last step, show it."""
    path = one_step("dpo", tmp_path, tiny_model, arithmetic, pairs, teacher, steps=2)
    train(load_config(path))
    rollouts = tmp_path / "run" / "rollouts"
    assert sorted(p.name for p in rollouts.iterdir()) == ["eval_step_0.jsonl",
                                                          "eval_step_2.jsonl"]
    for name in ("eval_step_0.jsonl", "eval_step_2.jsonl"):
        rows = [json.loads(line) for line in (rollouts / name).read_text().splitlines()]
        assert len(rows) == 2
        assert all(row["prompt"] and isinstance(row["response"], str) for row in rows)
    assert sorted(load_run(tmp_path / "run").eval_rollouts) == [0, 2]  # in the report
