"""What one execution returns, and how a limit hit is recognised."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

LimitKind = Literal[
    "wall_time", "cpu_time", "memory", "processes", "file_size", "open_files", "output"
]
"""Which limit stopped a program. ``wall_time``, ``cpu_time`` and ``output`` are observed by the
host; the others are read from the exit signal and the end of stderr (best effort: a program
that prints "MemoryError" on its own is reported as having hit the memory limit)."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, broken set-up) — not the program."""


class SandboxLost(SandboxError):
    """The sandbox died before it received its job (nothing of the program ran)."""


class SandboxUnavailable(SandboxError):
    """The configured backend cannot run on this machine (e.g. bubblewrap is not installed)."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one sandboxed execution.

    Times are seconds. ``wall_s`` runs from the hand-over of the program to its exit; ``total_s``
    from the call to ``run`` to its return (queue wait and sandbox start-up included).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status as a shell reports it: the program's code, or 128 + N when killed by signal N."""
    timed_out: bool = False
    limit: LimitKind | None = None
    signal: int | None = None
    output_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_bytes: int = 0
    """Peak resident memory of the sandbox's process tree, as Linux reports it for the host's
    child: an upper bound, since it also counts the memory image of the host process at the
    moment it forked (a host with torch loaded makes this several hundred MB)."""
    spawn_s: float = 0.0
    """Start-up of the sandbox this execution used (done ahead of time for a warm sandbox)."""
    queue_s: float = 0.0
    total_s: float = 0.0
    warm: bool = False
    """Whether the sandbox was started before this execution asked for it."""

    @property
    def ok(self) -> bool:
        """Exited 0 within every limit."""
        return self.exit_code == 0 and not self.timed_out and self.limit is None

    @property
    def failure(self) -> str | None:
        """``None`` on success, else the cause: a limit name, or ``"exit_code"`` for a crash."""
        if self.limit is not None:
            return self.limit
        if self.exit_code != 0:
            return "exit_code"
        return None


_STDERR_MARKERS: tuple[tuple[str, LimitKind], ...] = (
    ("MemoryError", "memory"),
    ("Cannot allocate memory", "memory"),
    ("std::bad_alloc", "memory"),
    ("out of memory", "memory"),
    ("File too large", "file_size"),
    ("Too many open files", "open_files"),
    ("can't start new thread", "processes"),
    ("Resource temporarily unavailable", "processes"),
    ("fork: retry", "processes"),
)


def classify_limit(
    exit_code: int | None,
    stderr_tail: str,
    cpu_s: float,
    cpu_limit_s: float,
) -> LimitKind | None:
    """Which kernel-enforced limit most likely ended the program (``None``: no limit).

    Only called for a program that was not stopped by the host (wall clock, output)."""
    if exit_code is None or exit_code == 0:
        return None
    sig = exit_code - 128 if exit_code > 128 else None
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit_s * 0.95):
        return "cpu_time"
    if sig == signal.SIGXFSZ:
        return "file_size"
    for marker, kind in _STDERR_MARKERS:
        if marker in stderr_tail:
            return kind
    return None
