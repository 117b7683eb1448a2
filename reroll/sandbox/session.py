"""`Session`: a sandbox that lives across commands.

    async with SessionManager() as sessions:
        s = await sessions.create()
        await s.exec("mkdir src && cd src && export NAME=demo")
        r = await s.exec("pwd; echo $NAME")          # '/work/src\\ndemo\\n': cwd and env persist
        await s.write("src/data.txt", b"hello")
        await s.read("src/data.txt"), await s.list("src")
        forks = await s.fork(4)                       # four independent copies of this state

One long-lived bubblewrap sandbox per session, with every limit of a one-shot sandbox, runs a
driver (``_driver.py``) that executes each command in a fresh shell started in the saved cwd
with the saved environment. The workdir is a host directory (a tmpfs of the session's disk
quota) bound into the sandbox, so files outlive the processes: a stopped session keeps them, and
the host reads and writes them without entering the sandbox (``files.py``).

States: ``starting`` -> ``running`` -> (``stopped`` <-> ``running``) -> ``closed``; ``failed``
when the sandbox could not start or died (the reason names why). ``history`` records each
change with its time and reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import marshal
import math
import resource
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from reroll.sandbox.files import SessionDir
from reroll.sandbox.limits import check_env
from reroll.sandbox.process import SandboxProcess
from reroll.sandbox.result import ExecResult, SandboxError, SandboxLost, classify_limit
from reroll.sandbox.session_config import SessionsConfig, SessionSpec

State = Literal["starting", "running", "stopped", "closed", "failed"]
DRIVER_SOURCE = (Path(__file__).with_name("_driver.py")).read_text()
_ANSWER_GRACE_S = 10.0
_STDERR_TAIL = 4096


class SessionGone(SandboxError):
    """The session is closed or failed; the message says why."""


@dataclass
class Event:
    at: float
    """Unix time."""
    state: State
    reason: str

    def as_dict(self) -> dict:
        return {"at": self.at, "state": self.state, "reason": self.reason}


@dataclass
class _Channel:
    """The pipes to a running driver."""

    proc: SandboxProcess
    reader: asyncio.StreamReader
    writer: asyncio.WriteTransport
    stderr: bytearray = field(default_factory=bytearray)
    transports: list = field(default_factory=list)


class _Tail(asyncio.Protocol):
    def __init__(self, sink: bytearray) -> None:
        self.sink = sink

    def data_received(self, data: bytes) -> None:
        self.sink.extend(data)
        del self.sink[:-_STDERR_TAIL]


def driver_payload(spec: SessionSpec, workdir: str, base_env: dict[str, str]) -> bytes:
    """The launcher's job: the driver as Python code, with the session's rlimits but CPU time
    (the driver sets that per command: its own CPU time grows over a long session)."""
    rlimits = [r for r in spec.limits.rlimits() if r[0] != resource.RLIMIT_CPU]
    env = {**base_env, **spec.env}
    return marshal.dumps({"code": DRIVER_SOURCE, "argv": None, "files": {}, "workdir": workdir,
                          "env": env, "rlimits": rlimits})


async def open_channel(proc: SandboxProcess, payload: bytes) -> _Channel:
    """Hand the driver to a started sandbox and connect to its pipes (the sandbox is destroyed
    when that fails)."""
    try:
        return await _connect(proc, payload)
    except BaseException:
        await proc.destroy()
        raise


async def _connect(proc: SandboxProcess, payload: bytes) -> _Channel:
    loop = proc.loop
    ack = b""
    with contextlib.suppress(OSError):
        await loop.sock_sendall(proc.channel, payload)
        proc.channel.shutdown(socket.SHUT_WR)
        ack = await loop.sock_recv(proc.channel, 1)
    proc.used = True
    if ack != b"J":
        raise SandboxLost("the session's sandbox died before it got its driver")
    reader = asyncio.StreamReader(limit=1 << 30)
    out, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                          proc.popen.stdout)
    stderr = bytearray()
    err, _ = await loop.connect_read_pipe(lambda: _Tail(stderr), proc.popen.stderr)
    writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.popen.stdin)
    return _Channel(proc, reader, writer, stderr, [out, err, writer])


async def close_channel(channel: _Channel) -> None:
    for transport in channel.transports:
        transport.close()
    await channel.proc.destroy()


class Owner(Protocol):
    """What a session needs of its `SessionManager` (named here, not imported: the manager
    imports this module)."""

    config: SessionsConfig
    workdir: str

    def spawn(self, coro) -> None: ...
    def record_failure(self, cause: str) -> None: ...
    def record_exec(self, result: ExecResult) -> None: ...
    async def resume(self, session: Session) -> None: ...
    async def fork(self, session_id: str, n: int) -> list[Session]: ...
    async def close_session(self, session_id: str, reason: str) -> None: ...


class Session:
    """One session; made by `SessionManager.create` or `fork`. Safe to share between asyncio
    tasks: commands of one session run one at a time, in the order they were asked for."""

    def __init__(self, manager: Owner, session_id: str, spec: SessionSpec,
                 directory: SessionDir) -> None:
        self.manager = manager
        self.id = session_id
        self.spec = spec
        self.dir = directory
        self.created_at = time.time()
        self.last_used = time.monotonic()
        self.expires_at = self.created_at + spec.ttl_s
        self.history: list[Event] = []
        self.state: State = "starting"
        self.cwd = manager.workdir
        self.env: dict[str, str] | None = None
        """The shell state saved when the session stopped (None: the driver's own start)."""
        self.execs = 0
        self._channel: _Channel | None = None
        self._lock = asyncio.Lock()
        self._set("starting", "created")

    # -- state ---------------------------------------------------------------------------------

    def _set(self, state: State, reason: str) -> None:
        self.state = state
        self.history.append(Event(time.time(), state, reason))

    @property
    def reason(self) -> str:
        return self.history[-1].reason

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "running", "stopped")

    def info(self) -> dict:
        """What the service's state endpoint returns."""
        return {
            "id": self.id, "state": self.state, "reason": self.reason,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "idle_s": time.monotonic() - self.last_used, "execs": self.execs, "cwd": self.cwd,
            "history": [e.as_dict() for e in self.history],
            "spec": self.spec.model_dump(mode="json"),
        }  # fmt: skip

    async def describe(self) -> dict:
        """`info`, awaitable like a remote session's."""
        return self.info()

    def _check_open(self, files: bool = False) -> None:
        """Commands need a session that is not closed or failed; files (``files``) stay
        readable in a failed session until it is closed."""
        if self.state == "closed" or (self.state == "failed" and not files):
            raise SessionGone(f"session {self.id} is {self.state}: {self.reason}")

    # -- process -------------------------------------------------------------------------------

    async def attach(self, channel: _Channel, state: tuple[str, dict[str, str]] | None) -> None:
        """Make the driver behind ``channel`` (on this session's directory) its sandbox, and
        give it ``state`` (cwd, env) when not None."""
        self._channel = channel
        channel.proc._exited.add_done_callback(lambda _f, c=channel: self._on_exit(c))
        if state is not None:
            reply = await self._ask({"op": "set", "cwd": state[0], "env": state[1]}, 10.0)
            self.cwd = reply.get("cwd", self.cwd)
        self._set("running", "started" if self.execs == 0 else "restarted")

    def _on_exit(self, channel: _Channel) -> None:
        """The sandbox ended on its own (the driver was killed, or crashed)."""
        if self._channel is not channel or self.state not in ("running", "starting"):
            return
        status, _ = channel.proc._exited.result()
        code = status >> 8 if status & 0x7F == 0 else 128 + (status & 0x7F)
        tail = channel.stderr.decode("utf-8", "replace").strip()[-500:]
        detail = f"exit {code}" + (f" (signal {code - 128})" if code > 128 else "")
        self._fail("session_died", f"the session's sandbox ended on its own ({detail})"
                   + (f": {tail}" if tail else ""))

    def _fail(self, cause: str, reason: str) -> None:
        if self.state in ("closed", "failed"):
            return
        self._set("failed", reason)
        self.manager.record_failure(cause)
        channel, self._channel = self._channel, None
        if channel is not None:
            self.manager.spawn(self._kill(channel))

    async def _kill(self, channel: _Channel) -> None:
        await close_channel(channel)

    async def _ask(self, request: dict, timeout: float) -> dict:
        channel = self._channel
        if channel is None:
            raise SessionGone(f"session {self.id} has no running sandbox")
        line, timed_out = b"", False
        frame = marshal.dumps(request)
        try:
            channel.writer.write(struct.pack(">I", len(frame)) + frame)
            async with asyncio.timeout(timeout):
                line = await channel.reader.readline()
        except TimeoutError:
            timed_out = True
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        if not line:
            if timed_out:
                self._fail("unresponsive", f"the session's driver gave no answer within "
                                           f"{timeout:.0f}s")
            else:  # its pipe closed: the sandbox is ending; let its exit status name the cause
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(channel.proc._exited), 5.0)
                if not channel.proc.alive:
                    self._on_exit(channel)
                self._fail("session_died", "the session's driver closed its pipe")
            raise SessionGone(f"session {self.id} failed: {self.reason}")
        reply = json.loads(line)
        if "error" in reply:
            raise SandboxError(f"session {self.id}: {_text(reply['error'])}")
        for key in ("stdout", "stderr"):
            if key in reply:
                reply[key] = _text(reply[key])
        if "cwd" in reply:
            reply["cwd"] = _text(reply["cwd"])
        if "env" in reply:
            reply["env"] = _env(reply["env"])
        return reply

    # -- the API -------------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str,
        *,
        stdin: str | bytes | None = None,
        wall_time_s: float | None = None,
        cpu_time_s: float | None = None,
        output_bytes: int | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run the shell command ``cmd`` in the session (bash, in the saved cwd and env).
        Limits default to the session's; a limit hit ends the command, not the session."""
        if not isinstance(cmd, str) or "\0" in cmd:
            raise ValueError("`cmd` must be a string without NUL bytes")
        limits = self.spec.limits
        wall = wall_time_s if wall_time_s is not None else limits.wall_time_s
        cpu = cpu_time_s if cpu_time_s is not None else limits.cpu_time_s
        budget = output_bytes if output_bytes is not None else limits.output_bytes
        if not (0 < wall <= 24 * 3600 and 0 < cpu <= 24 * 3600 and budget >= 1):
            raise ValueError("wall_time_s and cpu_time_s must be in (0, 86400], output_bytes >= 1")
        check_env(dict(env or {}))
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        request = {"op": "exec", "cmd": cmd, "stdin": data,
                   "wall_time_s": wall, "cpu_time_s": cpu, "output_bytes": budget,
                   "env": dict(env or {})}
        called = time.perf_counter()
        async with self._lock:
            await self._ensure_running()
            self.last_used = time.monotonic()
            try:
                reply = await self._ask(request, wall + _ANSWER_GRACE_S)
            finally:
                self.last_used = time.monotonic()
            self.execs += 1
            self.cwd = reply["cwd"]
        result = _to_result(reply, float(math.ceil(cpu)), time.perf_counter() - called)
        self.manager.record_exec(result)
        return result

    async def _ensure_running(self) -> None:
        self._check_open()
        if self.state == "stopped":
            await self.manager.resume(self)

    async def shell_state(self) -> tuple[str, dict[str, str]]:
        """The cwd and environment the next command starts with."""
        async with self._lock:
            self._check_open()
            if self.state == "stopped" or self._channel is None:
                return self.cwd, dict(self.env or {})
            reply = await self._ask({"op": "state"}, _ANSWER_GRACE_S)
            return reply["cwd"], reply["env"]

    async def read(self, path: str) -> bytes:
        self._check_open(files=True)
        self.last_used = time.monotonic()
        return self.dir.read(path, self.manager.config.max_read_bytes)

    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        self._check_open(files=True)
        self.last_used = time.monotonic()
        self.dir.write(path, data.encode() if isinstance(data, str) else bytes(data), mode)

    async def list(self, path: str = "", recursive: bool = False) -> list[dict]:
        self._check_open(files=True)
        self.last_used = time.monotonic()
        return [e.as_dict() for e in self.dir.list(path, recursive)]

    async def fork(self, n: int = 1) -> list[Session]:
        """``n`` new sessions, each with a copy of this one's files and shell state."""
        return await self.manager.fork(self.id, n)

    async def stop(self, reason: str = "stopped by request") -> None:
        """End the session's processes; its files and shell state stay (exec starts it again)."""
        async with self._lock:
            if self.state != "running":
                return
            with contextlib.suppress(SandboxError):
                reply = await self._ask({"op": "state"}, _ANSWER_GRACE_S)
                self.cwd, self.env = reply["cwd"], reply["env"]
            channel, self._channel = self._channel, None
            if self.state == "running":
                self._set("stopped", reason)
            if channel is not None:
                await self._kill(channel)

    async def close(self, reason: str = "closed by request") -> None:
        """End the session and remove its files."""
        await self.manager.close_session(self.id, reason)

    async def shutdown(self, reason: str) -> None:
        """The manager's side of `close`."""
        if self.state == "closed":
            return
        channel, self._channel = self._channel, None
        if self.state != "failed":
            self._set("closed", reason)
        else:
            self.history.append(Event(time.time(), "failed", f"removed: {reason}"))
        try:
            if channel is not None:
                await self._kill(channel)
        finally:  # even when cancelled: the files and the mount go
            await self.dir.remove_async()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode("utf-8", "replace")


def _env(b64: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in _text(b64).split("\0") if item)
    return {name: value for name, _, value in pairs}


def _to_result(reply: dict, cpu_limit: float, total: float) -> ExecResult:
    stderr = reply["stderr"]
    code = int(reply["exit_code"])
    if reply["timed_out"]:
        limit = "wall_time"
    elif reply["output_truncated"]:
        limit = "output"
    else:
        limit = classify_limit(code, stderr[-_STDERR_TAIL:], reply["cpu_s"], cpu_limit)
    return ExecResult(
        stdout=reply["stdout"],
        stderr=stderr,
        exit_code=code,
        timed_out=reply["timed_out"],
        limit=limit,
        signal=code - 128 if code > 128 else None,
        output_truncated=reply["output_truncated"],
        wall_s=reply["wall_s"],
        cpu_s=reply["cpu_s"],
        max_rss_bytes=reply["max_rss_bytes"],
        total_s=total,
        warm=True,
    )
