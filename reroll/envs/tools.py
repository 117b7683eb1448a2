"""Tool-use environments: math with a Python tool, and terminal tasks, both run in the Sandbox."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import tarfile
from typing import Any

from reroll.envs.parsing import boxed, code_block, integer
from reroll.sandbox import Limits, Sandbox, run_off_loop

TOOL_LIMITS = Limits(wall_time_s=5.0, cpu_time_s=5.0, output_bytes=64 << 10)


def _run_sync(coro):
    """Run a coroutine from synchronous code (the plain `reset`/`step` of the Env protocol)."""
    return asyncio.run(coro)


class PythonTool:
    """Wrapper: an action holding a ```python block runs it in the Sandbox, and its output comes
    back as the observation (a tool turn, reward 0); any other action goes to the wrapped env."""

    def __init__(self, env: Any, sandbox: Sandbox | None = None, limits: Limits = TOOL_LIMITS,
                 max_output_chars: int = 400):
        self.env, self.limits, self.max_output_chars = env, limits, max_output_chars
        self.sandbox = sandbox
        self.tool_calls = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.tool_calls = 0
        return self.env.reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return _run_sync(self.astep(action))

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        code = code_block(action)
        if code is None:
            return self.env.step(action)
        self.tool_calls += 1
        self.sandbox = self.sandbox or Sandbox()
        result = await run_off_loop(self.sandbox, code, limits=self.limits)
        output = (result.stdout + result.stderr[-200:])[: self.max_output_chars].strip()
        if result.timed_out:
            output += " (timed out)"
        return f"Output: {output}", 0.0, False, False, {"tool_calls": self.tool_calls}

    def expert_action(self) -> str:
        return self.env.expert_action()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


class MathEnv:
    """An arithmetic question; the answer goes in \\boxed{}. With `PythonTool` around it the model
    may compute first (the registry adds `MaxTurns` to bound tool turns). The expert computes
    with the tool, then answers."""

    def __init__(self, max_turns: int = 3, max_operand: int = 99):
        self.max_turns, self.max_operand = max_turns, max_operand

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        a, b, c = (rng.randint(2, self.max_operand) for _ in range(3))
        self.expression = f"{a} * {b} + {c}"
        self.answer, self.turn, self.expert_turn = a * b + c, 0, 0
        return (f"What is {self.expression}? You may run Python in a ```python block. "
                f"Put the final answer in \\boxed{{}}."), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if boxed(action) is None:
            return "Put the final answer in \\boxed{}.", 0.0, False, self.turn >= self.max_turns, \
                {"success": False}
        correct = integer(action) == self.answer
        return ("Correct!" if correct else "Wrong."), float(correct), True, False, \
            {"success": correct}

    def expert_action(self) -> str:
        self.expert_turn += 1
        if self.expert_turn == 1:
            return f"```python\nprint({self.expression})\n```"
        return f"The answer is \\boxed{{{self.answer}}}."


# -- terminal tasks ----------------------------------------------------------------------------

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "orbit", "delta"]


def _task(rng: random.Random) -> dict[str, Any]:
    """A small Terminal-Bench-style task: instruction, starting files, a test script, and the
    command an expert would run."""
    kind = rng.randrange(3)
    if kind == 0:
        name = rng.choice(WORDS)
        return {"instruction": f"Create a file {name}.txt containing the line: hello {name}",
                "files": {}, "test": f"grep -qx 'hello {name}' {name}.txt",
                "solution": f"echo 'hello {name}' > {name}.txt"}
    lines = rng.sample(WORDS, rng.randint(3, 8))
    data = "".join(f"{w}\n" for w in lines)
    if kind == 1:
        return {"instruction": "Write the number of lines of data.txt to count.txt",
                "files": {"data.txt": data},
                "test": f"[ \"$(tr -d ' \\n' < count.txt)\" = \"{len(lines)}\" ]",
                "solution": "wc -l < data.txt > count.txt"}
    return {"instruction": "Write the lines of data.txt, sorted alphabetically, to sorted.txt",
            "files": {"data.txt": data}, "test": "sort data.txt | cmp -s - sorted.txt",
            "solution": "sort data.txt > sorted.txt"}


MARK = "__REROLL_STATE__"


class TerminalEnv:
    """Shell commands in a Sandbox; the workspace persists between steps (its files are carried
    from one single-use sandbox to the next). `submit` runs the task's test script: reward 1 if it
    passes. Observations are the command's output and exit code.

    Args:
        max_turns: shell commands per episode (`submit` included).
        sandbox: the Sandbox to run in (default: a new one with the default backend).
        limits: CPU, memory, wall-clock and output limits of each command.
        max_output_chars: a command's output is cut to this many characters.
    """

    def __init__(self, max_turns: int = 4, sandbox: Sandbox | None = None,
                 limits: Limits = TOOL_LIMITS, max_output_chars: int = 400):
        self.max_turns, self.limits, self.max_output_chars = max_turns, limits, max_output_chars
        self.sandbox = sandbox

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.task = _task(random.Random(seed))
        self.files: dict[str, bytes] = {k: v.encode() for k, v in self.task["files"].items()}
        self.turn, self.ran_solution = 0, False
        listing = " ".join(sorted(self.files)) or "(empty)"
        return (f"Task: {self.task['instruction']}\nFiles: {listing}\nReply with one shell "
                f"command per turn; reply `submit` when done."), {"test": self.task["test"]}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return _run_sync(self.astep(action))

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        command = (code_block(action) or action).strip()
        if command == "submit":
            result = await self._shell(self.task["test"], keep_state=False)
            passed = result[1] == 0
            return ("Tests passed." if passed else "Tests failed."), float(passed), True, False, \
                {"success": passed}
        output, status = await self._shell(command, keep_state=True)
        return f"{output}[exit {status}]", 0.0, False, self.turn >= self.max_turns, \
            {"success": False}

    async def _shell(self, command: str, keep_state: bool) -> tuple[str, int]:
        self.sandbox = self.sandbox or Sandbox()
        script = f"{command}\necho {MARK}$?\n" + ("tar -czf - . | base64 -w0\n" if keep_state else "")
        result = await run_off_loop(self.sandbox, argv=["bash", "-c", script], files=self.files,
                                    limits=self.limits)
        output, _, tail = result.stdout.rpartition(MARK)
        if not _:
            return (result.stdout + result.stderr)[: self.max_output_chars], result.exit_code or 1
        status_text, _, archive = tail.partition("\n")
        if keep_state and archive.strip():
            self.files = _untar(base64.b64decode(archive.strip()))
        output = (output + result.stderr)[: self.max_output_chars]
        return output, int(status_text.strip() or 1)

    def expert_action(self) -> str:
        if self.ran_solution:
            return "submit"
        self.ran_solution = True
        return self.task["solution"]


def _untar(data: bytes) -> dict[str, bytes]:
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive.getmembers():
            if member.isfile():
                name = member.name.removeprefix("./")
                files[name] = archive.extractfile(member).read()
    return files
