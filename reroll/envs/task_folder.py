"""Terminal tasks as folders in the Harbor / Terminal-Bench layout, run in a sandbox session.

    my-task/
      instruction.md           what the agent is asked to do
      task.toml                time limits and resources ([agent], [verifier], [environment])
      environment/setup.sh     the set-up, in place of a Dockerfile (no Docker here); the
                               folder's other files are copied to /tmp/environment first
      tests/test.sh            decides success: exit 0 passes
      solution/solve.sh        a reference solution (optional)

`load_task(folder)` reads and checks one task (a problem names the file and what was wrong),
`load_suite(folder)` every task folder below one folder. On a session: `setup` runs the set-up
in /work, `solve` runs the reference solution, `verify` copies tests/ into /tmp/tests (the agent
never saw them) and runs test.sh with the verifier's time limit. Harbor scripts that use /tests
or /solution get ``TESTS_DIR`` and ``SOLUTION_DIR`` instead (the sandbox's root is read-only).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from reroll.sandbox import ExecResult, Limits, SessionSpec

_TESTS, _SOLUTION, _ENVIRONMENT = "/tmp/tests", "/tmp/solution", "/tmp/environment"
_MAX_FILE = 8 << 20


class TaskFormatError(ValueError):
    """A task folder that does not follow the layout; the message names the file."""


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    difficulty: str = "medium"
    category: str = ""
    tags: list[str] = Field(default_factory=list)


class _Verifier(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_sec: float = Field(120.0, gt=0, le=24 * 3600)
    """Wall clock of tests/test.sh."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables of the verifier's run."""


class _Agent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_sec: float = Field(300.0, gt=0, le=24 * 3600)
    """The agent's time budget for the task (and solve.sh's wall clock)."""


class _Environment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    build_timeout_sec: float = Field(600.0, gt=0, le=24 * 3600)
    """Wall clock of environment/setup.sh."""
    cpus: float | None = Field(None, gt=0)
    """Recorded, not enforced: a session has no CPU quota (its processes' CPU time is)."""
    memory_mb: int | None = Field(None, ge=32)
    """Address space of each process of the session (RLIMIT_AS)."""
    storage_mb: int | None = Field(None, ge=1)
    """The session's disk quota (/work, /tmp and /dev/shm)."""
    docker_image: str | None = None
    """Harbor's prebuilt image: ignored (there is no Docker; environment/setup.sh builds)."""
    gpus: int | None = Field(None, ge=0)
    """Ignored (sessions have no GPU)."""
    allow_internet: bool = False
    """Harbor's network switch: reroll's sandboxes have no network, so a task that needs it
    (true) is refused."""

    @field_validator("allow_internet")
    @classmethod
    def _offline(cls, value: bool) -> bool:
        if value:
            raise ValueError("the task needs the internet, and reroll's sandboxes have no "
                             "network")
        return value


class TaskToml(BaseModel):
    """The schema of task.toml (Harbor's keys; unknown ones outside [metadata] are errors)."""

    model_config = ConfigDict(extra="forbid")

    version: str = "1.0"
    metadata: _Metadata = Field(default_factory=_Metadata)
    verifier: _Verifier = Field(default_factory=_Verifier)
    agent: _Agent = Field(default_factory=_Agent)
    environment: _Environment = Field(default_factory=_Environment)


@dataclass(frozen=True)
class TerminalTask:
    name: str
    path: Path
    instruction: str
    config: TaskToml
    setup: str | None
    """environment/setup.sh, or None."""
    environment: dict[str, bytes] = field(default_factory=dict)
    """environment/'s other files (relative names)."""
    tests: dict[str, bytes] = field(default_factory=dict)
    """tests/ (test.sh included)."""
    solution: dict[str, bytes] = field(default_factory=dict)
    """solution/ (solve.sh included), empty without one."""

    def session_spec(self, base: SessionSpec | None = None) -> SessionSpec:
        """``base`` with this task's resources (memory, disk) and a time to live covering the
        set-up, the agent and the verifier."""
        base = base or SessionSpec()
        env = self.config.environment
        limits = base.limits.model_dump()
        if env.memory_mb is not None:
            limits["memory_bytes"] = env.memory_mb << 20
        ttl = (env.build_timeout_sec + self.config.agent.timeout_sec
               + self.config.verifier.timeout_sec + 60.0)
        return SessionSpec.model_validate({
            **base.model_dump(), "limits": Limits(**limits),
            "disk_bytes": (env.storage_mb << 20) if env.storage_mb else base.disk_bytes,
            "ttl_s": max(base.ttl_s, ttl)})


def _files(folder: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            raise TaskFormatError(f"{path}: symlinks are not allowed in a task folder")
        if path.is_file():
            if path.stat().st_size > _MAX_FILE:
                raise TaskFormatError(f"{path}: larger than {_MAX_FILE >> 20} MiB")
            out[path.relative_to(folder).as_posix()] = path.read_bytes()
    return out


def _read_toml(path: Path) -> TaskToml:
    if not path.is_file():
        return TaskToml()
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: not valid TOML: {exc}") from None
    try:
        return TaskToml.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise TaskFormatError(f"{path}: {problems}") from None


def load_task(folder: str | Path) -> TerminalTask:
    """One task folder, checked (see the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TaskFormatError(f"{folder}: not a task folder (no such directory)")
    instruction = folder / "instruction.md"
    if not instruction.is_file() or not instruction.read_text().strip():
        raise TaskFormatError(f"{instruction}: missing or empty (the agent's instruction)")
    tests = _files(folder / "tests") if (folder / "tests").is_dir() else {}
    if "test.sh" not in tests:
        raise TaskFormatError(f"{folder / 'tests' / 'test.sh'}: missing (it decides success)")
    environment = _files(folder / "environment") if (folder / "environment").is_dir() else {}
    setup = environment.pop("setup.sh", None)
    solution = _files(folder / "solution") if (folder / "solution").is_dir() else {}
    if solution and "solve.sh" not in solution:
        raise TaskFormatError(f"{folder / 'solution' / 'solve.sh'}: missing (solution/ exists)")
    return TerminalTask(
        name=folder.name, path=folder, instruction=instruction.read_text(),
        config=_read_toml(folder / "task.toml"),
        setup=setup.decode() if setup is not None else None,
        environment=environment, tests=tests, solution=solution)


def load_suite(folder: str | Path) -> list[TerminalTask]:
    """Every task folder (one holding instruction.md) below ``folder``, sorted by path; a
    folder that is itself a task gives that one task."""
    folder = Path(folder)
    if (folder / "instruction.md").is_file():
        return [load_task(folder)]
    found = sorted(p.parent for p in folder.rglob("instruction.md"))
    if not found:
        raise TaskFormatError(f"{folder}: no task folder (with an instruction.md) below it")
    return [load_task(p) for p in found]


async def _upload(session, target: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        await session.write(f"{target}/{rel}".removeprefix("/work/"), data, mode=0o755
                            if rel.endswith(".sh") else 0o644)


def _env(task: TerminalTask) -> dict[str, str]:
    return {"TESTS_DIR": _TESTS, "SOLUTION_DIR": _SOLUTION, "ENVIRONMENT_DIR": _ENVIRONMENT}


async def _copy_in(session, target: str, files: dict[str, bytes]) -> None:
    """Files into /tmp (outside the file API's /work): staged in /work, then moved."""
    if not files:
        return
    stage = f".reroll-stage-{target.rsplit('/', 1)[-1]}"
    await _upload(session, stage, files)
    result = await session.exec(f"rm -rf {target} && mkdir -p {target} && "
                                f"cp -a /work/{stage}/. {target}/ && rm -rf /work/{stage}",
                                wall_time_s=60)
    if not result.ok:
        raise RuntimeError(f"could not copy files to {target}: {result.stderr[-500:]}")


async def setup(session, task: TerminalTask) -> ExecResult | None:
    """Copy environment/ to /tmp/environment and run environment/setup.sh in /work."""
    await _copy_in(session, _ENVIRONMENT, task.environment)
    if task.setup is None:
        return None
    return await session.exec(task.setup, wall_time_s=task.config.environment.build_timeout_sec,
                              env=_env(task))


async def solve(session, task: TerminalTask) -> ExecResult:
    """Run the reference solution (solution/solve.sh) in /work."""
    if not task.solution:
        raise TaskFormatError(f"{task.path}: no solution/solve.sh")
    await _copy_in(session, _SOLUTION, task.solution)
    return await session.exec(f"cd /work && bash {_SOLUTION}/solve.sh",
                              wall_time_s=task.config.agent.timeout_sec, env=_env(task))


async def verify(session, task: TerminalTask) -> ExecResult:
    """Copy tests/ to /tmp/tests and run test.sh from /work; ``.ok`` is success."""
    await _copy_in(session, _TESTS, task.tests)
    return await session.exec(f"cd /work && bash {_TESTS}/test.sh",
                              wall_time_s=task.config.verifier.timeout_sec,
                              env={**_env(task), **task.config.verifier.env})
