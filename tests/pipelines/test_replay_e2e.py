"""`reroll replay`: a recorded step recomputed from its stored batch and the checkpoint before it
gives the logged losses and the next checkpoint's weights exactly; a config change shows up."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from reroll.cli import main
from reroll.config import load_config
from reroll.pipelines.replay import replay_step
from reroll.pipelines.rlvr import train

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_model, arithmetic):
    root = tmp_path_factory.mktemp("replay")
    config = root / "rl.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(root / "run"), "seed": 3, "steps": 3, "model": {"path": tiny_model},
        "data": {"train": arithmetic["train"]},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "reward": {"type": "custom", "function": "parity_reward:odd_length"},
        "algorithm": {"updates_per_batch": 2},
        "optimizer": {"lr": 1e-3}, "train": {"micro_batch_size": 4, "num_threads": 1},
        # Steps 1 and 2 written and kept by keep_steps alone (every_steps 0, keep_last 1).
        "checkpoint": {"every_steps": 0, "keep_last": 1, "keep_steps": [1, 2]},
        "tracking": {"progress": False, "tensorboard": False, "record_rollouts": 2}}))
    sys.path.insert(0, str(HERE))
    yield train(load_config(config))["run_dir"]
    sys.path.remove(str(HERE))


def test_recording_stores_every_trajectory_of_each_step(recorded_run):
    from reroll.rollout.recording import batch_path, load_batch

    trajectories = load_batch(batch_path(Path(recorded_run), 2))
    assert len(trajectories) == 16 and {t.group_id for t in trajectories} == {0, 1, 2, 3}
    text_rows = (Path(recorded_run) / "rollouts" / "step_2.jsonl").read_text().splitlines()
    assert len(text_rows) == 2


@pytest.mark.parametrize("step", [1, 3])
def test_replay_reproduces_the_step_and_its_weights(recorded_run, step):
    result = replay_step(recorded_run, step)
    assert result["matches"], result["metrics"]
    assert result["weights_match_checkpoint"] is True
    loss = result["metrics"]["train/loss"]
    assert loss["replayed"] == loss["recorded"] and loss["recorded"] != 0.0
    assert result["metrics"]["train/reward_mean"]["abs_diff"] == 0.0


def test_replay_with_a_changed_config_shows_the_difference(recorded_run):
    result = replay_step(recorded_run, 2, ["algorithm.loss_agg=seq_mean_token_sum"])
    assert not result["matches"]
    assert result["weights_match_checkpoint"] is False
    loss = result["metrics"]["train/loss"]
    assert loss["abs_diff"] > 1e-3 and result["overrides"] == ["algorithm.loss_agg=seq_mean_token_sum"]


def test_replay_command_prints_a_table_and_json(recorded_run, capsys):
    assert main(["replay", recorded_run, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "reproduces the recorded step" in out
    assert json.loads(out.strip().splitlines()[-1])["matches"] is True


def test_replay_without_the_checkpoint_before_is_a_clear_error(recorded_run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(recorded_run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_1")
    assert main(["replay", str(copy), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert "checkpoints/step_1" in err and "checkpoint.keep_steps" in err
    assert "Steps that can be replayed: 1, 3." in " ".join(err.split())


def test_replay_of_a_step_without_a_batch_lists_the_steps_that_exist(recorded_run, capsys):
    assert main(["replay", recorded_run, "--step", "7"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "step_7.batch.pt does not exist" in err and "Steps that can be replayed: 1, 2, 3." in err


def test_replay_accepts_overrides_after_the_step(recorded_run, capsys):
    """`reroll replay RUN --step N key=value`, as docs/eval.md shows it."""
    assert main(["replay", recorded_run, "--step", "2", "algorithm.loss_agg=seq_mean_token_sum"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["overrides"] == ["algorithm.loss_agg=seq_mean_token_sum"]
    assert not result["matches"]


def test_unknown_options_after_the_run_are_still_refused(recorded_run):
    with pytest.raises(SystemExit) as exit_:
        main(["replay", recorded_run, "--step", "2", "--bogus"])
    assert exit_.value.code == 2


def test_replay_of_an_agentic_run(tmp_path, tiny_model):
    """Multi-turn episodes (policy and environment tokens in one response) replay the same way."""
    config = tmp_path / "agentic.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "agentic", "output_dir": str(tmp_path / "run"), "seed": 0, "steps": 2,
        "model": {"path": tiny_model},
        "env": {"id": "countdown", "kwargs": {"count": 3, "max_number": 9},
                "max_turns": 3},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16},
        "algorithm": {"advantage": {"name": "rebn", "gamma": 0.95}, "loss_agg": "token_mean"},
        "train": {"micro_batch_size": 8, "num_threads": 1}, "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 1},
        "tracking": {"progress": False, "tensorboard": False}}))
    assert main(["train", str(config)]) == 0
    result = replay_step(tmp_path / "run", 2)
    assert result["matches"] and result["weights_match_checkpoint"] is True
    assert "train/loss" in result["metrics"]
