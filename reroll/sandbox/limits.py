"""Schemas of the sandbox: resource limits of one execution, the sandbox backend, the pool.

These are plain pydantic models (frozen, unknown keys are errors) so a config section can embed them.
Sizes accept an integer number of bytes or a string such as ``"512M"`` / ``"1G"`` / ``"64k"``.
"""

from __future__ import annotations

import math
import re
import resource
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """``"512M"`` -> 536870912; integers pass through. Units are binary (k = 1024)."""
    if isinstance(value, bool):
        raise ValueError("a size must be an integer number of bytes or a string like '512M'")
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if match is None:
        raise ValueError(f"cannot parse size {value!r}; use bytes or a string like '512M'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def check_env(env: dict[str, str]) -> None:
    """Environment names are non-empty and hold no ``=`` or NUL; values hold no NUL. Checked on
    the host so a bad name is the caller's clear error, not a crash of the in-sandbox launcher."""
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"env {name!r}: names and values must be strings")
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"env name {name!r} is not valid (it must be non-empty, without "
                             f"'=' or NUL)")
        if "\0" in value:
            raise ValueError(f"env {name!r}: the value contains a NUL byte")


class Limits(BaseModel):
    """Resource limits of one execution. Every limit is enforced by the kernel (rlimits set inside
    the sandbox before the program starts, a size-capped tmpfs) or by the host (wall clock, output)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_time_s: float = Field(10.0, gt=0, le=24 * 3600)
    """Wall-clock limit, from the moment the program is handed to the sandbox until it exits. When
    it passes, the whole process tree (the sandbox's pid namespace) is killed."""
    cpu_time_s: float = Field(10.0, gt=0, le=24 * 3600)
    """CPU time of each process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL
    one second later."""
    memory_bytes: int = Field(1 << 30, ge=32 << 20)
    """Address space of each process (RLIMIT_AS)."""
    processes: int = Field(32, ge=2, le=65536)
    """Tasks (processes and threads) the sandbox may hold at once, the sandbox's init included
    (RLIMIT_NPROC, counted per sandbox: each sandbox has its own user namespace)."""
    file_size_bytes: int = Field(16 << 20, ge=0)
    """Largest file a process may write (RLIMIT_FSIZE)."""
    open_files: int = Field(256, ge=16, le=1 << 20)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = Field(1 << 20, ge=1024)
    """stdout and stderr together; past it the sandbox is killed and the output truncated."""
    tmpfs_bytes: int = Field(64 << 20, ge=1 << 20)
    """Size of each private writable tmpfs (the workdir, /tmp and /dev/shm)."""

    @field_validator(
        "memory_bytes", "file_size_bytes", "output_bytes", "tmpfs_bytes", mode="before"
    )
    @classmethod
    def _sizes(cls, value: int | str) -> int:
        return parse_size(value)

    def rlimits(self) -> list[tuple[int, int, int]]:
        """``(resource, soft, hard)`` triples the launcher applies before the program starts."""
        cpu = max(1, math.ceil(self.cpu_time_s))
        return [
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_AS, self.memory_bytes, self.memory_bytes),
            (resource.RLIMIT_NPROC, self.processes, self.processes),
            (resource.RLIMIT_FSIZE, self.file_size_bytes, self.file_size_bytes),
            (resource.RLIMIT_NOFILE, self.open_files, self.open_files),
            (resource.RLIMIT_CORE, 0, 0),
        ]


class SandboxConfig(BaseModel):
    """How sandboxes are built. The defaults are the strong setting: bubblewrap, every namespace
    unshared, a system interpreter, and (when the host process is root) an unprivileged uid."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["bwrap", "rlimit"] = "bwrap"
    """``bwrap``: bubblewrap namespaces (no network, private filesystem and process tree).
    ``rlimit``: rlimits and a private temporary directory only — much weaker, never chosen
    implicitly, and it says so in the logs."""
    bwrap_path: str | None = None
    """The bubblewrap binary; ``None`` looks up ``bwrap`` on PATH."""
    python: str | None = None
    """Interpreter used inside the sandbox; ``None`` prefers ``/usr/bin/python3`` and falls back to
    this process's interpreter (then its install tree, and only that, is bound read-only)."""
    site_packages: bool = False
    """Let the sandboxed interpreter import its site-packages (drops ``-S``)."""
    run_as_uid: int = Field(65534, ge=1)
    """Host uid the sandbox runs as when the host process is root (root is exempt from
    RLIMIT_NPROC, so a fork bomb would not be contained). Ignored otherwise."""
    run_as_gid: int = Field(65534, ge=1)
    """Host gid that goes with ``run_as_uid``."""
    workdir: str = "/work"
    """Path of the private writable workdir inside the sandbox (the program's cwd)."""
    extra_ro_paths: tuple[str, ...] = ()
    """More host paths to expose read-only at the same place (a toolchain, a dataset)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of the sandboxed program (its environment starts empty)."""
    tmpfs_inodes: int = Field(16384, ge=64, le=1 << 24)
    """Files, directories and links each private tmpfs (workdir, /tmp, /dev/shm) may hold
    (tmpfs ``nr_inodes``): a tmpfs's size does not bound how many empty files it holds. bwrap
    backend, host process root only (the host remounts the sandbox's tmpfs before the job)."""
    spawn_timeout_s: float = Field(20.0, gt=0)
    """How long a new sandbox may take to become ready before it counts as failed."""

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        check_env(value)
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") in ("", "/usr", "/proc", "/dev", "/tmp"):
            raise ValueError("workdir must be an absolute path outside /usr, /proc, /dev and /tmp")
        return value.rstrip("/")


class PoolConfig(BaseModel):
    """The sandbox manager: how many executions run at once and how many sandboxes wait warm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int = Field(4, ge=1, le=1024)
    """Executions running at the same time; callers beyond it wait in a queue."""
    warm: int | None = Field(None, ge=0, le=1024)
    """Sandboxes started ahead of time, each used for exactly one execution; ``None`` means
    ``concurrency + 1`` (one spare, so back-to-back calls find a warm one while the replacement of
    the previous one is still starting). 0 starts every sandbox on demand."""
    latency_window: int = Field(10000, ge=10)
    """How many recent executions the latency percentiles are computed over."""
