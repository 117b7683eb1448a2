"""Terminal tasks as folders in the Harbor / Terminal-Bench layout, read and written here.

    my-task/
      instruction.md          what the agent is told
      task.toml               [metadata] family, difficulty, seed, split; [agent] and [verifier]
                              timeout_sec; [environment] cpus, memory_mb, storage_mb
      environment/setup.sh    prepares the working directory (reroll's stand-in for a Dockerfile:
                              there is no Docker here; it runs in the sandbox, in the directory
                              the agent then works in)
      tests/test.sh           decides success: exit 0 passes (or it writes a number in [0, 1] to
                              "$REWARD_FILE", Harbor's /logs/verifier/reward.txt); the agent
                              never sees it, it is copied in after the agent has finished
      solution/solve.sh       an expert's solution (SFT data, and the suite's own check)

A suite is a folder of task folders (nested one level: `train/`, `heldout/`). `check_task` runs a
task in the sandbox twice: set-up then tests must fail (the task is not solved from the start),
set-up, solution, then tests must pass.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError
from reroll.sandbox import Limits, Sandbox

FILES = ("instruction.md", "task.toml", "environment/setup.sh", "tests/test.sh",
         "solution/solve.sh")
REQUIRED = ("instruction.md", "task.toml", "tests/test.sh")
TESTS_DIR = ".reroll-tests"
"""Where the tests are copied for the verifier, inside the working directory, after the agent."""
REWARD_FILE = f"{TESTS_DIR}/reward.txt"


@dataclass(frozen=True)
class TerminalTask:
    """One task folder's contents."""

    name: str
    instruction: str
    test: str
    setup: str = ""
    solution: str | None = None
    agent_timeout_s: float = 120.0
    verifier_timeout_s: float = 60.0
    memory_mb: int = 512
    metadata: dict[str, Any] = field(default_factory=dict)

    def toml(self) -> str:
        meta = "".join(f"{k} = {_toml_value(v)}\n" for k, v in self.metadata.items())
        return (f'version = "1.0"\n\n[metadata]\n{meta}\n[agent]\ntimeout_sec = '
                f"{self.agent_timeout_s}\n\n[verifier]\ntimeout_sec = {self.verifier_timeout_s}"
                f"\n\n[environment]\ncpus = 1\nmemory_mb = {self.memory_mb}\nstorage_mb = 64\n"
                "allow_internet = false\n")

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        contents = {"instruction.md": self.instruction.rstrip() + "\n", "task.toml": self.toml(),
                    "tests/test.sh": self.test, "environment/setup.sh": self.setup,
                    "solution/solve.sh": self.solution}
        for name, text in contents.items():
            if text is None:
                continue
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text if text.endswith("\n") or not text else text + "\n")
            if name.endswith(".sh"):
                path.chmod(0o755)
        return folder


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_task(folder: str | Path) -> TerminalTask:
    """A task folder; a missing required file or a malformed task.toml is a ConfigError naming
    the file."""
    root = Path(folder)
    missing = [name for name in REQUIRED if not (root / name).is_file()]
    if missing:
        raise ConfigError(f"{root}: not a task folder, it lacks {', '.join(missing)} (a task "
                          f"folder holds {', '.join(FILES)}; docs/sandbox.md)")
    try:
        settings = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{root / 'task.toml'}: not valid TOML ({e})") from None

    def number(section: str, key: str, default: float) -> float:
        value = settings.get(section, {}).get(key, default)
        if not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{root / 'task.toml'}: [{section}] {key} must be a positive "
                              f"number, not {value!r}")
        return float(value)

    def text(name: str) -> str | None:
        path = root / name
        return path.read_text() if path.is_file() else None

    return TerminalTask(root.name, text("instruction.md").strip(), text("tests/test.sh"),
                        text("environment/setup.sh") or "", text("solution/solve.sh"),
                        number("agent", "timeout_sec", 120.0),
                        number("verifier", "timeout_sec", 60.0),
                        int(number("environment", "memory_mb", 512)),
                        dict(settings.get("metadata", {})))


def load_tasks(path: str | Path) -> list[TerminalTask]:
    """A task folder, or a suite: every task folder under `path` (one or two levels down), in
    name order. An empty or missing path is a ConfigError."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such task folder or suite (reroll make-terminal-tasks "
                          "writes one)")
    if (root / "task.toml").is_file():
        return [load_task(root)]
    folders = sorted({p.parent for p in root.glob("*/task.toml")}
                     | {p.parent for p in root.glob("*/*/task.toml")})
    if not folders:
        raise ConfigError(f"{root}: holds no task folder (a folder with task.toml)")
    return [load_task(folder) for folder in folders]


def limits_of(task: TerminalTask, wall_time_s: float) -> Limits:
    return Limits(wall_time_s=wall_time_s, cpu_time_s=wall_time_s,
                  memory_bytes=max(task.memory_mb, 64) << 20, output_bytes=64 << 10)


def verify_script(task: TerminalTask) -> str:
    """Shell run after the agent: the tests copied in, run, then the reward read (the reward
    file's number if test.sh wrote one, else 1 for exit 0, 0 otherwise), printed last."""
    return (f"export REWARD_FILE=\"$PWD/{REWARD_FILE}\"\n"
            f"bash {TESTS_DIR}/test.sh >/dev/null 2>&1; status=$?\n"
            f"if [ -s \"$REWARD_FILE\" ]; then echo \"REWARD=$(head -c 32 \"$REWARD_FILE\")\"; "
            "else [ $status -eq 0 ] && echo REWARD=1 || echo REWARD=0; fi\n")


def parse_reward(stdout: str) -> float:
    """The verifier's reward from `verify_script`'s output; 0 when it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("REWARD="):
            try:
                return min(max(float(line.removeprefix("REWARD=")), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 0.0


async def check_task(task: TerminalTask, sandbox: Sandbox) -> str | None:
    """Why the task is broken, or None: its set-up must succeed, its tests must fail right after
    the set-up and pass after the solution."""
    tests = {f"{TESTS_DIR}/test.sh": task.test}
    limits = limits_of(task, task.verifier_timeout_s)
    for with_solution in (False, True):
        steps = [task.setup, task.solution if with_solution else "", verify_script(task)]
        script = "set -e\n" + f"( {steps[0]}\n) >/dev/null\n" if task.setup else ""
        if with_solution:
            script += f"( {steps[1]}\n) >/dev/null\n"
        script += "set +e\n" + steps[2]
        result = await sandbox.run(argv=["bash", "-c", script], files=tests, limits=limits)
        reward = parse_reward(result.stdout)
        if with_solution and reward < 1.0:
            return f"{task.name}: the solution does not pass its tests ({result.stderr[-300:]!r})"
        if not with_solution and reward > 0.0:
            return f"{task.name}: the tests pass before anything is done"
    return None
