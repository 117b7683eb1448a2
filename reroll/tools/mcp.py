"""Tools from an MCP server (the `mcp` package, stdio transport).

    server = MCPTools(["python", "my_server.py"])   # starts the server once, lists its tools
    env.tools = server.tools                         # Tools: schema from the server, fn calls it
    server.close()                                   # or at interpreter exit

The server runs as one subprocess for the life of the `MCPTools` object, its session on a
background thread with its own event loop, so it outlives the agent loop's event loop of each
step and serves the concurrent episodes of every step. Create it once (e.g. at module level of
your environment's file, or in a factory) and hand its `tools` to each env instance; starting
a server per episode would cost its start-up time every episode. A call the server reports as
an error (`is_error`) is raised as `MCPToolError`, which the agent loop returns to the model as
an error message (`env/tool_errors`) like any failing tool.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from concurrent.futures import Future
from typing import Any

from reroll.tools.schema import Tool


class MCPToolError(RuntimeError):
    """The MCP server answered a call with an error."""


class MCPTools:
    """A running MCP stdio server and its tools (see the module doc)."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None,
                 start_timeout_s: float = 60.0):
        if not command:
            raise ValueError("MCPTools needs the server's command, e.g. ['python', 'server.py']")
        self.command, self.env = list(command), env
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="mcp-client")
        self._thread.start()
        self._closing: asyncio.Event | None = None
        self._session: Any = None
        ready: Future = Future()
        self._task = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            listed = ready.result(start_timeout_s)
        except Exception as e:
            self.close()
            raise RuntimeError(f"MCP server {' '.join(command)!r} did not start: "
                               f"{type(e).__name__}: {e}") from e
        self.tools = [self._tool(t) for t in listed]
        atexit.register(self.close)

    async def _serve(self, ready: Future) -> None:
        """Owns the server's context for its whole life (anyio needs one task to enter and
        leave it): connect, list the tools, then wait until `close`."""
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        self._closing = asyncio.Event()
        params = StdioServerParameters(command=self.command[0], args=self.command[1:],
                                       env=self.env)
        try:
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                listed = (await session.list_tools()).tools
                self._session = session
                ready.set_result(listed)
                await self._closing.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            if not ready.done():
                ready.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def _tool(self, listed: Any) -> Tool:
        schema = getattr(listed, "input_schema", None) or getattr(listed, "inputSchema", None)
        parameters = {k: v for k, v in dict(schema or {}).items() if k != "title"}
        spec = {"type": "function", "function": {
            "name": listed.name, "description": listed.description or "",
            "parameters": parameters or {"type": "object", "properties": {}}}}

        async def call(**arguments: Any) -> str:
            future = asyncio.run_coroutine_threadsafe(
                self._session.call_tool(listed.name, arguments), self._loop)
            result = await asyncio.wrap_future(future)
            text = "\n".join(getattr(part, "text", str(part)) for part in result.content)
            if getattr(result, "is_error", False) or getattr(result, "isError", False):
                raise MCPToolError(text or "the server reported an error")
            return text

        call.__name__ = listed.name
        return Tool(spec, call)

    def close(self) -> None:
        """Stop the server and the background loop (idempotent)."""
        if self._loop.is_closed():
            return
        if self._closing is not None:
            self._loop.call_soon_threadsafe(self._closing.set)
            try:
                self._task.result(10)
            except Exception:  # noqa: BLE001 - closing: nothing left to report to
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()
