"""One interface to sandbox sessions, in this process or through the sandbox service.

    async with open_sessions(SessionsConfig(mode="remote", url="http://host:8377")) as sessions:
        s = await sessions.create(ttl_s=600)
        r = await s.exec("echo hi")                  # an ExecResult, as locally
        await s.write("a.txt", b"x"); await s.read("a.txt"); await s.list()
        forks = await s.fork(4); await s.close()

`SessionClient` speaks to the service with httpx; `LocalSessions` wraps a `SessionManager`.
Both hand out sessions with the same async methods (``exec``, ``read``, ``write``, ``list``,
``fork``, ``stop``, ``close``, ``describe``) and raise the same errors: `SessionNotFound`,
`SessionGone` (closed or failed, with the reason), `SessionLimitReached`, ``ValueError`` for a
bad request or path, and `SandboxError` when the sandbox, or the service itself, fails (an
infrastructure failure, never the program's).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import httpx

from reroll import settings
from reroll.sandbox.result import ExecResult, SandboxError
from reroll.sandbox.session import Session, SessionGone
from reroll.sandbox.session_config import SessionsConfig, SessionSpec
from reroll.sandbox.sessions import SessionLimitReached, SessionManager, SessionNotFound

_RESULT_FIELDS = {f.name for f in dataclasses.fields(ExecResult)}


class ServiceUnreachable(SandboxError):
    """The sandbox service could not be reached or did not answer in time."""


class SessionHandle(Protocol):
    """What environments and rewards use, local or remote."""

    id: str

    async def exec(self, cmd: str, *, stdin: str | bytes | None = None,
                   wall_time_s: float | None = None, cpu_time_s: float | None = None,
                   output_bytes: int | None = None,
                   env: dict[str, str] | None = None) -> ExecResult: ...
    async def read(self, path: str) -> bytes: ...
    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None: ...
    async def list(self, path: str = "", recursive: bool = False) -> list[dict]: ...
    async def fork(self, n: int = 1) -> list[SessionHandle]: ...
    async def stop(self) -> None: ...
    async def close(self) -> None: ...
    async def describe(self) -> dict: ...


class RemoteSession:
    """A session of the sandbox service."""

    def __init__(self, client: SessionClient, session_id: str) -> None:
        self.client, self.id = client, session_id

    async def exec(self, cmd: str, *, stdin: str | bytes | None = None,
                   wall_time_s: float | None = None, cpu_time_s: float | None = None,
                   output_bytes: int | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        if isinstance(stdin, bytes):
            stdin = stdin.decode()
        body = {"cmd": cmd, "stdin": stdin, "wall_time_s": wall_time_s, "cpu_time_s": cpu_time_s,
                "output_bytes": output_bytes, "env": env}
        wall = wall_time_s or 0.0
        reply = await self.client.request("POST", f"/sessions/{self.id}/exec", extra_s=wall,
                                          json={k: v for k, v in body.items() if v is not None})
        data = reply.json()
        return ExecResult(**{k: v for k, v in data.items() if k in _RESULT_FIELDS})

    async def read(self, path: str) -> bytes:
        reply = await self.client.request("GET", f"/sessions/{self.id}/files",
                                          params={"path": path})
        return reply.content

    async def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        content = data.encode() if isinstance(data, str) else bytes(data)
        await self.client.request("PUT", f"/sessions/{self.id}/files", content=content,
                                  params={"path": path, "mode": oct(mode)})

    async def list(self, path: str = "", recursive: bool = False) -> list[dict]:
        reply = await self.client.request("GET", f"/sessions/{self.id}/list",
                                          params={"path": path, "recursive": int(recursive)})
        return reply.json()["entries"]

    async def fork(self, n: int = 1) -> list[RemoteSession]:
        reply = await self.client.request("POST", f"/sessions/{self.id}/fork", json={"n": n})
        return [RemoteSession(self.client, s["id"]) for s in reply.json()["sessions"]]

    async def stop(self) -> None:
        await self.client.request("POST", f"/sessions/{self.id}/stop")

    async def close(self) -> None:
        await self.client.request("DELETE", f"/sessions/{self.id}")

    async def describe(self) -> dict:
        return (await self.client.request("GET", f"/sessions/{self.id}")).json()


def _raise_for(reply: httpx.Response) -> None:
    if reply.status_code < 400:
        return
    try:
        error = reply.json()["error"]
        message, code = error["message"], error["code"]
    except (ValueError, KeyError, TypeError):
        message, code = reply.text[:500], ""
    status = reply.status_code
    if status == 404 and code == "not_found":
        raise SessionNotFound(message)
    if status == 409:
        raise SessionGone(message)
    if status == 429:
        raise SessionLimitReached(message)
    if status == 400:
        raise ValueError(message)
    if status == 401:
        raise PermissionError(f"the sandbox service refused the key: {message}")
    raise SandboxError(f"the sandbox service answered {status}: {message}")


class SessionClient:
    """The sandbox service's async client (one connection pool; use it with ``async with``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 120.0,
                 spec: SessionSpec | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.spec = spec
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers,
                                       limits=httpx.Limits(max_connections=256,
                                                           max_keepalive_connections=256))

    async def __aenter__(self) -> SessionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, extra_s: float = 0.0, **kwargs):
        try:
            reply = await self._http.request(method, path, timeout=self.timeout_s + extra_s,
                                             **kwargs)
        except httpx.TransportError as exc:
            raise ServiceUnreachable(f"the sandbox service at {self.url} is unreachable: "
                                     f"{type(exc).__name__}: {exc}") from exc
        _raise_for(reply)
        return reply

    async def create(self, spec: SessionSpec | None = None, **changes) -> RemoteSession:
        body = (spec or self.spec).model_dump(mode="json") if (spec or self.spec) else {}
        body.update(changes)
        reply = await self.request("POST", "/sessions", json=body)
        return RemoteSession(self, reply.json()["id"])

    async def get(self, session_id: str) -> RemoteSession:
        await self.request("GET", f"/sessions/{session_id}")
        return RemoteSession(self, session_id)

    async def list(self) -> list[dict]:
        return (await self.request("GET", "/sessions")).json()["sessions"]

    async def health(self) -> dict:
        return (await self.request("GET", "/health")).json()

    async def metrics(self) -> str:
        return (await self.request("GET", "/metrics")).text

    async def stats(self) -> dict:
        """The service's latency percentiles (ms, measured in the service), failures, states."""
        return (await self.request("GET", "/stats")).json()


class LocalSessions:
    """`SessionManager` with the client's interface (``create``, ``get``, ``list``, ...)."""

    def __init__(self, config: SessionsConfig) -> None:
        self.manager = SessionManager(config)

    async def __aenter__(self) -> LocalSessions:
        await self.manager.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.manager.close()

    async def create(self, spec: SessionSpec | None = None, **changes) -> Session:
        return await self.manager.create(spec, **changes)

    async def get(self, session_id: str) -> Session:
        return self.manager.get(session_id)

    async def list(self) -> list[dict]:
        return [s.info() for s in self.manager.list()]

    async def health(self) -> dict:
        return self.manager.health()

    async def metrics(self) -> str:
        return self.manager.metrics.exposition().decode()

    async def stats(self) -> dict:
        return self.manager.summary()


def open_sessions(config: SessionsConfig | None = None) -> LocalSessions | SessionClient:
    """Sessions where ``config.mode`` says: in this process, or through the service at
    ``config.url`` (its key read from the variable ``config.api_key_env``)."""
    config = config or SessionsConfig()
    if config.mode == "local":
        return LocalSessions(config)
    api_key = settings.read(config.api_key_env) if config.api_key_env else None
    if config.api_key_env and not api_key:
        raise ValueError(f"sessions.api_key_env names {config.api_key_env}, which is not set")
    return SessionClient(config.url, api_key, config.request_timeout_s, config.session)
