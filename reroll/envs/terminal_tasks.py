"""`env.id: terminal_tasks`: task folders in the Harbor / Terminal-Bench layout
(`reroll.envs.task_folder` reads them; `reroll.envs.terminal_gen` generates a suite) as an
environment, and the check that a task is sound.

By default each command runs in a fresh one-shot sandbox (no network, no host path, the task's
limits); the working directory is carried from one to the next as an archive, so files, folders
and their modes persist, and a command's shell state (`cd`, variables) does not. With
``sessions`` (a `SessionsConfig`: in this process or through `reroll sandbox serve`) the episode
runs in one sandbox session: the set-up, every command (cwd and variables persist) and the
tests; a session lost on the way (the service gone, its time to live passed, its sandbox
crashed) fails the episode as an infrastructure failure naming the cause, never a reward of 0.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import shlex
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from reroll import settings
from reroll.envs.base import EnvError
from reroll.envs.parsing import code_block
from reroll.envs.task_folder import TerminalTask, load_suite, setup
from reroll.envs.terminal_gen import write_suite
from reroll.sandbox import (
    Limits,
    Sandbox,
    SandboxError,
    SessionsConfig,
    run_off_loop,
    shared_sessions,
)
from reroll.sandbox.shared import SharedSession

HELD_OUT_SEED = 1_000_000
"""Episodes with a seed at or above this are evaluations (`reroll eval --env` counts from 10^6,
a training run's evaluation from 10^9; training seeds count up from 0): they draw held-out
tasks."""
DEFAULT_SUITE = (64, 24, 0)
"""Train tasks, held-out tasks and seed of the generated suite `tasks: None` uses."""
STATE = ".reroll-state.tgz"
COMMAND = ".reroll-command.sh"
TESTS = ".reroll-tests"
ENVIRONMENT = ".reroll-environment"
MARK = "__REROLL_STATUS__"
REWARD = "__REROLL_REWARD__="


@functools.cache
def default_suite() -> str:
    """The default suite, written once per process to a temporary folder."""
    root = Path(tempfile.mkdtemp(prefix="reroll-terminal-suite-"))
    write_suite(root, *DEFAULT_SUITE)
    return str(root)


def _files(prefix: str, files: dict[str, bytes]) -> dict[str, bytes]:
    return {f"{prefix}/{name}": data for name, data in files.items()}


def _memory(task: TerminalTask) -> int:
    return max(task.config.environment.memory_mb or 512, 64) << 20


def verify_script(task: TerminalTask) -> str:
    """Shell run in the working directory after the agent: the tests (copied in as TESTS), then
    the reward printed last: the number test.sh wrote to $REWARD_FILE (Harbor's
    /logs/verifier/reward.txt), else 1 for exit 0 and 0 otherwise."""
    exports = "".join(f"export {k}={v!r}\n" for k, v in task.config.verifier.env.items())
    return (f"{exports}export TESTS_DIR=\"$PWD/{TESTS}\" REWARD_FILE=/tmp/reward.txt\n"
            f"bash {TESTS}/test.sh >/dev/null 2>&1; status=$?\n"
            f"if [ -s /tmp/reward.txt ]; then echo \"{REWARD}$(head -c 32 /tmp/reward.txt)\"; "
            f"else [ $status -eq 0 ] && echo {REWARD}1 || echo {REWARD}0; fi\n")


def setup_script(task: TerminalTask) -> str:
    """The set-up with its environment/ files at $ENVIRONMENT_DIR (removed afterwards)."""
    return (f"export ENVIRONMENT_DIR=\"$PWD/{ENVIRONMENT}\"\n( {task.setup or ':'}\n)\n"
            f"status=$?\nrm -rf {ENVIRONMENT}\nexit $status\n")


def parse_reward(stdout: str) -> float:
    """The verifier's reward from `verify_script`'s output; 0 when it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(REWARD):
            try:
                return min(max(float(line.removeprefix(REWARD)), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 0.0


async def check(task: TerminalTask, sandbox: Sandbox) -> str | None:
    """Why the task is unsound, or None: its set-up must succeed, its tests must fail right
    after the set-up and pass after its solution."""
    if "solve.sh" not in task.solution:
        return f"{task.name}: no solution/solve.sh to check it with"
    limits = Limits(wall_time_s=task.config.verifier.timeout_sec + task.config.agent.timeout_sec,
                    cpu_time_s=task.config.verifier.timeout_sec + task.config.agent.timeout_sec,
                    memory_bytes=_memory(task))
    files = _files(TESTS, task.tests) | _files(ENVIRONMENT, task.environment) \
        | _files(".reroll-solution", task.solution)
    for solved in (False, True):
        script = f"set -e\n( {setup_script(task)}\n) >/dev/null\n"
        if solved:
            script += "( bash .reroll-solution/solve.sh\n) >/dev/null\n"
        script += "set +e\nrm -rf .reroll-solution\n" + verify_script(task)
        result = await sandbox.run(argv=["bash", "-c", script], files=files, limits=limits)
        reward = parse_reward(result.stdout)
        if solved and reward < 1.0:
            return f"{task.name}: the solution does not pass its tests ({result.stderr[-300:]!r})"
        if not solved and reward > 0.0:
            return f"{task.name}: the tests pass before anything is done"
    return None


class TerminalTasksEnv:
    """Task folders as an environment: the task's set-up runs in a sandbox, the agent sends one
    shell command per turn (its output and exit code come back), and `submit` (or the last turn)
    runs the task's tests: the reward is theirs.

    Training episodes draw train/ tasks (or the folder's), evaluations (seeds >= 10^6) heldout/.

    Args:
        tasks: a suite (train/, heldout/), a split or one task folder; None: the default suite.
        max_turns: commands per episode, `submit` included; the last runs the tests too.
        max_output_chars: a command's output is cut to this many characters.
        command_timeout_s: one command's time limit (the task's agent timeout_sec: all of them).
        sandbox: the Sandbox to run in (default: a new one with the default backend).
        sessions: None: one-shot sandboxes; `{mode: local}` or `{mode: remote, url: ...}`: one
            session an episode (docs/terminal-tasks.md).

    With `sessions`, an episode runs in one sandbox session (`SessionsConfig`), where cwd and
    variables persist between commands; one-shot sandboxes carry only the directory.
    """

    def __init__(self, tasks: str | None = None, max_turns: int = 6,
                 max_output_chars: int = 400, command_timeout_s: float = 10.0,
                 sandbox: Sandbox | None = None,
                 sessions: dict[str, Any] | SessionsConfig | None = None):
        root = Path(tasks if tasks is not None else default_suite())
        train, held = root / "train", root / "heldout"
        self.train = load_suite(train if train.is_dir() else root)
        self.held_out = load_suite(held) if held.is_dir() else self.train
        self.max_turns, self.max_output_chars = max_turns, max_output_chars
        self.command_timeout_s = command_timeout_s
        self.sandbox = sandbox
        self.sessions = sessions_config(sessions)
        # the episode's session, in a box the finalizer holds (not self): an env dropped
        # mid-episode (a length limit, an abort) closes its session when collected
        self._box: list[SharedSession | None] = [None]
        weakref.finalize(self, _close_soon, self._box)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return asyncio.run(self.areset(seed))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return asyncio.run(self.astep(action))

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = seed or 0
        pool = self.held_out if seed >= HELD_OUT_SEED else self.train
        await self.begin(pool[seed % len(pool)])
        return (f"Task: {self.task.instruction.strip()}\nYou are in the task's working "
                "directory. Reply with one shell command per turn; reply `submit` when done."), \
            {"task": self.task.name, "category": self.task.config.metadata.category}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        command = (code_block(action) or action).strip()
        if command != "submit":
            output, status = await self.shell(command)
            if self.turn < self.max_turns:
                return f"{output}[exit {status}]", 0.0, False, False, {"success": False}
        reward = await self.verify()
        await self.close_session()
        return ("Tests passed." if reward >= 1.0 else "Tests failed."), reward, True, False, \
            {"success": reward >= 1.0}

    async def begin(self, task: TerminalTask) -> None:
        """Start `task`: a fresh working directory with its set-up run (an agent harness that
        is not this env's turn loop drives it with `shell` and `verify`)."""
        await self.close_session()
        self.task = task
        self.turn, self.state, self.spent_s, self.solved = 0, b"", 0.0, False
        if self.sessions is not None:
            status = await self._session_setup()
        else:
            _, status = await self._run(setup_script(task),
                                        task.config.environment.build_timeout_sec,
                                        _files(ENVIRONMENT, task.environment))
        if status != 0:  # the task's own set-up: an infrastructure failure, not the policy's
            raise RuntimeError(f"task {task.name}: its set-up failed (exit {status})")

    async def shell(self, command: str) -> tuple[str, int]:
        """One command in the working directory (see `_run`), within `command_timeout_s` and
        what is left of the task's agent time: its output (cut) and exit status."""
        left = self.task.config.agent.timeout_sec - self.spent_s
        timeout = max(min(self.command_timeout_s, left), 1)
        return await (self._session_run(command, timeout) if self.sessions is not None
                      else self._run(command, timeout))

    async def verify(self) -> float:
        """The task's tests on the working directory as it is now: their reward."""
        return await (self._session_verify() if self.sessions is not None else self._verify())

    def expert_action(self) -> str:
        if self.solved or "solve.sh" not in self.task.solution:
            return "submit"
        self.solved = True
        return self.task.solution["solve.sh"].decode().strip()

    def _restore(self) -> tuple[str, dict[str, bytes]]:
        if not self.state:
            return "", {}
        return f"tar -xzf {STATE} && rm -f {STATE}\n", {STATE: self.state}

    async def _run(self, command: str, timeout_s: float,
                   extra: dict[str, bytes] | None = None) -> tuple[str, int]:
        """`command` in the working directory: its output (cut) and exit status. The directory's
        new state is kept for the next command; a command past `timeout_s` is killed, and the
        directory as it left it is kept."""
        self.sandbox = self.sandbox or Sandbox()
        restore, files = self._restore()
        # The command runs from a file of its own, so that its syntax errors are its own exit
        # status, not the end of this script (and of the working directory) too.
        script = (f"{restore}mv {COMMAND} /tmp/command.sh\n"
                  f"timeout -k 1 {timeout_s:.1f} bash /tmp/command.sh 2>&1 | head -c "
                  f"{self.max_output_chars}\n"
                  f"status=${{PIPESTATUS[0]}}\necho; echo {MARK}$status\n"
                  "tar -czf /tmp/s.tgz . && base64 -w0 /tmp/s.tgz\n")
        # the sandbox's own limits sit above the command's `timeout`
        limits = Limits(wall_time_s=timeout_s + 10, cpu_time_s=timeout_s + 10,
                        memory_bytes=_memory(self.task), output_bytes=8 << 20)
        files = files | (extra or {}) | {COMMAND: command}
        result = await run_off_loop(self.sandbox, argv=["bash", "-c", script], files=files,
                                    limits=limits)
        self.spent_s += result.wall_s
        output, found, tail = result.stdout.rpartition(MARK)
        if not found:
            raise RuntimeError(f"task {self.task.name}: the sandbox lost the working directory "
                               f"({result.limit or result.exit_code}: {result.stderr[-200:]!r})")
        status, _, archive = tail.partition("\n")
        self.state = base64.b64decode(archive.strip()) if archive.strip() else self.state
        return output.rstrip("\n") + ("\n" if output.strip() else ""), int(status.strip() or 1)

    async def _verify(self) -> float:
        restore, files = self._restore()
        timeout = self.task.config.verifier.timeout_sec
        result = await run_off_loop(
            self.sandbox, argv=["bash", "-c", restore + verify_script(self.task)],
            files=files | _files(TESTS, self.task.tests),
            limits=Limits(wall_time_s=timeout, cpu_time_s=timeout, memory_bytes=_memory(self.task)))
        return parse_reward(result.stdout)

    # -- in a sandbox session (`sessions`) ------------------------------------------------------

    def _lost(self, exc: BaseException) -> EnvError:
        session = self._box[0]
        self._box[0] = None
        if session is not None:
            session.close_soon()
        where = f" {session.id}" if session is not None else ""
        return EnvError(f"terminal task {self.task.name}: its sandbox session{where} was lost "
                        f"({type(exc).__name__}: {exc})")

    def _session(self) -> SharedSession:
        if self._box[0] is None:
            raise EnvError(f"terminal task {self.task.name}: no session (reset first)")
        return self._box[0]

    async def _session_setup(self) -> int:
        spec = self.task.session_spec(self.sessions.session)
        try:
            self._box[0] = await shared_sessions(self.sessions).create(spec)
            result = await setup(self._box[0], self.task)
        except _LOST as exc:
            raise self._lost(exc) from exc
        return 0 if result is None else result.exit_code

    async def _session_run(self, command: str, timeout_s: float) -> tuple[str, int]:
        """`command` in the session's shell (its cwd and variables), stderr into stdout: its
        output (cut) and exit status (124 past `timeout_s`, as `timeout` says)."""
        session = self._session()
        try:
            result = await session.exec("exec 2>&1\n" + command, wall_time_s=timeout_s,
                                        cpu_time_s=timeout_s)
        except _LOST as exc:
            raise self._lost(exc) from exc
        self.spent_s += result.wall_s
        output = (result.stdout + result.stderr)[: self.max_output_chars]
        status = 124 if result.timed_out else result.exit_code
        return output.rstrip("\n") + ("\n" if output.strip() else ""), status

    async def _session_verify(self) -> float:
        """The tests, copied in after the agent. Whatever the agent left behind cannot touch
        them: its processes are ended first (the session is stopped; files stay) and the tests
        run in a clean environment (no function, PATH or BASH_ENV of the agent's shell)."""
        session = self._session()
        stage = f".reroll-tests-{uuid.uuid4().hex}"
        try:
            await session.stop()
            for name, data in self.task.tests.items():
                await session.write(f"{stage}/{name}", data, 0o755 if name.endswith(".sh")
                                    else 0o644)
            timeout = self.task.config.verifier.timeout_sec
            result = await session.exec(
                _CLEAN, stdin=session_verify_script(self.task, stage), wall_time_s=timeout,
                cpu_time_s=timeout, env={"POSIXLY_CORRECT": "1", "BASH_ENV": ""})
        except _LOST as exc:
            raise self._lost(exc) from exc
        return parse_reward(result.stdout)

    async def close_session(self) -> None:
        """End the episode's session (its files and processes), if it has one."""
        session, self._box[0] = self._box[0], None
        if session is not None:
            with contextlib.suppress(*_LOST):  # gone already: nothing left to close
                await session.close()

    def close(self) -> None:
        """End the episode's session without waiting (an env host drops the env)."""
        _close_soon(self._box)


_LOST = (SandboxError, KeyError, PermissionError, OSError)
"""What a lost session raises: the sandbox or the service failed (`SandboxError`: unreachable,
the session gone with its reason), the service forgot it (`SessionNotFound`, a KeyError, after a
restart), the key was refused."""
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CLEAN = f"exec /usr/bin/env -i PATH={_PATH} HOME=/work /bin/bash --noprofile --norc -s"
"""The verifier's shell: the agent's exported functions, PATH and BASH_ENV do not reach it
(POSIXLY_CORRECT, set for this command, keeps a function named `exec` from standing in)."""


def session_verify_script(task: TerminalTask, stage: str) -> str:
    """The tests (uploaded to /work/``stage``) at /tmp/tests, run from /work, and the reward
    printed last, as `verify_script` does."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n"
                      for k, v in task.config.verifier.env.items())
    return (f"cd /work || exit 1\nrm -rf /tmp/tests /tmp/.reroll-reward\n"
            f"mkdir -p /tmp/tests && cp -a {stage}/. /tmp/tests/ && rm -rf {stage} || exit 1\n"
            f"{exports}export TESTS_DIR=/tmp/tests REWARD_FILE=/tmp/.reroll-reward\n"
            f"bash /tmp/tests/test.sh </dev/null >/dev/null 2>&1; status=$?\n"
            f"if [ -s $REWARD_FILE ]; then echo \"{REWARD}$(head -c 32 $REWARD_FILE)\"; "
            f"else [ $status -eq 0 ] && echo {REWARD}1 || echo {REWARD}0; fi\n")


def sessions_config(value: dict[str, Any] | SessionsConfig | None) -> SessionsConfig | None:
    """``env.kwargs.sessions`` checked; a ValueError names the key."""
    if value is None:
        return None
    try:
        config = SessionsConfig.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in ('sessions', *e['loc']))}: "
                             f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise ValueError(f"terminal_tasks: {problems}") from None
    if config.mode == "remote" and config.api_key_env and not settings.read(config.api_key_env):
        raise ValueError(f"terminal_tasks: sessions.api_key_env names {config.api_key_env}, "
                         "which is not set (export the sandbox service's key there)")
    return config


def _close_soon(box: list[SharedSession | None]) -> None:
    session, box[0] = box[0], None
    if session is not None:
        session.close_soon()
