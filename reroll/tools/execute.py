"""Running tool calls: concurrently, each with a time limit, every failure an error result.

    results = await run_calls(calls, tools, timeout_s)   # one ToolResult per call, in order

A call naming an unknown tool, arguments the function does not take, a function that raises
or runs past its limit: each gives a result whose `content` says so (`error: ...`), with
`error=True` (the agent loop counts these as `env/tool_errors` and returns them to the model).
Nothing is raised. Sync functions run in daemon threads, so a hung one is abandoned when its
limit passes and never holds up the episode or the process's exit (code that must be stopped
for real belongs in the Sandbox: `python_tool`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any

from reroll.sandbox import Limits, Sandbox
from reroll.tools.parsers import ToolCall
from reroll.tools.schema import Tool


@dataclass
class ToolResult:
    call: ToolCall
    content: str
    error: bool = False

    def message(self) -> dict[str, str]:
        """The `tool` message returning this result to the model."""
        return {"role": "tool", "tool_call_id": self.call.id, "name": self.call.name,
                "content": self.content}


async def run_calls(calls: list[ToolCall], tools: list[Tool], timeout_s: float
                    ) -> list[ToolResult]:
    """Every call at once; each under its tool's `timeout_s` or this one."""
    by_name = {t.name: t for t in tools}
    return list(await asyncio.gather(*(run_call(c, by_name, timeout_s) for c in calls)))


async def run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    tool = tools.get(call.name)
    if tool is None or tool.fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(call, f"error: unknown tool {call.name!r} (tools: {known})", True)
    limit = tool.timeout_s or timeout_s
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return ToolResult(call, f"error: bad arguments for {call.name}: {e}", True)
    try:
        if inspect.iscoroutinefunction(tool.fn):
            value = await asyncio.wait_for(tool.fn(**call.arguments), limit)
        else:
            value = await asyncio.wait_for(_in_thread(tool.fn, call.arguments), limit)
    except TimeoutError:
        return ToolResult(call, f"error: {call.name} took longer than {limit}s", True)
    except Exception as e:  # noqa: BLE001 - a tool's bug is the model's error message
        return ToolResult(call, f"error: {call.name} raised {type(e).__name__}: {e}", True)
    return ToolResult(call, value if isinstance(value, str) else _json(value))


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _in_thread(fn, arguments: dict[str, Any]) -> asyncio.Future:
    """`fn(**arguments)` in a daemon thread, as a future of this event loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            value, ok = fn(**arguments), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed meanwhile (the call was abandoned)
            pass

    name = getattr(fn, "__name__", "call")  # a functools.partial has none
    threading.Thread(target=work, daemon=True, name=f"tool-{name}").start()
    return future


PYTHON_LIMITS = Limits(wall_time_s=5.0, cpu_time_s=5.0, output_bytes=64 << 10)


def python_tool(sandbox: Sandbox | None = None, limits: Limits = PYTHON_LIMITS,
                max_output_chars: int = 400) -> Tool:
    """A `python` tool: the code runs in the Sandbox (no network, its own filesystem, CPU,
    memory and wall-clock limits); the result is its stdout and the end of its stderr."""
    box: list[Sandbox] = [sandbox] if sandbox is not None else []

    async def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: the program; print the values you need.
        """
        if not box:
            box.append(Sandbox())
        result = await box[0].run(code, limits=limits)
        output = (result.stdout + result.stderr[-200:])[:max_output_chars].strip()
        return output + (" (timed out)" if result.timed_out else "")

    from reroll.tools.schema import tool_schema

    return Tool(tool_schema(python), python, timeout_s=limits.wall_time_s + 5.0)
