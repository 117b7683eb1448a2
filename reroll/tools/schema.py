"""Tools: a name, an OpenAI function schema, and the function that runs a call.

    tool_schema(fn_or_dict) -> {"type": "function", "function": {name, description, parameters}}

A plain Python callable becomes a schema from its signature and docstring: the first paragraph
of the docstring is the description; each parameter's type hint gives its JSON type (str,
int, float, bool, list[...], dict, Literal[...], Optional/`X | None`); a parameter without a
default is required; a Google-style `Args:` section gives the parameters' descriptions. A dict
is taken as a schema: either the OpenAI form above or its inner `function` object.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
               dict: "object", list: "array", tuple: "array"}


@dataclass
class Tool:
    """One tool an environment offers: its schema and the function that runs a call.

    `fn(**arguments)` may be sync (run in a thread) or async; what it returns is the tool's
    result (a string, or anything JSON-serialisable). `timeout_s` overrides the run's per-call
    limit (`env.tool_timeout_s`) for this tool."""

    schema: dict[str, Any]
    fn: Callable[..., Any] | None = None
    timeout_s: float | None = None

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def tool_schema(fn_or_dict: Callable[..., Any] | dict[str, Any] | Tool) -> dict[str, Any]:
    """The OpenAI function schema of a callable, a schema dict or a Tool (see module doc)."""
    if isinstance(fn_or_dict, Tool):
        return fn_or_dict.schema
    if isinstance(fn_or_dict, dict):
        return _checked_schema(fn_or_dict)
    if not callable(fn_or_dict):
        raise TypeError(f"a tool is a callable, a schema dict or a Tool, not "
                        f"{type(fn_or_dict).__name__}")
    return _schema_of_callable(fn_or_dict)


def as_tool(item: Callable[..., Any] | dict[str, Any] | Tool) -> Tool:
    """A Tool from a callable (schema from its hints), a Tool, or a schema dict (a tool the
    model may call but that has no function here: its calls get an error result)."""
    if isinstance(item, Tool):
        return Tool(_checked_schema(item.schema), item.fn, item.timeout_s)
    if isinstance(item, dict):
        return Tool(_checked_schema(item))
    return Tool(tool_schema(item), item)


def as_tools(items: Any) -> list[Tool]:
    """The tools of an environment's `tools` attribute (None or a list); names must be unique."""
    tools = [as_tool(item) for item in (items or [])]
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tool names must be unique, found several {dup}")
    return tools


def _checked_schema(schema: dict[str, Any]) -> dict[str, Any]:
    function = schema.get("function", schema) if schema.get("type", "function") == "function" \
        else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise ValueError(f"a tool schema needs a function `name` (OpenAI form "
                         f"{{type: function, function: {{name, description, parameters}}}}), "
                         f"got {schema!r}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ValueError(f"tool {function['name']!r}: `parameters` must be a JSON schema object")
    return {"type": "function", "function": {
        "name": function["name"], "description": function.get("description", ""),
        "parameters": parameters}}


def _schema_of_callable(fn: Callable[..., Any]) -> dict[str, Any]:
    base = fn.func if isinstance(fn, functools.partial) else fn  # a partial: its function's
    name = getattr(base, "__name__", None) or type(fn).__name__
    doc = inspect.getdoc(base) or ""
    described = _arg_docs(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable hints: fall back to the raw annotations
        hints = {}
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == "self":
            continue
        prop = _json_type(hints.get(param.name, param.annotation))
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}


def _json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint ({} for none or an unknown one: any value)."""
    if hint is inspect.Parameter.empty or hint is Any:
        return {}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        kinds = {_JSON_TYPES.get(type(a), "string") for a in args}
        out = {"enum": list(args)}
        return out | ({"type": kinds.pop()} if len(kinds) == 1 else {})
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {
            "anyOf": [_json_type(a) for a in options]}
    if origin in (list, tuple, set) or hint in (list, tuple, set):
        out = {"type": "array"}
        return out | ({"items": _json_type(args[0])} if args and args[0] is not Ellipsis else {})
    if origin is dict or hint is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` section (a line `name: text` at the
    section's indent starts one; deeper-indented lines continue it)."""
    match = re.search(r"^(?:Args|Arguments|Parameters):[ \t]*\n((?:[ \t]+\S.*\n?)+)", doc, re.M)
    if not match:
        return {}
    lines = match.group(1).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    out: dict[str, str] = {}
    current = None
    for line in lines:
        item = re.match(r"(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line.strip())
        if item and len(line) - len(line.lstrip()) == indent:
            current = item.group(1)
            out[current] = item.group(2).strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out
