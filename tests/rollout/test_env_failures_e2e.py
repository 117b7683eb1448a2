"""A user's environment that fails every episode stops `reroll train` with exit 1 and one line
naming the env and the failure, instead of a run that "finishes" having trained nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from reroll.cli import main

BROKEN = Path(__file__).with_name("broken_envs.py")


@pytest.mark.e2e
def test_an_env_that_fails_every_episode_stops_reroll_train_with_exit_1(tmp_path, tiny_model,
                                                                        capsys):
    config = tmp_path / "broken.yaml"
    config.write_text(yaml.safe_dump({
        "pipeline": "agentic", "name": "broken", "output_dir": str(tmp_path / "run"),
        "seed": 0, "steps": 3, "model": {"path": tiny_model},
        # `isolation` auto: a user's env runs in an env host process
        "env": {"id": f"{BROKEN}:NaNReward", "max_turns": 2, "max_context_tokens": 128,
                "eval_episodes": 0},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
        "train": {"num_threads": 1}, "checkpoint": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False}}))
    code = main(["train", str(config)])
    output = capsys.readouterr().err
    assert code == 1, output
    stopped = [line for line in output.splitlines() if line.startswith("run stopped:")]
    assert stopped == [
        f"run stopped: step 1: environment '{BROKEN}:NaNReward' failed in 4 of 4 episodes this "
        f"step (100%), at or past the bound of 100% (env.max_failure_rate_step); the last "
        f"failure: env.step returned a non-finite reward (nan)"], output
    assert "Traceback" not in output and "finished" not in output, output
