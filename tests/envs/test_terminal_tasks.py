"""Terminal tasks in the Harbor / Terminal-Bench folder layout (issue 45, part 4): the generated
suite is valid task by task in the real sandbox, its train and held-out tasks never meet, a
hand-written folder runs in the environment, and broken folders are named."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.envs import make_env
from reroll.envs.task_folder import load_suite, load_task
from reroll.envs.terminal_gen import FAMILIES, HELD_OUT_SEED_BASE, write_suite
from reroll.envs.terminal_tasks import check
from reroll.sandbox import Sandbox

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("terminal") / "suite"
    write_suite(out, 50, 16, seed=0)
    return out


def test_the_generated_suite_is_valid_in_the_sandbox_and_its_splits_never_meet(suite_dir):
    train, held = load_suite(suite_dir / "train"), load_suite(suite_dir / "heldout")
    assert (len(train), len(held)) == (50, 16)
    families = {t.config.metadata.category for t in train}
    assert families == set(FAMILIES) and len(families) >= 5
    seed = [t.config.metadata.model_extra["seed"] for t in train]
    held_seed = [h.config.metadata.model_extra["seed"] for h in held]
    assert max(seed) < HELD_OUT_SEED_BASE <= min(held_seed)
    assert not {t.instruction for t in train} & {h.instruction for h in held}

    async def check_all():
        sandbox = Sandbox()
        return await asyncio.gather(*(check(t, sandbox) for t in train + held))

    # each task: its tests fail after the set-up alone, and pass after its solution
    assert [why for why in asyncio.run(check_all()) if why] == []


def test_training_episodes_draw_train_tasks_and_evaluations_held_out_ones(suite_dir):
    env = make_env("terminal_tasks", tasks=str(suite_dir))
    train = {t.name for t in load_suite(suite_dir / "train")}
    held = {t.name for t in load_suite(suite_dir / "heldout")}
    assert {env.reset(seed)[1]["task"] for seed in range(8)} <= train
    # `reroll eval --env` seeds count from 10^6, a training run's evaluation from 10^9
    assert {env.reset(seed)[1]["task"] for seed in (10**6, 10**6 + 1, 10**9, 10**9 + 3)} <= held


def hand_written(root: Path) -> Path:
    """A task folder written by hand, the way a user writes one: a test that gives partial
    credit through $REWARD_FILE."""
    folder = root / "count-and-flag"
    (folder / "tests").mkdir(parents=True)
    (folder / "environment").mkdir()
    (folder / "instruction.md").write_text("Make `tool.sh` executable and write 3 to n.txt.\n")
    (folder / "task.toml").write_text(textwrap.dedent("""\
        version = "1.0"
        [metadata]
        category = "mine"
        [agent]
        timeout_sec = 30
        [verifier]
        timeout_sec = 10
        """))
    (folder / "environment" / "setup.sh").write_text("echo 'echo tool' > tool.sh\n")
    (folder / "tests" / "test.sh").write_text(textwrap.dedent("""\
        score=0
        [ -x tool.sh ] && score=$((score + 1))
        [ "$(cat n.txt 2>/dev/null)" = 3 ] && score=$((score + 1))
        echo "$score" | awk '{print $1 / 2}' > "$REWARD_FILE"
        """))
    return folder


def test_a_hand_written_folder_runs_and_the_workspace_keeps_files_and_modes(tmp_path):
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=4)
    obs, info = env.reset(0)
    assert "Make `tool.sh` executable" in obs and info == {"task": "count-and-flag",
                                                          "category": "mine"}
    out, reward, done, _, _ = env.step("ls")
    assert "tool.sh" in out and "[exit 0]" in out and not done
    env.step("chmod +x tool.sh")
    out, *_ = env.step("```bash\n[ -x tool.sh ] && echo still-executable\n```")
    assert "still-executable" in out  # the mode survived the move to the next sandbox
    obs, reward, done, _, info = env.step("submit")
    assert done and reward == 0.5 and not info["success"]  # half: n.txt was never written


def test_a_broken_or_slow_command_is_the_commands_failure_not_the_episodes(tmp_path):
    """The model's text is run as it is: a syntax error, an unknown command or a command past
    its time limit is an exit status in the observation; the working directory stays."""
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=8,
                   command_timeout_s=1.0)
    env.reset(0)
    out, *_ = env.step("( away MB) app(x over")
    assert "syntax error" in out and "[exit 2]" in out
    out, *_ = env.step("stamps coins")
    assert "command not found" in out and "[exit 127]" in out
    out, *_ = env.step("echo 3 > n.txt; sleep 30")
    assert "[exit 124]" in out
    out, *_ = env.step("cat n.txt; ls")
    assert out.startswith("3\n") and "tool.sh" in out


def test_a_step_waits_one_turn_of_a_busy_rollout_loop_not_a_dozen(tmp_path):
    """The rollout's loop also decodes: the HF engine blocks it for a decoding step per turn.
    A step's sandbox run needs a dozen loop turns; on that loop an `ls` waited 21 decoding
    steps of 0.2 s, and a slow model's episodes failed their env step time limit (21 of 24
    held-out episodes of SmolLM2). The runs go to the sandboxes' own loop instead."""
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=4)

    async def main() -> int:
        await env.areset(0)
        turns, busy = [0], True

        async def decode():  # a decoding step blocks the loop, then hands it back
            while busy:
                time.sleep(0.2)
                turns[0] += 1
                await asyncio.sleep(0)

        decoding = asyncio.create_task(decode())
        await asyncio.sleep(0)
        before = turns[0]
        out, *_ = await env.astep("ls")
        assert "tool.sh" in out
        waited = turns[0] - before
        busy = False
        await decoding
        return waited

    assert asyncio.run(main()) <= 4


def test_the_last_turn_runs_the_tests_without_submit(tmp_path):
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=2)
    env.reset(0)
    env.step("chmod +x tool.sh")
    _, reward, done, _, info = env.step("echo 3 > n.txt")
    assert done and reward == 1.0 and info["success"]


def test_bad_task_folders_are_config_errors_naming_them(tmp_path):
    folder = hand_written(tmp_path)
    (folder / "task.toml").write_text("[environment]\nallow_internet = true\n")
    with pytest.raises(ConfigError, match=r"env.kwargs: .*task.toml: environment.allow_internet"
                                          r".*needs the internet"):
        make_env("terminal_tasks", tasks=str(folder))
    with pytest.raises(ConfigError, match="env.kwargs: .*nowhere: no task folder"):
        make_env("terminal_tasks", tasks=str(tmp_path / "nowhere"))


def test_make_terminal_tasks_checks_the_suite_and_keeps_an_existing_one(tmp_path, capsys):
    out = tmp_path / "suite"
    assert main(["make-terminal-tasks", "--out", str(out), "--train", "6", "--heldout", "3",
                 "--check"]) == 0
    assert "checked 9 tasks" in capsys.readouterr().err
    before = sorted(p.name for p in (out / "train").iterdir())
    assert main(["make-terminal-tasks", "--out", str(out), "--train", "2"]) == 2
    assert sorted(p.name for p in (out / "train").iterdir()) == before
    task = load_task(out / "train" / before[0])
    assert task.solution["solve.sh"] and task.config.agent.timeout_sec == 120.0
    assert json.dumps(task.config.metadata.model_dump())
