"""Tools for agents (DESIGN.md §2: a layer beside `envs` and `rewards`; the agent loop and the
OpenAI-compatible gateway both use it).

- `schema`: `Tool`, `tool_schema(fn_or_dict)` (a callable's type hints and docstring -> an
  OpenAI function schema), `as_tools`.
- `parsers`: `parse_tool_calls(text, parser) -> ParsedCalls(content, calls, errors)` for the
  `hermes` and `llama3_json` formats; `render_calls` writes calls back in a format.
- `render`: `render_messages(tokenizer, messages, tools, parser)`: the chat template's own
  `tools=` rendering where it has one, else a documented Hermes-style system block.
- `execute`: `run_calls(calls, tools, timeout_s)`: concurrent calls with time limits, every
  failure an error result (never raised); `python_tool()`: code run in the Sandbox.
- `mcp`: `MCPTools(command)`: the tools of an MCP stdio server (the optional `mcp` package).
"""

from reroll.tools.parsers import PARSERS, ParsedCalls, ToolCall, parse_tool_calls, render_calls
from reroll.tools.render import render_messages, supports_tools, tools_block
from reroll.tools.schema import Tool, as_tool, as_tools, tool_schema

__all__ = ["PARSERS", "ParsedCalls", "Tool", "ToolCall", "as_tool", "as_tools",
           "parse_tool_calls", "render_calls", "render_messages", "supports_tools",
           "tool_schema", "tools_block"]
