"""`reroll sft` has RL's `steps`, `resume` and checkpoint semantics: a step limit, checkpoints
under `checkpoints/step_N/`, and a resumed run that is the uninterrupted one bit for bit."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from reroll.cli import main
from reroll.config import load_config
from reroll.pipelines.sft import train_sft
from reroll.tracking import read_metrics

pytestmark = pytest.mark.e2e


def sft_config(path: Path, tiny_model: str, arithmetic: dict, **extra) -> Path:
    path.write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(path.parent / "run"), "seed": 2,
        "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"], "eval": arithmetic["eval"],
                 "response_key": "solution"},
        "batch_size": 16, "optimizer": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
        "train": {"micro_batch_size": 8, "num_threads": 1},
        "checkpoint": {"every_steps": 2},
        "tracking": {"progress": False, "tensorboard": False}, **extra}))
    return path


def untimed(run_dir: str) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_metrics(run_dir)]


def weights(directory: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def test_steps_limits_the_run_and_wins_over_epochs(tmp_path, tiny_model, arithmetic, capsys):
    config = load_config(sft_config(tmp_path / "sft.yaml", tiny_model, arithmetic, epochs=5.0),
                         ["steps=3", "tracking.progress=true"], expect="sft")
    summary = train_sft(config)
    # stderr is not a terminal here: plain progress lines instead of a bar
    progress = [line for line in capsys.readouterr().err.splitlines() if "SFT step" in line]
    assert [line.split(" | ")[0] for line in progress] == [f"SFT step {i}/3" for i in (1, 2, 3)]
    assert summary["steps"] == 3
    assert [row["step"] for row in read_metrics(summary["run_dir"]) if "sft/nll" in row] == [1, 2, 3]
    kept = sorted(p.name for p in (Path(summary["run_dir"]) / "checkpoints").iterdir())
    assert kept == ["step_2", "step_3"]


def test_resume_continues_bit_identically(tmp_path, tiny_model, arithmetic, capsys):
    config = sft_config(tmp_path / "sft.yaml", tiny_model, arithmetic, steps=5,
                        checkpoint={"every_steps": 2, "keep_last": 5})
    assert main(["sft", str(config)]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # Pretend the run died during step 4: the step-2 checkpoint and metrics up to step 3 exist.
    run = Path(whole["run_dir"])
    full_metrics, full_weights = untimed(run), weights(whole["final_model"])
    for step in (4, 5):
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    shutil.rmtree(run / "final")
    lines = (run / "metrics.jsonl").read_text().splitlines()[:3]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    assert main(["sft", str(config), "resume=true"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 5
    assert resumed["eval_nll_start"] == whole["eval_nll_start"]
    assert untimed(run) == full_metrics
    again = weights(resumed["final_model"])
    assert again.keys() == full_weights.keys()
    assert all(torch.equal(again[k], full_weights[k]) for k in again)

    # Resuming a finished run changes nothing; fewer steps than done is an error.
    assert main(["sft", str(config), "resume=true"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["already_finished"]
    assert main(["sft", str(config), "resume=true", "steps=3"]) == 2
    assert "resume with steps >= 5" in capsys.readouterr().err
