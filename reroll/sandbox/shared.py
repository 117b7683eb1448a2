"""Sandbox sessions usable from any event loop, any thread, or sync code.

Sessions and the service's client are asyncio objects bound to the loop that made them, while
environments are called from the agent loop's loop, from sync code (`reset`/`step` through
`asyncio.run`) and from env host processes. So one process-wide event loop, in a daemon thread
of its own, owns every `LocalSessions` / `SessionClient` made here (one per distinct
`SessionsConfig`) and every session they hand out; callers submit coroutines to it and await
the result on their own loop (or block on it from sync code). Environments' one-shot sandbox
runs go there too (`run_off_loop`), away from the loop that decodes.

    sessions = shared_sessions(SessionsConfig(mode="remote", url="http://host:8377"))
    s = await sessions.create(spec)          # from any loop
    r = await s.exec("cd src && ls")
    await s.close()

At the interpreter's exit (atexit) the sessions still open are closed and the local managers
shut down, so no session, process or tmpfs mount outlives a normal exit. A process killed
with SIGKILL runs no handler: its sandboxes die with it (bubblewrap's ``--die-with-parent``),
its tmpfs mounts stay until the next `SessionManager` start on the machine sweeps them
(`reroll.sandbox.sessions.sweep_stale`), and a remote service reaps its sessions by their
time to live.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from reroll.sandbox.client import LocalSessions, SessionClient, SessionHandle, open_sessions
from reroll.sandbox.result import ExecResult
from reroll.sandbox.sandbox import Sandbox
from reroll.sandbox.session_config import SessionsConfig, SessionSpec

logger = logging.getLogger(__name__)

_EXIT_TIMEOUT_S = 30.0
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_openers: dict[str, asyncio.Task] = {}
"""One started `LocalSessions` / `SessionClient` per config (as JSON), made on the loop."""
_live: set[SessionHandle] = set()
"""Sessions created here and not closed yet (closed at exit)."""


def _background() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True,
                             name="reroll-sessions").start()
            atexit.register(shutdown)
        return _loop


def submit(coro: Coroutine) -> concurrent.futures.Future:
    """Run ``coro`` on the sessions' loop; its future (cancelling it cancels the coroutine)."""
    return asyncio.run_coroutine_threadsafe(coro, _background())


async def call(coro: Coroutine) -> Any:
    """``await coro`` on the sessions' loop, from whatever loop runs this."""
    loop = _background()
    with contextlib.suppress(RuntimeError):
        if asyncio.get_running_loop() is loop:
            return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def run_off_loop(sandbox: Sandbox, *args: Any, **kwargs: Any) -> ExecResult:
    """`sandbox.run(...)` on the sessions' loop, awaited from the caller's. Environments call
    the sandbox from the rollout's loop, where the HF engine runs one decoding step per loop
    turn; a one-shot run needs a dozen turns (start, job, pipes, exit), so there one `ls`
    waited 21 decoding steps and episodes failed their env step time limit. Here it waits one."""
    return await call(sandbox.run(*args, **kwargs))


def shutdown(timeout_s: float = _EXIT_TIMEOUT_S) -> None:
    """Close every session still open and the managers and clients (called at exit)."""
    global _loop
    with _lock:
        loop, _loop = _loop, None
    if loop is None or loop.is_closed():
        return

    async def close_all() -> None:
        await asyncio.gather(*(s.close() for s in list(_live)), return_exceptions=True)
        _live.clear()
        openers = [t for t in _openers.values() if t.done() and not t.exception()]
        _openers.clear()
        await asyncio.gather(*(t.result().close() for t in openers), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout_s)
    except Exception as exc:  # noqa: BLE001 - at exit: say so, never hang or raise
        logger.warning("sandbox sessions: closing them at exit failed: %r", exc)
    loop.call_soon_threadsafe(loop.stop)


async def _opener(config: SessionsConfig) -> LocalSessions | SessionClient:
    """The started sessions of ``config`` (runs on the sessions' loop)."""
    key = config.model_dump_json()
    task = _openers.get(key)
    if task is None or (task.done() and task.exception() is not None):
        async def start() -> LocalSessions | SessionClient:
            opener = open_sessions(config)
            await opener.__aenter__()
            return opener

        task = _openers[key] = asyncio.get_running_loop().create_task(start())
    return await asyncio.shield(task)


class SharedSessions:
    """Sessions of one `SessionsConfig`, usable from any loop (see the module docstring)."""

    def __init__(self, config: SessionsConfig) -> None:
        self.config = config

    async def create(self, spec: SessionSpec | None = None) -> SharedSession:
        async def create() -> SessionHandle:
            session = await (await _opener(self.config)).create(spec)
            _live.add(session)
            return session

        return SharedSession(await call(create()))


class SharedSession:
    """One session; each call runs on the sessions' loop."""

    def __init__(self, session: SessionHandle) -> None:
        self.session = session
        self.id = session.id

    async def exec(self, cmd: str, **kwargs: Any) -> ExecResult:
        return await call(self.session.exec(cmd, **kwargs))

    async def read(self, path: str) -> bytes:
        return await call(self.session.read(path))

    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        await call(self.session.write(path, data, mode))

    async def list(self, path: str = "", recursive: bool = False) -> list[dict]:
        return await call(self.session.list(path, recursive))

    async def stop(self) -> None:
        await call(self.session.stop())

    async def describe(self) -> dict:
        return await call(self.session.describe())

    async def close(self) -> None:
        await call(_close(self.session))

    def close_soon(self) -> None:
        """Close it in the background, without waiting (from a finalizer or sync code)."""
        loop = _loop
        if loop is not None:  # else the loop has gone (at exit), and closed it there
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(_close(self.session), loop)


async def _close(session: SessionHandle) -> None:
    _live.discard(session)
    await session.close()


def shared_sessions(config: SessionsConfig) -> SharedSessions:
    return SharedSessions(config)
