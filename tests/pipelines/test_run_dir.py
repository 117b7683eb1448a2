"""Checkpoints and run directories (issue 16, section 5): a checkpoint becomes `step_N/` only
when complete, resume skips an unreadable one, a run directory holding another run is refused
unless `overwrite`, a finished run resumed changes nothing, and `eval --out` is checked first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.pipelines.common import RunDir, checkpoint_problem

pytestmark = pytest.mark.unit


def fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint's files (config.json, weights, trainer state) without training a model."""
    from safetensors.torch import save_file

    path = root / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    save_file({"w": torch.ones(64, 64)}, str(path / "model.safetensors"))
    torch.save({"extra": {"step": step}}, path / "trainer_state.pt")
    return path


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage, named", [
    (lambda p: truncate(p / "model.safetensors"), "model.safetensors is truncated"),
    (lambda p: truncate(p / "model.safetensors", 0.001), "model.safetensors"),
    (lambda p: truncate(p / "trainer_state.pt"), "trainer_state.pt is truncated"),
    (lambda p: (p / "config.json").unlink(), "config.json is missing"),
])
def test_resume_skips_an_unreadable_newest_checkpoint(tmp_path, caplog, damage, named):
    fake_checkpoint(tmp_path, 1)
    newest = fake_checkpoint(tmp_path, 2)
    assert checkpoint_problem(newest) is None
    damage(newest)
    assert named in checkpoint_problem(newest)
    run_dir = RunDir(tmp_path)
    with caplog.at_level("WARNING"):
        assert run_dir.resolve_resume(True) == (1, tmp_path / "checkpoints" / "step_1")
    assert "skipping" in caplog.text and "step_2" in caplog.text
    with pytest.raises(ConfigError, match="incomplete or unreadable"):
        run_dir.resolve_resume(str(newest))


def test_no_complete_checkpoint_is_a_config_error(tmp_path):
    truncate(fake_checkpoint(tmp_path, 1) / "trainer_state.pt")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        RunDir(tmp_path).resolve_resume(True)


def test_a_checkpoint_is_staged_then_renamed_and_leftovers_are_removed(tmp_path):
    run_dir = RunDir(tmp_path)
    staging = run_dir.staging_dir(3)
    staging.mkdir(parents=True)
    (staging / "trainer_state.pt").write_bytes(b"half")
    assert run_dir.checkpoints() == []  # a partial write is never taken for a checkpoint
    RunDir.for_run(tmp_path, True, False)
    assert not staging.exists()
    fake_checkpoint(tmp_path, 1)
    staging = run_dir.staging_dir(2)
    staging.mkdir()
    (staging / "trainer_state.pt").write_bytes(b"x")
    assert run_dir.commit(2) == tmp_path / "checkpoints" / "step_2"
    assert [s for s, _ in run_dir.checkpoints()] == [1, 2]


def test_a_directory_holding_a_run_is_refused_unless_overwrite(tmp_path):
    fake_checkpoint(tmp_path, 1)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="resume=true .* overwrite=true"):
        RunDir.for_run(tmp_path, False, False)
    assert (tmp_path / "metrics.jsonl").exists()
    RunDir.for_run(tmp_path, False, True)
    assert list(tmp_path.iterdir()) == []
    RunDir.for_run(tmp_path, False, False)  # empty: fine


def test_overwrite_never_empties_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="not a reroll run directory"):
        RunDir.for_run(tmp_path, False, True)
    assert (tmp_path / "thesis.tex").exists()


def test_output_dir_that_is_a_file_or_not_writable(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        RunDir(tmp_path / "f")
    with pytest.raises(ConfigError, match="cannot be created or written"):
        RunDir(Path("/proc/self/reroll-run"))


def test_finished_run_is_reported_and_fewer_steps_is_an_error(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    summary = {"run_dir": str(tmp_path), "steps": 2, "eval_reward_end": 0.5}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    before = (tmp_path / "summary.json").read_bytes()
    run_dir = RunDir(tmp_path)
    with caplog.at_level("WARNING"):
        assert run_dir.finished_summary(True, 2) == summary | {"already_finished": True}
    assert "already finished at step 2" in caplog.text
    assert (tmp_path / "summary.json").read_bytes() == before
    with pytest.raises(ConfigError, match="steps=1: the run already has 2 steps"):
        run_dir.finished_summary(True, 1)
    assert run_dir.finished_summary(True, 3) is None
    assert run_dir.finished_summary(False, 2) is None


def test_eval_out_to_an_unwritable_place_fails_before_evaluating(tmp_path, tiny_model, capsys):
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "res.json", Path("/proc/self/res.json"), tmp_path):
        # --max-new-tokens 0 would be refused by the evaluation: reaching it would say so
        assert main(["eval", "--model", tiny_model, "--task", "arithmetic", "--out",
                     str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and str(out.parent if out != tmp_path else out) in err, err


# -- the real pipeline on the tiny model --------------------------------------------------------


def rl_yaml(tmp_path: Path, tiny_model: str, arithmetic: dict, **extra) -> Path:
    data = {"output_dir": str(tmp_path / "run"), "steps": 2, "model": {"path": tiny_model},
            "data": {"train": arithmetic["eval"]},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
            "train": {"micro_batch_size": 4}, "eval": {"every_steps": 0},
            "checkpoint": {"every_steps": 1, "keep_last": 5},
            "tracking": {"progress": False, "tensorboard": False}, **extra}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.e2e
def test_kill_during_a_checkpoint_write_then_resume(tmp_path, tiny_model, arithmetic,
                                                    monkeypatch):
    """A run killed while writing step 2's trainer state: no `step_2/` appears, and resume
    continues from step 1 (it used to load the torn file and end in a traceback)."""
    from reroll.config import load_config
    from reroll.pipelines.rlvr import train

    config = rl_yaml(tmp_path, tiny_model, arithmetic)
    real_save, calls = torch.save, []

    def dies_on_the_second_state(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state.pt"):
            calls.append(f)
            if len(calls) == 2:
                real_save(obj, f, *args, **kwargs)
                truncate(Path(f))
                raise KeyboardInterrupt  # stands in for kill -9 mid-write
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_the_second_state)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(config))
    monkeypatch.setattr(torch, "save", real_save)
    run = tmp_path / "run"
    assert [s for s, _ in RunDir(run).checkpoints()] == [1]
    summary = train(load_config(config, ["resume=true"]))
    assert summary["resumed_from_step"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2]


@pytest.mark.e2e
def test_run_directory_rules_through_the_cli(tmp_path, tiny_model, arithmetic, capsys, caplog):
    """(Messages that are warnings go through logging, which pytest captures in `caplog`.)"""
    config = str(rl_yaml(tmp_path, tiny_model, arithmetic))
    run = tmp_path / "run"
    assert main(["train", config]) == 0
    summary_bytes = (run / "summary.json").read_bytes()
    capsys.readouterr()

    # Same directory, no resume: refused, and nothing of the old run is touched.
    assert main(["train", config]) == 2
    assert "overwrite=true" in capsys.readouterr().err
    assert (run / "summary.json").read_bytes() == summary_bytes

    # Resume of the finished run: says so, changes nothing.
    caplog.set_level("WARNING")
    assert main(["train", config, "resume=true"]) == 0
    assert "already finished" in caplog.text
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["already_finished"]
    assert (run / "summary.json").read_bytes() == summary_bytes
    assert main(["train", config, "resume=true", "steps=1"]) == 2
    assert "steps=1" in capsys.readouterr().err

    # A torn newest checkpoint: resume says it skips it and continues from step 1.
    truncate(run / "checkpoints" / "step_2" / "model.safetensors")
    assert main(["train", config, "resume=true", "steps=3"]) == 0
    captured = capsys.readouterr()
    assert "skipping" in caplog.text and "step_2/model.safetensors" not in caplog.text
    assert "model.safetensors is truncated" in caplog.text
    assert json.loads(captured.out.strip().splitlines()[-1])["resumed_from_step"] == 1
    assert checkpoint_problem(run / "checkpoints" / "step_2") is None  # rewritten whole

    # overwrite=true starts over in a clean directory.
    assert main(["train", config, "overwrite=true", "steps=1"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    assert os.path.getsize(run / "metrics.jsonl") > 0


def test_resume_drops_a_metrics_line_cut_short_by_a_kill(tmp_path):
    """kill -9 while a metrics line was written: resume keeps the steps up to its checkpoint
    (it used to end in a JSONDecodeError traceback)."""
    from reroll.tracking.tracker import JsonlSink

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    JsonlSink(path, resume_step=2).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
