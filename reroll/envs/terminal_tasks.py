"""`env.id: terminal_tasks`: terminal tasks in the Harbor / Terminal-Bench layout as an
environment (`reroll.envs.task_folders` reads the folders, `reroll.envs.terminal_gen` generates
the suite)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

from reroll.envs.parsing import code_block
from reroll.envs.task_folders import (
    TESTS_DIR,
    limits_of,
    load_tasks,
    parse_reward,
    verify_script,
)
from reroll.envs.terminal_gen import suite
from reroll.sandbox import Limits, Sandbox

HELD_OUT_SEED = 1_000_000
"""Episodes with a seed at or above this are evaluations (`reroll eval --env` counts from 10^6,
a training run's evaluation from 10^9; training seeds count up from 0): they draw held-out
tasks."""
DEFAULT_SUITE = (64, 24, 0)
"""Train tasks, held-out tasks and seed of the generated suite `tasks: None` uses."""
STATE = ".reroll-state.tgz"
COMMAND = ".reroll-command.sh"
MARK = "__REROLL_STATUS__"


class TerminalTasksEnv:
    """Task folders (Harbor / Terminal-Bench layout) as an environment: the task's set-up runs in
    a sandbox, the agent sends one shell command per turn (its output and exit code come back),
    and `submit` (or the last turn) runs the task's tests: the reward is theirs.

    The working directory persists between commands (files, folders and their modes, carried
    from one single-use sandbox to the next as an archive); a command's shell state (`cd`,
    variables) does not: chain with `&&` inside one command.

    Args:
        tasks: a suite (`reroll make-terminal-tasks` writes one: train/ and heldout/), one split
            of it, or one task folder; None: the generated suite of `reroll
            make-terminal-tasks`' defaults (64 train and 24 held-out tasks, seed 0), in memory. Training episodes draw from train/ (or the folder itself),
            evaluation episodes (seeds >= 10^6) from heldout/ when the suite has it.
        max_turns: shell commands per episode, `submit` included; the last runs the tests too.
        max_output_chars: a command's output is cut to this many characters.
        command_timeout_s: wall-clock limit of one command (a task's own [agent] timeout_sec
            bounds the whole episode's commands together).
    """

    def __init__(self, tasks: str | None = None, max_turns: int = 6,
                 max_output_chars: int = 400, command_timeout_s: float = 10.0,
                 sandbox: Sandbox | None = None):
        if tasks is None:
            self.train, self.held_out = suite(*DEFAULT_SUITE)
        else:
            root = Path(tasks)
            split = root / "train"
            self.train = load_tasks(split if split.is_dir() else root)
            held = root / "heldout"
            self.held_out = load_tasks(held) if held.is_dir() else self.train
        self.max_turns, self.max_output_chars = max_turns, max_output_chars
        self.command_timeout_s = command_timeout_s
        self.sandbox = sandbox

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return asyncio.run(self.areset(seed))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return asyncio.run(self.astep(action))

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = seed or 0
        pool = self.held_out if seed >= HELD_OUT_SEED else self.train
        self.task = pool[seed % len(pool)]
        self.turn, self.state, self.spent_s, self.solved = 0, b"", 0.0, False
        if self.task.setup:
            _, status = await self._run(self.task.setup, self.task.verifier_timeout_s)
            if status != 0:  # the task's own set-up: an infrastructure failure, not the policy's
                raise RuntimeError(f"task {self.task.name}: its set-up failed (exit {status})")
        return (f"Task: {self.task.instruction}\nYou are in the task's working directory. Reply "
                "with one shell command per turn; reply `submit` when done."), \
            {"task": self.task.name, "family": self.task.metadata.get("family", "")}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        command = (code_block(action) or action).strip()
        if command != "submit":
            budget = min(self.command_timeout_s, max(self.task.agent_timeout_s - self.spent_s, 1))
            output, status = await self._run(command, budget)
            if self.turn < self.max_turns:
                return f"{output}[exit {status}]", 0.0, False, False, {"success": False}
        reward = await self._verify()
        return ("Tests passed." if reward >= 1.0 else "Tests failed."), reward, True, False, \
            {"success": reward >= 1.0}

    def expert_action(self) -> str:
        if self.solved or not self.task.solution:
            return "submit"
        self.solved = True
        return self.task.solution.strip()

    async def _run(self, command: str, timeout_s: float) -> tuple[str, int]:
        """`command` in the working directory; its output (cut) and exit status. The directory's
        new state is kept for the next command."""
        self.sandbox = self.sandbox or Sandbox()
        restore = f"tar -xzf {STATE} && rm -f {STATE}\n" if self.state else ""
        # The command runs from a file of its own, so that its syntax errors are its own exit
        # status, not the end of this script (and the working directory) too.
        script = (f"{restore}mv {COMMAND} /tmp/command.sh\n"
                  f"timeout -k 1 {timeout_s:.1f} bash /tmp/command.sh 2>&1 | head -c "
                  f"{self.max_output_chars}\n"
                  f"status=${{PIPESTATUS[0]}}\necho; echo {MARK}$status\n"
                  "tar -czf /tmp/s.tgz . && base64 -w0 /tmp/s.tgz\n")
        # the sandbox's limits sit above the command's own `timeout`: a command past its time
        # is killed and the directory as it left it is kept
        limits = Limits(wall_time_s=timeout_s + 10, cpu_time_s=timeout_s + 10,
                        memory_bytes=max(self.task.memory_mb, 64) << 20, output_bytes=8 << 20)
        files = {COMMAND: command} | ({STATE: self.state} if self.state else {})
        result = await self.sandbox.run(argv=["bash", "-c", script], files=files, limits=limits)
        self.spent_s += result.wall_s
        output, found, tail = result.stdout.rpartition(MARK)
        if not found:
            if result.timed_out or result.limit:
                return f"(the command hit the {result.limit or 'time'} limit)\n", 124
            raise RuntimeError(f"task {self.task.name}: the sandbox lost the working directory "
                               f"({result.stderr[-200:]!r})")
        status, _, archive = tail.partition("\n")
        self.state = base64.b64decode(archive.strip()) if archive.strip() else self.state
        return output.rstrip("\n") + ("\n" if output.strip() else ""), int(status.strip() or 1)

    async def _verify(self) -> float:
        restore = f"tar -xzf {STATE} && rm -f {STATE}\n" if self.state else ""
        files = {f"{TESTS_DIR}/test.sh": self.task.test} | ({STATE: self.state} if self.state else {})
        result = await self.sandbox.run(argv=["bash", "-c", restore + verify_script(self.task)],
                                        files=files,
                                        limits=limits_of(self.task, self.task.verifier_timeout_s))
        return parse_reward(result.stdout)
