"""`Sandbox`: run one untrusted program in a fresh, single-use sandbox.

    sandbox = Sandbox()                                  # bubblewrap; refuses if it is missing
    result = await sandbox.run("print(input()[::-1])", stdin="abc")
    result.stdout == "cba\\n"

Each call starts its own sandbox (about 15 ms of bubblewrap + interpreter start-up here) and
throws it away afterwards. `SandboxPool` runs the same thing with sandboxes started ahead of time,
a concurrency limit and metrics.
"""

from __future__ import annotations

import marshal
import math
import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from reroll.sandbox.backends import make_backend
from reroll.sandbox.limits import Limits, SandboxConfig, check_env
from reroll.sandbox.process import Outcome, SandboxProcess
from reroll.sandbox.result import ExecResult, classify_limit

MAIN_FILE = "main.py"
_STDERR_TAIL = 4096


@dataclass
class Job:
    """A validated execution request, ready to be handed to any sandbox."""

    code: str | None
    argv: list[str] | None
    files: dict[str, bytes]
    stdin: bytes | None
    limits: Limits
    env: dict[str, str] = field(default_factory=dict)

    def payload(self, workdir: str, base_env: Mapping[str, str]) -> bytes:
        """The bytes the in-sandbox launcher reads (a ``marshal``-ed dict of plain types)."""
        env = {**base_env, **self.env}
        return marshal.dumps(
            {
                "code": self.code,
                "argv": self.argv,
                "files": self.files,
                "workdir": workdir,
                "env": env,
                "rlimits": self.limits.rlimits(),
            }
        )


def _as_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _check_path(name: str) -> str:
    if not isinstance(name, str) or "\0" in name:
        raise ValueError(f"file name {name!r} must be a string without NUL bytes")
    norm = posixpath.normpath(name)
    if not name or name.startswith("/") or norm == "." or norm.split("/")[0] == "..":
        raise ValueError(f"file name {name!r} must be a relative path inside the workdir")
    return norm


def make_job(
    code: str | None,
    argv: Sequence[str] | None,
    files: Mapping[str, str | bytes] | None,
    stdin: str | bytes | None,
    limits: Limits,
    env: Mapping[str, str] | None,
) -> Job:
    """Validate a request: exactly one of ``code`` (Python source, run as ``main.py``) and ``argv``
    (a command, looked up on the sandbox's PATH, run in the workdir)."""
    if (code is None) == (argv is None):
        raise ValueError("give exactly one of `code` (Python source) or `argv` (a command)")
    if argv is not None and (isinstance(argv, str) or not argv):
        raise ValueError("`argv` must be a non-empty list of strings")
    if argv is not None and any("\0" in str(arg) for arg in argv):
        raise ValueError("`argv` arguments may not contain NUL bytes")
    checked = {_check_path(name): _as_bytes(data) for name, data in (files or {}).items()}
    if code is not None:
        if MAIN_FILE in checked:
            raise ValueError(f"`files` may not contain {MAIN_FILE!r} when `code` is given")
        checked[MAIN_FILE] = code.encode()
    env = dict(env or {})
    check_env(env)
    return Job(
        code=code,
        argv=[str(arg) for arg in argv] if argv is not None else None,
        files=checked,
        stdin=_as_bytes(stdin) if stdin is not None else None,
        limits=limits,
        env=env,
    )


def to_result(
    outcome: Outcome, job: Job, proc: SandboxProcess, **timings: float | bool
) -> ExecResult:
    stderr = outcome.stderr.decode("utf-8", "replace")
    if outcome.timed_out:
        limit = "wall_time"
    elif outcome.output_exceeded:
        limit = "output"
    else:
        cpu_limit = float(math.ceil(job.limits.cpu_time_s))  # RLIMIT_CPU is in whole seconds
        limit = classify_limit(outcome.exit_code, stderr[-_STDERR_TAIL:], outcome.cpu_s, cpu_limit)
    code = outcome.exit_code
    return ExecResult(
        stdout=outcome.stdout.decode("utf-8", "replace"),
        stderr=stderr,
        exit_code=code,
        timed_out=outcome.timed_out,
        limit=limit,
        signal=code - 128 if code > 128 else None,
        output_truncated=outcome.output_exceeded,
        wall_s=outcome.wall_s,
        cpu_s=outcome.cpu_s,
        max_rss_bytes=outcome.max_rss_bytes,
        spawn_s=proc.spawn_s,
        **timings,
    )


class Sandbox:
    """Runs untrusted programs, each in a fresh single-use sandbox (see the module docstring).

    Safe to share between asyncio tasks: it holds no per-run state."""

    def __init__(self, config: SandboxConfig | None = None, limits: Limits | None = None) -> None:
        self.config = config or SandboxConfig()
        self.limits = limits or Limits()
        """Limits of a call that passes none."""
        self.backend = make_backend(self.config)

    @property
    def python(self) -> str:
        """The interpreter's path inside the sandbox, for ``argv`` programs."""
        return self.backend.python

    def job(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Job:
        return make_job(code, argv, files, stdin, limits or self.limits, env)

    async def start(self, tmpfs_bytes: int | None = None) -> SandboxProcess:
        """Start one sandbox, ready for one job."""
        size = tmpfs_bytes if tmpfs_bytes is not None else self.limits.tmpfs_bytes
        spec = self.backend.launch_spec(size)
        return await SandboxProcess.start(spec, size, self.config.spawn_timeout_s)

    async def execute(
        self,
        proc: SandboxProcess,
        job: Job,
        called_at: float,
        queue_s: float = 0.0,
        warm: bool = False,
    ) -> ExecResult:
        """Run ``job`` in the started sandbox ``proc`` (which is used up). ``called_at`` is the
        ``time.perf_counter()`` of the request, ``warm`` whether ``proc`` was started before it."""
        payload = job.payload(proc.spec.workdir, proc.spec.sandbox_env)
        outcome = await proc.execute(
            payload, job.stdin, job.limits.wall_time_s, job.limits.output_bytes
        )
        total = time.perf_counter() - called_at
        return to_result(outcome, job, proc, queue_s=queue_s, total_s=total, warm=warm)

    async def run(
        self,
        code: str | None = None,
        *,
        argv: Sequence[str] | None = None,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run Python ``code`` (as ``main.py`` in the workdir) or the command ``argv``.

        ``files`` are written into the private workdir first (relative names), ``stdin`` is fed
        to the program, ``env`` adds to its otherwise empty environment. Raises `SandboxError`
        only when the sandbox itself fails; everything the program does is in the result."""
        called_at = time.perf_counter()
        job = self.job(code, argv=argv, files=files, stdin=stdin, limits=limits, env=env)
        proc = await self.start(job.limits.tmpfs_bytes)
        return await self.execute(proc, job, called_at)
