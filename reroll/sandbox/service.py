"""The sandbox service: a `SessionManager` behind HTTP (a Starlette app on uvicorn).

    reroll sandbox serve --port 8377                      # loopback only, no key
    REROLL_SANDBOX_API_KEY=... reroll sandbox serve --host 0.0.0.0 --port 8377

Endpoints (JSON unless said; the schema is at ``GET /openapi.json``):

- ``POST /sessions`` create (body: `SessionSpec` fields over the service's defaults);
- ``GET /sessions`` list; ``GET /sessions/{id}`` state with history; ``DELETE /sessions/{id}``
  close; ``POST /sessions/{id}/stop``;
- ``POST /sessions/{id}/exec`` run a command (`ExecRequest`), answers an `ExecResult`;
- ``GET /sessions/{id}/files?path=P`` read (the bytes), ``PUT`` the same URL write (the body's
  bytes; ``?mode=0o755``), ``GET /sessions/{id}/list?path=P&recursive=1`` list;
- ``POST /sessions/{id}/fork`` (``{"n": N}``) copies;
- ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /stats`` (percentiles as JSON).

Errors are ``{"error": {"message", "code"}}``: 400 a bad request (naming the field or path),
401 a missing or wrong key, 404 no such session, 409 the session is closed or failed (the
reason says why), 429 too many sessions, 503 the sandbox itself failed. With an API key every
endpoint but ``/health`` wants ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import socket
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reroll.sandbox.files import PathError
from reroll.sandbox.result import SandboxError
from reroll.sandbox.session import SessionGone
from reroll.sandbox.session_config import SessionsConfig, SessionSpec
from reroll.sandbox.sessions import SessionLimitReached, SessionManager, SessionNotFound

DEFAULT_PORT = 8377
API_KEY_ENV = "REROLL_SANDBOX_API_KEY"


class ExecRequest(BaseModel):
    """A command for a session."""

    model_config = ConfigDict(extra="forbid")

    cmd: str
    """A shell command (bash), run in the session's cwd with its environment."""
    stdin: str | None = None
    """Text fed to the command's stdin."""
    wall_time_s: float | None = Field(None, gt=0, le=24 * 3600)
    """This command's wall clock (default: the session's ``limits.wall_time_s``)."""
    cpu_time_s: float | None = Field(None, gt=0, le=24 * 3600)
    """CPU time of each of its processes (default: the session's)."""
    output_bytes: int | None = Field(None, ge=1)
    """stdout and stderr together (default: the session's)."""
    env: dict[str, str] | None = None
    """Variables for this command only."""


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=1024)
    """How many copies."""


class ServiceError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code}}, status_code=status)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    """One place that turns what the manager raises into HTTP answers."""
    if isinstance(exc, ServiceError):
        return _error(exc.status, exc.message, exc.code)
    if isinstance(exc, SessionNotFound):
        return _error(404, f"no session {exc.args[0]!r}", "not_found")
    if isinstance(exc, SessionGone):
        return _error(409, str(exc), "session_gone")
    if isinstance(exc, SessionLimitReached):
        return _error(429, str(exc), "too_many_sessions")
    if isinstance(exc, ValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors())
        return _error(400, problems, "invalid_request")
    if isinstance(exc, PathError | ValueError):
        return _error(400, str(exc), "invalid_request")
    if isinstance(exc, SandboxError):
        return _error(503, str(exc), "sandbox_error")
    raise exc


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ServiceError(400, f"the request body is not JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ServiceError(400, "the request body must be a JSON object", "invalid_json")
    return body


class Service:
    """The endpoints over one manager (started and closed with the app's lifespan)."""

    def __init__(self, config: SessionsConfig, api_key: str | None) -> None:
        self.config = config
        self.api_key = api_key
        self.manager: SessionManager | None = None

    @property
    def sessions(self) -> SessionManager:
        assert self.manager is not None, "the service's manager starts with the app"
        return self.manager

    def _authorize(self, request: Request) -> None:
        if self.api_key is None or request.url.path == "/health":
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ServiceError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               "unauthorized")

    async def create(self, request: Request) -> JSONResponse:
        body = await _body(request)
        default = self.config.session.model_dump()
        if isinstance(body.get("limits"), dict):  # a limit given is over the service's limits
            body["limits"] = {**default["limits"], **body["limits"]}
        spec = SessionSpec.model_validate({**default, **body})
        session = await self.sessions.create(spec)
        return JSONResponse(session.info(), status_code=201)

    async def list(self, request: Request) -> JSONResponse:
        return JSONResponse({"sessions": [s.info() for s in self.sessions.list()]})

    async def state(self, request: Request) -> JSONResponse:
        return JSONResponse(self.sessions.info(request.path_params["sid"]))

    async def close(self, request: Request) -> JSONResponse:
        sid = request.path_params["sid"]
        await self.sessions.close_session(sid)
        try:
            return JSONResponse(self.sessions.info(sid))
        except SessionNotFound:  # closed and not remembered (keep_closed: 0)
            return JSONResponse({"id": sid, "state": "closed"})

    async def stop(self, request: Request) -> JSONResponse:
        session = self.sessions.get(request.path_params["sid"])
        await session.stop()
        return JSONResponse(session.info())

    async def exec(self, request: Request) -> JSONResponse:
        session = self.sessions.get(request.path_params["sid"])
        req = ExecRequest.model_validate(await _body(request))
        result = await session.exec(req.cmd, stdin=req.stdin, wall_time_s=req.wall_time_s,
                                    cpu_time_s=req.cpu_time_s, output_bytes=req.output_bytes,
                                    env=req.env)
        return JSONResponse({**dataclasses.asdict(result), "cwd": session.cwd})

    async def files(self, request: Request) -> Response:
        session = self.sessions.get(request.path_params["sid"])
        path = request.query_params.get("path")
        if not path:
            raise ServiceError(400, "the query parameter `path` is required", "invalid_request")
        if request.method == "GET":
            return Response(await session.read(path), media_type="application/octet-stream")
        mode = int(request.query_params.get("mode", "0o644"), 0)
        await session.write(path, await request.body(), mode)
        return JSONResponse({"path": path, "written": True})

    async def listing(self, request: Request) -> JSONResponse:
        session = self.sessions.get(request.path_params["sid"])
        recursive = request.query_params.get("recursive", "0").lower() in ("1", "true", "yes")
        entries = await session.list(request.query_params.get("path", ""), recursive)
        return JSONResponse({"entries": entries})

    async def fork(self, request: Request) -> JSONResponse:
        req = ForkRequest.model_validate(await _body(request))
        forks = await self.sessions.fork(request.path_params["sid"], req.n)
        return JSONResponse({"sessions": [f.info() for f in forks]}, status_code=201)

    async def health(self, request: Request) -> JSONResponse:
        health = self.sessions.health() if self.manager else {"ok": False}
        return JSONResponse(health, status_code=200 if health["ok"] else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.sessions.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse(self.sessions.summary())

    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(openapi_schema())


ROUTES = [
    # (method, path, handler, request model, summary)
    ("POST", "/sessions", "create", SessionSpec, "Create a session (limits, TTL, idle timeout)"),
    ("GET", "/sessions", "list", None, "List the live sessions"),
    ("GET", "/sessions/{sid}", "state", None, "A session's state and history"),
    ("DELETE", "/sessions/{sid}", "close", None, "Close a session and remove its files"),
    ("POST", "/sessions/{sid}/stop", "stop", None, "Stop a session's processes, keep its files"),
    ("POST", "/sessions/{sid}/exec", "exec", ExecRequest, "Run a shell command"),
    ("GET", "/sessions/{sid}/files", "files", None, "Read a file (?path=)"),
    ("PUT", "/sessions/{sid}/files", "files", None, "Write a file (?path=, body: its bytes)"),
    ("GET", "/sessions/{sid}/list", "listing", None, "List a directory (?path=&recursive=)"),
    ("POST", "/sessions/{sid}/fork", "fork", ForkRequest, "Copy a session N times"),
    ("GET", "/health", "health", None, "Health (no key needed)"),
    ("GET", "/metrics", "metrics", None, "Prometheus metrics"),
    ("GET", "/stats", "stats", None, "Latency percentiles (ms), failures, sessions by state"),
    ("GET", "/openapi.json", "openapi", None, "This schema"),
]


def openapi_schema() -> dict:
    """An OpenAPI 3 description of `ROUTES` (request bodies from the pydantic models)."""
    paths: dict[str, dict] = {}
    for method, path, _, model, summary in ROUTES:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if "{sid}" in path:
            op["parameters"] = [{"name": "sid", "in": "path", "required": True,
                                 "schema": {"type": "string"}}]
        if model is not None:
            op["requestBody"] = {"content": {"application/json": {
                "schema": model.model_json_schema()}}}
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "reroll sandbox service", "version": "1"},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "paths": paths}


def make_app(config: SessionsConfig | None = None, api_key: str | None = None) -> Starlette:
    """The service's ASGI app; its lifespan starts and closes the session manager."""
    service = Service(config or SessionsConfig(), api_key)

    def route(method: str, path: str, name: str) -> Route:
        handler = getattr(service, name)

        async def endpoint(request: Request) -> Response:
            try:
                service._authorize(request)
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - mapped to an HTTP answer or re-raised
                return await _handle(request, exc)

        return Route(path, endpoint, methods=[method], name=f"{method} {path}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.manager = SessionManager(service.config)
        await service.manager.start()
        try:
            yield
        finally:
            await service.manager.close()

    app = Starlette(routes=[route(m, p, n) for m, p, n, _, _ in ROUTES], lifespan=lifespan)
    app.state.service = service
    return app


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> str | None:
    """Why the service may not listen on ``host`` (None: it may)."""
    if api_key is None and not _is_loopback(host):
        return (f"refusing to serve on {host} without an API key: anyone who can reach it could "
                f"run commands. Set {API_KEY_ENV} (or the variable --api-key-env names), or "
                f"bind to 127.0.0.1")
    return None


def serve(config: SessionsConfig, host: str, port: int, api_key: str | None,
          ready=None) -> None:
    """Serve until SIGINT/SIGTERM (every session is closed on the way out). ``ready`` is
    called with the bound ``(host, port)`` once it listens."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(make_app(config, api_key), log_level="warning",
                                           access_log=False, lifespan="on",
                                           timeout_keep_alive=30, backlog=1024))

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and ready is not None:
            ready(sock.getsockname()[:2])
        await task

    try:  # uvicorn's loop (uvloop when installed), as `uvicorn.run` would choose it
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            runner.run(run())
    finally:
        sock.close()


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_service_config(path: str | None) -> SessionsConfig:
    """A YAML file holding a ``sessions:`` section (or its fields at the top)."""
    if path is None:
        return SessionsConfig()
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        _fail(f"cannot read the service config {path}: {exc}")
    if isinstance(data, dict) and set(data) == {"sessions"}:
        data = data["sessions"]
    if not isinstance(data, dict):
        _fail(f"{path}: the service config must be a mapping of `sessions` fields")
    try:
        return SessionsConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"sessions.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        _fail(f"{path}: {problems}")
        raise  # unreachable


def cmd_serve(args: argparse.Namespace) -> None:
    from reroll import settings

    config = load_service_config(args.config)
    api_key = settings.read(args.api_key_env) or None
    why = check_bind(args.host, api_key)
    if why is not None:
        _fail(why)
    try:
        SessionManager(config)  # bubblewrap present, the interpreter reachable
    except SandboxError as exc:
        _fail(str(exc))

    def ready(addr) -> None:
        auth = "API key required" if api_key else "no API key: loopback only"
        print(f"reroll sandbox service on http://{addr[0]}:{addr[1]} ({auth}); "
              f"schema at /openapi.json", flush=True)

    serve(config, args.host, args.port, api_key, ready)


def configure_sandbox(p: argparse.ArgumentParser) -> None:
    """`reroll sandbox serve`'s arguments."""
    commands = p.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND")
    s = commands.add_parser("serve", help="serve sandbox sessions over HTTP (docs/sandbox.md)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (a non-loopback one needs an API key)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: a free port")
    s.add_argument("--config", help="YAML file with the `sessions:` settings (limits, TTL, "
                                    "warm, max_sessions, max_starting ...)")
    s.add_argument("--api-key-env", default=API_KEY_ENV,
                   help="environment variable holding the API key")
    s.set_defaults(fn=cmd_serve)
