"""Tool-call parsers: the model's generated text -> its text content, tool calls and errors.

    parse_tool_calls(text, parser) -> ParsedCalls(content, calls, errors)

`parser` names the format the model was trained to write (config `env.tool_parser`):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the
  text (Hermes, Qwen2.5, Qwen3, and the fallback system block of `reroll.tools.render`). A block
  left open at the end of the text (the model stopped before `</tool_call>`) is parsed too.
- `llama3_json`: Llama 3.1/3.2's JSON form: the whole reply is `{"name": ..., "parameters":
  {...}}` (or `"arguments"`), optionally after `<|python_tag|>`, several calls separated by `;`.
  A reply that does not start with `{` is plain content.

A call that cannot be read (invalid JSON, no `name`, arguments that are not an object) is not
raised: it is an entry of `errors`, which the agent loop returns to the model as an error
message and counts (`env/tool_parse_errors`). Whether a call names a known tool is checked when
it runs (`reroll.tools.execute`), not here. `render_call` writes a call back in the same format
(the fallback chat rendering of an assistant's `tool_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    id: str
    """`call_<k>`, k counting the calls of one reply from 0 (tool messages answer it)."""
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments as a JSON string, as the API sends them)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class ParsedCalls:
    content: str
    """The text without its tool calls, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call(obj: Any, index: int, keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or why not."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"a tool call needs a string `name`, got {json.dumps(obj)[:200]}"
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the arguments of tool call {name!r} are not valid JSON: {arguments[:200]!r}"
    if not isinstance(arguments, dict):
        return f"the arguments of tool call {name!r} must be a JSON object, got {arguments!r:.200}"
    return ToolCall(f"call_{index}", name, arguments)


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON in a tool call ({e.msg} at column {e.colno}): "
                         f"{text[:200]!r}") from None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def parse_hermes(text: str) -> ParsedCalls:
    calls, errors = [], []
    for match in _HERMES.finditer(text):
        try:
            made = _call(_decode(match.group(1).strip()), len(calls), ("arguments", "parameters"))
        except ValueError as e:
            made = str(e)
        (calls if isinstance(made, ToolCall) else errors).append(made)
    return ParsedCalls(_HERMES.sub("", text).strip(), calls, errors)


def parse_llama3_json(text: str) -> ParsedCalls:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedCalls(text.strip())
    decoder, calls, errors, at = json.JSONDecoder(), [], [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            errors.append(f"invalid JSON in a tool call ({e.msg} at column {e.colno}): "
                          f"{body[at:at + 200]!r}")
            break
        if isinstance(obj, dict) and "name" not in obj and not calls and not errors:
            return ParsedCalls(text.strip())  # a JSON reply, not a call
        made = _call(obj, len(calls), ("parameters", "arguments"))
        (calls if isinstance(made, ToolCall) else errors).append(made)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return ParsedCalls("", calls, errors)


def render_hermes(call: ToolCall) -> str:
    return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) \
        + "\n</tool_call>"


def render_llama3_json(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "parameters": call.arguments})


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
"""Parser name -> parse function; the names `env.tool_parser` accepts."""
RENDERERS = {"hermes": render_hermes, "llama3_json": render_llama3_json}
_SEPARATORS = {"hermes": "\n", "llama3_json": "; "}


def parse_tool_calls(text: str, parser: str = "hermes") -> ParsedCalls:
    """The content, calls and errors of a generated `text` in the named format."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r} (choose from {sorted(PARSERS)})")
    return PARSERS[parser](text)


def render_calls(calls: list[ToolCall], parser: str = "hermes") -> str:
    """Calls written in the parser's format, so that `parse_tool_calls` reads them back."""
    return _SEPARATORS[parser].join(RENDERERS[parser](c) for c in calls)


def calls_of_message(message: dict[str, Any]) -> list[ToolCall]:
    """The ToolCalls of an assistant message's OpenAI `tool_calls` (arguments as a dict or a
    JSON string; a malformed string becomes `{}`)."""
    out = []
    for k, entry in enumerate(message.get("tool_calls") or []):
        function = entry.get("function", entry)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                arguments = {}
        out.append(ToolCall(entry.get("id", f"call_{k}"), function["name"],
                            arguments if isinstance(arguments, dict) else {}))
    return out
