"""Isolated execution of untrusted code.

`Sandbox.run(code | argv, files=..., stdin=..., limits=...) -> ExecResult` runs one program in a
fresh bubblewrap sandbox: every namespace unshared (no network), a read-only view of /usr and the
interpreter, private size-capped tmpfs for the workdir and /tmp, rlimits on CPU time, memory,
processes, file size and open files, an output cap and a wall clock that kills the whole process
tree. `SandboxPool` is the manager: a concurrency limit, warm single-use sandboxes, a health check
and metrics. A `Session` is a sandbox that lives across commands (files, cwd and environment
persist; fork; time-to-live), made by a `SessionManager` in this process or by the sandbox
service (`reroll sandbox serve`) through `SessionClient`; `open_sessions(config)` picks one of
the two, and `shared_sessions(config)` makes them usable from any event loop or sync
code. See docs/sandbox.md.
"""

from reroll.sandbox.client import SessionClient, open_sessions
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
from reroll.sandbox.session import Session, SessionGone
from reroll.sandbox.session_config import SessionsConfig, SessionSpec
from reroll.sandbox.sessions import SessionLimitReached, SessionManager, SessionNotFound
from reroll.sandbox.shared import SharedSessions, run_off_loop, shared_sessions

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
    "Session",
    "SessionClient",
    "SessionGone",
    "SessionLimitReached",
    "SessionManager",
    "SessionNotFound",
    "SessionSpec",
    "SessionsConfig",
    "SharedSessions",
    "open_sessions",
    "parse_size",
    "run_off_loop",
    "shared_sessions",
]
