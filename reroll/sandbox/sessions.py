"""`SessionManager`: creates, forks, reaps and counts sandbox sessions in this process.

It caps the sessions alive (``max_sessions``) and starting at once (``max_starting``), keeps
``warm`` sandboxes started ahead of time on empty session directories (taken by creates and
forks with the default sizes), stops idle sessions and closes expired ones every
``reap_interval_s``, and keeps Prometheus metrics. The sandbox service (``service.py``) is this
manager behind HTTP. A manager belongs to the event loop it is started in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import OrderedDict

from reroll.sandbox.files import SessionDir
from reroll.sandbox.metrics import percentile
from reroll.sandbox.process import SandboxProcess
from reroll.sandbox.result import ExecResult, SandboxError
from reroll.sandbox.sandbox import Sandbox
from reroll.sandbox.session import (
    Session,
    SessionGone,
    _Channel,
    close_channel,
    driver_payload,
    open_channel,
)
from reroll.sandbox.session_config import SessionsConfig, SessionSpec
from reroll.sandbox.session_metrics import SessionMetrics

logger = logging.getLogger(__name__)


_PREFIX, _OWNER = "reroll-sessions-", ".owner"
"""A manager's folder in the temp dir, and its file naming the process (pid, start time)."""


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None when it is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _remove_root(root: str, workdir: str) -> None:
    for name in os.listdir(root):  # a start cut short may have left its mount
        if os.path.isdir(os.path.join(root, name)):
            SessionDir(os.path.join(root, name), workdir, None, mounted=True).remove()
    shutil.rmtree(root, ignore_errors=True)


def sweep_stale(parent: str, workdir: str) -> int:
    """Remove the managers' folders in ``parent`` whose process has gone without closing them
    (killed with SIGKILL: no handler ran), unmounting their sessions' tmpfs; how many. A
    folder without an owner file (starting, or an older reroll's) is left alone."""
    swept = 0
    for name in os.listdir(parent):
        root = os.path.join(parent, name)
        if not name.startswith(_PREFIX):
            continue
        try:
            with open(os.path.join(root, _OWNER)) as handle:
                pid, started = handle.read().split()
            if _started(int(pid)) == started:
                continue  # alive
        except (OSError, ValueError):
            continue
        _remove_root(root, workdir)
        swept += 1
    return swept


class SessionLimitReached(SandboxError):
    """``max_sessions`` sessions are alive; close some first."""


class SessionNotFound(KeyError):
    """No session has this id (or it was closed long ago)."""


class _Warm:
    """A session sandbox started ahead of time on an empty directory, its driver waiting."""

    def __init__(self, channel: _Channel, directory: SessionDir) -> None:
        self.channel, self.dir = channel, directory

    async def discard(self) -> None:
        try:
            await close_channel(self.channel)
        finally:  # even when cancelled (the manager closes): no mount is left behind
            await self.dir.remove_async()


class SessionManager:
    """Sessions in this process (see the module docstring)."""

    def __init__(self, config: SessionsConfig | None = None, sandbox: Sandbox | None = None):
        self.config = config or SessionsConfig()
        self.sandbox = sandbox or Sandbox(self.config.sandbox)
        if self.sandbox.backend.name != "bwrap":
            raise SandboxError("sessions need the bwrap backend (a private, persistent workdir "
                               "bound into a namespace); the rlimit backend has no such thing")
        self.workdir = self.sandbox.config.workdir
        self.root = ""
        self.metrics = SessionMetrics(self.counts)
        self._sessions: dict[str, Session] = {}
        self._closed: OrderedDict[str, dict] = OrderedDict()
        self._starting = asyncio.Semaphore(self.config.max_starting)
        self._warm: list[_Warm] = []
        self._tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None
        self._is_closed = False

    async def __aenter__(self) -> SessionManager:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        swept = sweep_stale(tempfile.gettempdir(), self.workdir)
        if swept:
            logger.warning("sandbox sessions: removed %d session folder(s) (and their tmpfs) "
                           "left by a process that was killed", swept)
        self.root = tempfile.mkdtemp(prefix=_PREFIX)
        os.chmod(self.root, 0o711)  # the sandbox uid must reach its own directory
        with open(os.path.join(self.root, _OWNER), "w") as handle:
            handle.write(f"{os.getpid()} {_started(os.getpid())}")
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        self._replenish()

    async def close(self) -> None:
        """Close every session and stop the warm sandboxes."""
        self._is_closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*(self.close_session(i, "the manager closed")
                               for i in list(self._sessions)), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._warm:
            await self._warm.pop().discard()
        if self.root:
            _remove_root(self.root, self.workdir)

    def spawn(self, coro) -> None:
        """Run ``coro`` in the background, kept until done (closed with the manager)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- sandboxes -----------------------------------------------------------------------------

    def _new_dir(self, spec: SessionSpec) -> SessionDir:
        backend = self.sandbox.backend
        owner = (backend.uid, backend.gid) if backend.uid is not None else None
        directory = SessionDir(os.path.join(self.root, uuid.uuid4().hex), self.workdir, owner)
        directory.create(spec.disk_bytes, spec.disk_inodes)
        return directory

    async def _open(self, spec: SessionSpec, directory: SessionDir) -> _Channel:
        """Start a sandbox on ``directory`` and its driver (with ``spec``'s rlimits)."""
        backend = self.sandbox.backend
        launch = backend.launch_spec(spec.limits.tmpfs_bytes, binds=directory.binds(self.workdir))
        proc = await SandboxProcess.start(launch, spec.limits.tmpfs_bytes,
                                          self.sandbox.config.spawn_timeout_s)
        payload = driver_payload(spec, self.workdir, proc.spec.sandbox_env)
        return await open_channel(proc, payload)

    def _fits_warm(self, spec: SessionSpec) -> bool:
        default = self.config.session
        return (spec.limits == default.limits and spec.disk_bytes == default.disk_bytes
                and spec.disk_inodes == default.disk_inodes)

    def _take_warm(self, spec: SessionSpec) -> _Warm | None:
        if not self._fits_warm(spec):
            return None
        while self._warm:
            warm = self._warm.pop(0)
            if warm.channel.proc.alive:
                return warm
            self.record_failure("warm_died")
            self.spawn(warm.discard())
        return None

    def _replenish(self) -> None:
        pending = sum(1 for t in self._tasks if t.get_name() == "warm")
        for _ in range(self.config.warm - len(self._warm) - pending):
            if self._is_closed or len(self._sessions) >= self.config.max_sessions:
                return
            task = asyncio.get_running_loop().create_task(self._start_warm(), name="warm")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start_warm(self) -> None:
        spec = self.config.session
        directory = None
        try:
            async with self._starting:
                directory = self._new_dir(spec)
                channel = await self._open(spec, directory)
        except BaseException as exc:
            if directory is not None:
                directory.remove()
            if not isinstance(exc, SandboxError | OSError):
                raise  # cancelled (the manager closes)
            self.record_failure("spawn_error")
            logger.warning("could not start a warm session sandbox: %s", exc)
            return
        warm = _Warm(channel, directory)
        if self._is_closed:
            await warm.discard()
        else:
            self._warm.append(warm)

    async def _launch(self, session: Session, state, source: Session | None) -> None:
        """Start ``session``'s sandbox: a warm one if it fits, else a new one."""
        warm = self._take_warm(session.spec)
        if warm is not None:
            session.dir, channel = warm.dir, warm.channel
            if state is None and session.spec.env != self.config.session.env:
                state = (self.workdir, {**channel.proc.spec.sandbox_env, **session.spec.env})
        else:
            async with self._starting:
                session.dir = self._new_dir(session.spec)
                channel = await self._open(session.spec, session.dir)
        try:
            if source is not None:
                await asyncio.get_running_loop().run_in_executor(None, source.dir.copy_to,
                                                                 session.dir)
            await session.attach(channel, state)
        except BaseException:
            if session._channel is not channel:
                await asyncio.shield(close_channel(channel))
            raise

    # -- the API -------------------------------------------------------------------------------

    async def create(self, spec: SessionSpec | None = None, **changes) -> Session:
        """A new running session (``changes`` are `SessionSpec` fields over the defaults)."""
        spec = spec or self.config.session
        if changes:
            base = spec.model_dump()
            if isinstance(changes.get("limits"), dict):  # given limits over the defaults
                changes["limits"] = {**base["limits"], **changes["limits"]}
            spec = SessionSpec.model_validate({**base, **changes})
        return await self._make(spec, None, None)

    async def _make(self, spec: SessionSpec, state, source: Session | None) -> Session:
        if self._is_closed:
            raise SandboxError("the session manager is closed")
        if len(self._sessions) >= self.config.max_sessions:
            self.record_failure("max_sessions")
            raise SessionLimitReached(f"{len(self._sessions)} sessions are alive, the most "
                                      f"max_sessions allows; close some first")
        started = time.perf_counter()
        session_id = uuid.uuid4().hex[:16]
        directory = SessionDir(os.path.join(self.root, session_id), self.workdir, None)
        session = Session(self, session_id, spec, directory)
        self._sessions[session_id] = session
        try:
            await self._launch(session, state, source)
        except BaseException as exc:
            cause = "spawn_error" if isinstance(exc, SandboxError | OSError) else "cancelled"
            session._fail(cause, f"could not start: {exc}")
            await self.close_session(session_id, "start failed")
            raise
        finally:
            self._replenish()
        self.metrics.created(time.perf_counter() - started)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            if session_id in self._closed:
                info = self._closed[session_id]
                raise SessionGone(f"session {session_id} is {info['state']}: {info['reason']}")
            raise SessionNotFound(session_id)
        return session

    def info(self, session_id: str) -> dict:
        """A live session's info, or a closed one's last info."""
        if session_id in self._sessions:
            return self._sessions[session_id].info()
        if session_id in self._closed:
            return self._closed[session_id]
        raise SessionNotFound(session_id)

    def list(self) -> list[Session]:
        return list(self._sessions.values())

    async def fork(self, session_id: str, n: int = 1) -> list[Session]:
        """``n`` new sessions, each a copy of the source's files and shell state (cwd, env);
        its running processes are not copied."""
        if not 1 <= n <= 1024:
            raise ValueError("n must be between 1 and 1024")
        source = self.get(session_id)
        started = time.perf_counter()
        state = await source.shell_state()
        forks = await asyncio.gather(*(self._make(source.spec, state, source) for _ in range(n)),
                                     return_exceptions=True)
        errors = [f for f in forks if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(self.close_session(f.id, "fork failed") for f in forks
                                   if isinstance(f, Session)))
            raise errors[0]
        self.metrics.forked(time.perf_counter() - started)
        return list(forks)

    async def resume(self, session: Session) -> None:
        """Start a stopped session again on its files, with its saved shell state."""
        state = (session.cwd, session.env) if session.env is not None else None
        async with self._starting:
            channel = await self._open(session.spec, session.dir)
        await session.attach(channel, state)

    async def close_session(self, session_id: str, reason: str = "closed by request") -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            if session_id in self._closed:
                return
            raise SessionNotFound(session_id)
        try:
            await session.shutdown(reason)
        finally:
            if self.config.keep_closed:
                self._closed[session_id] = session.info()
                while len(self._closed) > self.config.keep_closed:
                    self._closed.popitem(last=False)

    # -- reaping and metrics -------------------------------------------------------------------

    async def reap(self) -> None:
        """Close expired sessions, stop idle ones."""
        now, mono = time.time(), time.monotonic()
        for session in list(self._sessions.values()):
            if now >= session.expires_at:
                await self.close_session(session.id, f"time to live ({session.spec.ttl_s:g}s) "
                                                     "passed")
            elif (session.state == "running" and not session._lock.locked()
                  and mono - session.last_used >= session.spec.idle_timeout_s):
                await session.stop(f"idle for {session.spec.idle_timeout_s:g}s")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap()
            except Exception:  # one bad session must not stop the reaper
                logger.exception("sandbox sessions: reaping failed")

    def record_failure(self, cause: str) -> None:
        self.metrics.failure(cause)

    def record_exec(self, result: ExecResult) -> None:
        self.metrics.executed(result)

    def counts(self) -> dict[str, int]:
        """Sessions by state (closed: those still remembered)."""
        counts = dict.fromkeys(("starting", "running", "stopped", "closed", "failed"), 0)
        for session in self._sessions.values():
            counts[session.state] += 1
        for info in self._closed.values():
            counts[info["state"]] += 1
        return counts

    def health(self) -> dict:
        return {"ok": not self._is_closed, "backend": self.sandbox.backend.name,
                "sessions": len(self._sessions), "warm": len(self._warm)}

    def summary(self) -> dict:
        """Latency percentiles (ms) and failures, for a benchmark or a tracker."""
        m = self.metrics
        return {"create_p50_ms": percentile(m.create_s, 50) * 1e3,
                "create_p99_ms": percentile(m.create_s, 99) * 1e3,
                "exec_p50_ms": percentile(m.exec_s, 50) * 1e3,
                "fork_p50_ms": percentile(m.fork_s, 50) * 1e3,
                "failures": dict(m.failures), "states": self.counts()}


__all__ = ["SessionGone", "SessionLimitReached", "SessionManager", "SessionNotFound"]
