"""Terminal tasks in the Harbor / Terminal-Bench folder layout: loading, checking, and a
hand-written task run in a real sandbox session (set-up, reference solution, verifier)."""

from __future__ import annotations

import asyncio

import pytest

from reroll.envs.task_folder import TaskFormatError, load_suite, load_task, setup, solve, verify
from reroll.sandbox import SessionManager, SessionsConfig

pytestmark = pytest.mark.unit


def write_task(root, name="count-words", toml=None):
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Write the number of words of data.txt to count.txt.\n")
    (task / "task.toml").write_text(toml if toml is not None else (
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\ncategory = "text"\n'
        "[verifier]\ntimeout_sec = 20.0\n[agent]\ntimeout_sec = 30.0\n"
        "[environment]\nmemory_mb = 512\nstorage_mb = 64\n"))
    (task / "environment" / "words.txt").write_text("alpha beta gamma\ndelta\n")
    (task / "environment" / "setup.sh").write_text("cp $ENVIRONMENT_DIR/words.txt data.txt\n")
    (task / "tests" / "test.sh").write_text(
        'test "$(cat /work/count.txt)" = "$(cat $TESTS_DIR/expected)"\n')
    (task / "tests" / "expected").write_text("4\n")
    (task / "solution" / "solve.sh").write_text("wc -w < data.txt > count.txt\n")
    return task


def test_a_task_folder_is_loaded_with_its_limits(tmp_path):
    task = load_task(write_task(tmp_path))
    assert task.name == "count-words" and task.instruction.startswith("Write the number")
    assert task.config.verifier.timeout_sec == 20 and task.config.metadata.category == "text"
    assert set(task.tests) == {"test.sh", "expected"} and "solve.sh" in task.solution
    assert task.environment == {"words.txt": b"alpha beta gamma\ndelta\n"}
    spec = task.session_spec()
    assert spec.limits.memory_bytes == 512 << 20 and spec.disk_bytes == 64 << 20
    write_task(tmp_path, "second")
    assert [t.name for t in load_suite(tmp_path)] == ["count-words", "second"]


@pytest.mark.parametrize("breakage, problem", [
    (lambda t: (t / "instruction.md").unlink(), "instruction.md: missing"),
    (lambda t: (t / "tests" / "test.sh").unlink(), "test.sh: missing"),
    (lambda t: (t / "task.toml").write_text("[agent\n"), "task.toml: not valid TOML"),
    (lambda t: (t / "task.toml").write_text("[agent]\ntimeout_secs = 3\n"),
     "agent.timeout_secs: Extra inputs"),
    (lambda t: (t / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n"),
     "verifier.timeout_sec"),
])
def test_a_broken_task_folder_names_the_file_and_the_problem(tmp_path, breakage, problem):
    folder = write_task(tmp_path)
    breakage(folder)
    with pytest.raises(TaskFormatError, match=problem.replace(".", r"\.").replace("[", r"\[")):
        load_task(folder)


@pytest.mark.bwrap
def test_a_hand_written_task_runs_in_a_session(tmp_path):
    task = load_task(write_task(tmp_path))

    async def scenario():
        async with SessionManager(SessionsConfig(warm=0)) as sessions:
            untouched = await sessions.create(task.session_spec())
            await setup(untouched, task)
            unsolved = await verify(untouched, task)
            solved_session = await sessions.create(task.session_spec())
            prepared = await setup(solved_session, task)
            ran = await solve(solved_session, task)
            solved = await verify(solved_session, task)
            return unsolved, prepared, ran, solved, await solved_session.list()

    unsolved, prepared, ran, solved, listed = asyncio.run(scenario())
    assert prepared.ok and ran.ok, (prepared, ran)
    assert not unsolved.ok and solved.ok, (unsolved, solved)
    assert {e["path"] for e in listed} == {"data.txt", "count.txt"}  # no staging left behind
