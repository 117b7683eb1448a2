"""A VLM run stopped after a checkpoint and resumed is the uninterrupted run, metric for metric
and weight for weight: the resumed run re-encodes its image rows with the checkpoint's processor
and draws the same prompts, so the images reach the same forwards."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.config import load_config
from reroll.data.images import write_count_task
from reroll.pipelines.run import train
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


def untimed(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_metrics(run)]


def test_a_resumed_vlm_run_is_the_uninterrupted_one(tiny_vlm, tmp_path):
    paths = write_count_task(tmp_path / "task", train_size=8, eval_size=2, seed=0)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "name": "vlm", "seed": 3, "steps": 3, "output_dir": str(tmp_path / "run"),
        "model": {"path": tiny_vlm},
        "data": {"train": str(paths["train"]), "eval": str(paths["eval"])},
        "eval": {"max_prompts": 2, "every_steps": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"micro_batch_size": 4, "num_threads": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 3},
        "tracking": {"progress": False, "tensorboard": False}}))
    whole = train(load_config(path))
    run = Path(whole["run_dir"])
    assert whole["steps"] == 3
    metrics = untimed(run)
    last = load_file(run / "checkpoints" / "step_3" / "model.safetensors")

    # As if the run died during step 3: its checkpoint, final model and summary never written.
    shutil.rmtree(run / "checkpoints" / "step_3")
    shutil.rmtree(run / "final", ignore_errors=True)
    (run / "summary.json").unlink()
    resumed = train(load_config(path, ["resume=true"]))

    assert resumed["resumed_from_step"] == 2
    assert resumed["eval_end"] == whole["eval_end"]
    assert untimed(run) == metrics
    again = load_file(run / "checkpoints" / "step_3" / "model.safetensors")
    assert again.keys() == last.keys() and any("vision" in k for k in again)
    assert all(torch.equal(again[k], last[k]) for k in again)
