"""Isolated execution of untrusted code.

`Sandbox.run(code | argv, files=..., stdin=..., limits=...) -> ExecResult` runs one program in a
fresh bubblewrap sandbox: every namespace unshared (no network), a read-only view of /usr and the
interpreter, private size-capped tmpfs for the workdir and /tmp, rlimits on CPU time, memory,
processes, file size and open files, an output cap and a wall clock that kills the whole process
tree. `SandboxPool` is the manager: a concurrency limit, warm single-use sandboxes, a health check
and metrics. See docs/sandbox.md.
"""

from reroll.sandbox.limits import Limits, PoolConfig, SandboxConfig, parse_size
from reroll.sandbox.pool import Health, SandboxPool
from reroll.sandbox.result import (
    ExecResult,
    LimitKind,
    SandboxError,
    SandboxLost,
    SandboxUnavailable,
)
from reroll.sandbox.sandbox import Job, Sandbox

__all__ = [
    "ExecResult",
    "Health",
    "Job",
    "LimitKind",
    "Limits",
    "PoolConfig",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxLost",
    "SandboxPool",
    "SandboxUnavailable",
    "parse_size",
]
