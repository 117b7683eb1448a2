"""Which steps write a checkpoint and which are kept: `checkpoint.keep_steps` keeps the
checkpoints `reroll replay` starts from (the demo's documented `--step 11` and `--step 21`)."""

from pathlib import Path

import pytest

from reroll.config import load_config
from reroll.config.errors import ConfigError
from reroll.config.schema import CheckpointConfig
from reroll.pipelines.checkpoints import checkpoint_due, prune_checkpoints
from reroll.pipelines.common import RunDir
from reroll.pipelines.replay import replayable_steps

ROOT = Path(__file__).resolve().parents[2]


def simulate(run: Path, config: CheckpointConfig, steps: int, batches: bool = True) -> list[int]:
    """The checkpoint phase of `steps` training steps, with empty stand-in checkpoints."""
    run_dir = RunDir(run)
    for step in range(1, steps + 1):
        if batches:
            (run / "rollouts").mkdir(exist_ok=True)
            (run / "rollouts" / f"step_{step}.batch.pt").write_bytes(b"")
        if checkpoint_due(config, step, steps):
            directory = run_dir.checkpoint_dir(step)
            directory.mkdir(parents=True)
            (directory / "trainer_state.pt").write_bytes(b"")
            prune_checkpoints(run_dir, config)
    return [step for step, _ in run_dir.checkpoints()]


def test_without_keep_steps_only_the_newest_are_kept(tmp_path):
    kept = simulate(tmp_path, CheckpointConfig(every_steps=10, keep_last=2), 40)
    assert kept == [30, 40]
    assert replayable_steps(tmp_path) == [1, 31]


def test_keep_steps_are_written_and_never_pruned(tmp_path):
    config = CheckpointConfig(every_steps=0, keep_last=1, keep_steps=[3, 5])
    assert simulate(tmp_path, config, 8) == [3, 5, 8]
    assert replayable_steps(tmp_path) == [1, 4, 6]


def test_the_demo_config_keeps_what_the_documented_replays_need(tmp_path):
    """README: `reroll replay runs/arithmetic-grpo --step 11`; docs/eval.md: `--step 21`."""
    config = load_config(ROOT / "examples" / "arithmetic" / "grpo.yaml")
    simulate(tmp_path, config.checkpoint, config.steps)
    assert {11, 21} <= set(replayable_steps(tmp_path))


def test_keep_steps_count_from_one():
    with pytest.raises(ConfigError, match="keep_steps"):
        load_config(ROOT / "examples" / "arithmetic" / "grpo.yaml", ["checkpoint.keep_steps=[0]"])


@pytest.mark.unit
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, tiny_model, arithmetic,
                                                                  monkeypatch, capfd):
    """Issue 49: a full disk while a checkpoint was written was a serializer traceback. Now:
    one line naming the step, exit 1, the partial checkpoint removed, step 1's kept."""
    import errno

    import yaml

    from reroll.cli import main
    from reroll.training.local import LocalStrategy

    save = LocalStrategy.save

    def fills_the_disk_at_step_2(self, directory, extra):
        if extra["step"] == 2:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "model.safetensors").write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, directory, extra)

    monkeypatch.setattr(LocalStrategy, "save", fills_the_disk_at_step_2)
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "sft", "output_dir": str(tmp_path / "run"), "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"]}, "steps": 3, "batch_size": 2,
        "checkpoint": {"every_steps": 1},
        "tracking": {"progress": False, "tensorboard": False}}))
    assert main(["sft", str(config)]) == 1
    err = capfd.readouterr().err
    assert "no space left on device, checkpoint step 2 not written" in err, err[-2000:]
    assert "Traceback" not in err
    run_dir = RunDir(tmp_path / "run")
    assert [step for step, _ in run_dir.checkpoints()] == [1]
    assert not list((tmp_path / "run" / "checkpoints").glob("*.partial"))
@pytest.mark.parametrize("pipeline", ["sft", "dpo", "rlvr"])
def test_every_run_checkpoints_periodically_by_default(pipeline):
    """An SFT run killed at step 10 of 12 left nothing to resume: by default a run now writes a
    checkpoint about every tenth of its steps (at most 50 apart), whatever its pipeline."""
    from reroll.config.pipelines import KINDS

    default = KINDS[pipeline].config.model_fields["checkpoint"].default_factory()
    assert [s for s in range(1, 13) if checkpoint_due(default, s, 12)] == list(range(1, 13))
    assert [s for s in range(1, 101) if checkpoint_due(default, s, 100)] == list(range(10, 101, 10))
    assert checkpoint_due(default, 50, 5000) and not checkpoint_due(default, 60, 5000)
    assert [s for s in range(1, 13) if checkpoint_due(CheckpointConfig(every_steps=0), s, 12)] \
        == [12]
