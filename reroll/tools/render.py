"""Conversations with tools, rendered by the chat template.

    render_messages(tokenizer, messages, tools=None, parser="hermes") -> str

Messages are OpenAI-style: `system`, `user`, `assistant` (with optional `tool_calls`:
`[{id, type: function, function: {name, arguments}}]`, arguments a dict or a JSON string) and
`tool` (`{role: tool, tool_call_id, content}`) messages.

A template that renders `tools` itself (Qwen2.5/Qwen3's, Llama 3.1's, the Qwen3-style template
of `reroll.models.qwen_tokenizer`) gets them through `apply_chat_template(tools=...)`, with the
assistants' `tool_calls` arguments as dicts. A template that ignores `tools` (SmolLM2's, plain
ChatML) gets the fallback, in the Hermes/Qwen2.5 style:

- the tools block (`tools_block`) is appended to the system message (one is added if there is
  none): a `# Tools` heading, the schemas as JSON lines inside `<tools></tools>`, and how to
  call one in the parser's format;
- an assistant message's `tool_calls` are written after its content in the parser's format
  (`reroll.tools.parsers.render_calls`), so the text is what the model is asked to write;
- consecutive `tool` messages become one user message, each result inside
  `<tool_response>...</tool_response>` on its own lines.
"""

from __future__ import annotations

import json
from typing import Any

from reroll.tools.parsers import calls_of_message, render_calls
from reroll.tools.schema import tool_schema

TOOLS_INTRO = ("# Tools\n\nYou can call the functions below to help with the request.\n\n"
               "Their JSON schemas, one per line, are inside <tools></tools>:\n<tools>")
"""The tools block's opening (shared with the Qwen3-style template's own rendering)."""
HOW_TO_CALL = {
    "hermes": ("</tools>\n\nTo call a function, write a JSON object with its name and arguments "
               "inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\n</tool_call>"),
    "llama3_json": ("</tools>\n\nTo call a function, reply with only a JSON object {\"name\": "
                    "<function-name>, \"parameters\": <args-json-object>}; separate several "
                    "calls with `; `."),
}
"""The tools block's closing per parser: how to write a call the parser reads."""


def tools_block(schemas: list[dict[str, Any]], parser: str = "hermes") -> str:
    """The fallback system text presenting `schemas` (OpenAI function schemas)."""
    lines = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
    return f"{TOOLS_INTRO}{lines}\n{HOW_TO_CALL[parser]}"


_PROBE = {"type": "function", "function": {"name": "reroll_probe_tool", "description": "",
                                          "parameters": {"type": "object", "properties": {}}}}


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools=` itself (probed: does a tool's name appear)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on `tools` does not support them
        return False
    return "reroll_probe_tool" in text


def render_messages(tokenizer, messages: list[dict[str, Any]], tools: list | None = None,
                    parser: str = "hermes", add_generation_prompt: bool = True,
                    native: bool | None = None) -> str:
    """The conversation as the template's text (see the module doc). `tools`: schemas,
    callables or Tools; `native`: whether the template renders tools (None: probe it)."""
    schemas = [tool_schema(t) for t in tools or []]
    uses_tools = bool(schemas) or any(m.get("role") == "tool" or m.get("tool_calls")
                                      for m in messages)
    if not uses_tools:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    if native is None:
        native = supports_tools(tokenizer)
    if native:
        return tokenizer.apply_chat_template(
            [_dict_arguments(m) for m in messages], tools=schemas or None, tokenize=False,
            add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(fallback_messages(messages, schemas, parser),
                                         tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}}
             for c in calls_of_message(message)]
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


def fallback_messages(messages: list[dict[str, Any]], schemas: list[dict[str, Any]],
                      parser: str = "hermes") -> list[dict[str, str]]:
    """Plain `{role, content}` messages (system, user, assistant only) carrying the tools."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = render_calls(calls_of_message(m), parser)
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content
                        else calls})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool": True})
        else:
            out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if schemas:
        block = tools_block(schemas, parser)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
