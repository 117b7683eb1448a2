"""The HTTP stack of reroll's servers: Starlette apps on uvicorn, OpenAI-style JSON errors.

`engines/server.py` (the completion server) and `rollout/gateway/` (the agents' gateway) both
serve a Starlette app from a uvicorn server in a background thread (`ServerThread`), and answer
a bad request as OpenAI's API does: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status (400 naming the bad or unsupported parameter, `context_length_exceeded` for a prompt
past the context, 409 for a call to a session whose episode has ended), so an unmodified client
(the `openai` SDK) raises its own typed error with our message.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse


class OpenAIError(Exception):
    """A request the server refuses, answered as an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_param(param: str, message: str) -> OpenAIError:
    """400 naming the parameter."""
    return OpenAIError(400, f"`{param}`: {message}", param=param)


def unsupported(params: list[str], supported: set[str]) -> OpenAIError:
    """400 naming the parameters this endpoint does not support."""
    names = ", ".join(f"`{p}`" for p in params)
    return OpenAIError(400, f"unsupported parameter(s) {names}; this endpoint supports "
                            f"{', '.join(sorted(supported))}", param=params[0],
                       code="unsupported_parameter")


def context_exceeded(prompt_tokens: int, context: int) -> OpenAIError:
    return OpenAIError(400, f"this model's context is {context} tokens; the prompt has "
                            f"{prompt_tokens} tokens and leaves no room for a completion",
                       param="messages", code="context_length_exceeded")


def check_params(body: dict, supported: set[str]) -> None:
    """Refuse a body with keys outside `supported` (one message naming them all)."""
    extra = sorted(k for k in body if k not in supported)
    if extra:
        raise unsupported(extra, supported)


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    return body


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.payload(), status_code=exc.status)


def make_app(routes: list) -> Starlette:
    """A Starlette app whose `OpenAIError`s become OpenAI-style JSON errors."""
    return Starlette(routes=routes, exception_handlers={OpenAIError: _openai_error})


class ServerThread:
    """`app` served by uvicorn on host:port (0: a free port) in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._run, name="reroll-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
