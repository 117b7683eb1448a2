"""Tools from a real MCP server over stdio (the `mcp` package's own server class): its tools'
schemas come from the server, calls reach it from the agent loop's event loops (one per step),
and a call the server fails is an error result, not an exception."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from reroll.tools import ToolCall
from reroll.tools.execute import run_calls

pytestmark = pytest.mark.unit
pytest.importorskip("mcp.server.mcpserver")

SERVER = textwrap.dedent('''
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("arith")

    @app.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @app.tool()
    def fail(x: str) -> str:
        """Always fails."""
        raise ValueError("no " + x)

    if __name__ == "__main__":
        app.run()
''')


def test_mcp_server_tools_run_across_event_loops(tmp_path):
    from reroll.tools.mcp import MCPTools

    server = tmp_path / "server.py"
    server.write_text(SERVER)
    mcp = MCPTools([sys.executable, str(server)])
    try:
        assert [t.name for t in mcp.tools] == ["add", "fail"]
        add = mcp.tools[0].schema["function"]
        assert add["description"] == "Add two integers."
        assert add["parameters"]["required"] == ["a", "b"]
        assert add["parameters"]["properties"]["a"]["type"] == "integer"
        for step in range(2):  # each step of a run has its own event loop
            results = asyncio.run(run_calls(
                [ToolCall("c0", "add", {"a": 2, "b": 40 + step}),
                 ToolCall("c1", "fail", {"x": "way"}), ToolCall("c2", "add", {"a": 1, "b": 1})],
                mcp.tools, 30.0))
            assert [r.content for r in (results[0], results[2])] == [str(42 + step), "2"]
            assert results[1].error and "raised MCPToolError" in results[1].content
    finally:
        mcp.close()
    mcp.close()


def test_a_server_that_does_not_start_is_one_clear_error(tmp_path):
    from reroll.tools.mcp import MCPTools

    with pytest.raises(RuntimeError, match="did not start"):
        MCPTools([sys.executable, "-c", "import sys; sys.exit(3)"], start_timeout_s=30)
