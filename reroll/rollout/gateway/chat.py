"""Chat messages to prompt tokens and generated tokens back to an assistant message.

Token faithfulness starts here. A client resends the whole conversation on every call; the
gateway does not re-encode the part the engine already saw. When the call's messages are an
earlier call's messages plus the reply the gateway gave it (then tool results, a user turn),
the prompt is that call's prompt and completion tokens *exactly*, followed by the template's
tokens for the new messages only (`Splice`). The whole conversation is also rendered and
encoded afresh, and a difference from the spliced tokens is counted
(`gateway/retokenize_mismatch`): re-encoding generated text rarely gives the same ids, and the
engine must see the ids it produced. When the template rewrites history (Qwen3's drops earlier
reasoning once a new user turn comes) or the client edited it, the rendering no longer extends
the earlier one and the call starts a new chain of the episode (`assembly.py`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PLACEHOLDER = "\x00reroll-reply\x00"

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def normalise(messages: list[dict]) -> list[dict]:
    """Messages as the chat template expects them: OpenAI's content parts joined into text, and
    a tool call's `arguments` (a JSON string in the API) as a dict (what HF templates render)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p.get("text", "") for p in m["content"]
                                   if isinstance(p, dict))
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # rendered as the client sent it
    return {"type": "function", "function": function} | (
        {"id": call["id"]} if "id" in call else {})


def same_reply(sent: dict, reply: dict) -> bool:
    """Whether the client's copy of an assistant message is the reply the gateway gave (its
    text, and its tool calls by name and arguments; ids and formatting may differ)."""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (reply.get("content") or ""):
        return False
    calls = [c["function"] for c in sent.get("tool_calls") or []]
    mine = [c["function"] for c in reply.get("tool_calls") or []]
    return [(c.get("name"), c.get("arguments")) for c in calls] == \
        [(c.get("name"), c.get("arguments")) for c in mine]


class ChatRenderer:
    """A tokenizer's chat template, with `tools` rendered where the template supports them
    and else as a Hermes-style system block."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.native_tools = "tools" in template
        closed = self.render([{"role": "user", "content": "x"},
                              {"role": "assistant", "content": PLACEHOLDER}], None, False)
        self.turn_end = closed[closed.index(PLACEHOLDER) + len(PLACEHOLDER):]
        """The template's markup after an assistant message (e.g. `<|im_end|>\\n`)."""

    def render(self, messages: list[dict], tools: list[dict] | None,
               generation_prompt: bool) -> str:
        messages = normalise(messages)
        kwargs: dict[str, Any] = {}
        if tools and self.native_tools:
            kwargs["tools"] = tools
        elif tools:
            messages = tools_system_block(messages, tools)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def continuation(self, history: list[dict], reply_stop: str | None, new: list[dict],
                     tools: list[dict] | None) -> list[int] | None:
        """The tokens after an earlier call's prompt and completion that present `new` (the
        messages after that call's reply), or None when the template's rendering of the longer
        conversation does not extend the shorter one (history rewritten). `history` ends with
        the reply; `reply_stop` is the decoded stop token the completion ended with (None: cut
        at a length limit, so the template's whole turn end is added)."""
        before = self.render(history, tools, False)
        after = self.render(history + new, tools, True)
        if not after.startswith(before) or not before.endswith(self.turn_end):
            return None
        closing = self.turn_end
        if reply_stop and closing.startswith(reply_stop):
            closing = closing[len(reply_stop):]
        return self.encode(closing + after[len(before):])


def tools_system_block(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Tools for a template without tool support: listed in the system message, with the
    `<tool_call>{json}</tool_call>` convention (Hermes/Qwen2.5 style)."""
    listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    block = ("# Tools\n\nYou may call one or more functions. The functions:\n<tools>\n"
             f"{listing}\n</tools>\n\nFor each call, reply with <tool_call>\n"
             '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}] + messages[1:]
    return [{"role": "system", "content": block}] + messages


@dataclass
class ParsedReply:
    content: str
    tool_calls: list[dict]
    errors: int
    """Tool-call blocks that did not parse (left in `content`, counted)."""


def parse_reply(text: str, tools: list[dict] | None) -> ParsedReply:
    """`<tool_call>{"name", "arguments"}</tool_call>` blocks become OpenAI tool calls (only
    when the request offered tools); the rest of the text is the content."""
    if not tools or "<tool_call>" not in text:
        return ParsedReply(text, [], 0)
    calls, errors, kept = [], 0, []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            data = json.loads(match.group(1))
            name, arguments = data["name"], data.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name")
        except (ValueError, KeyError, TypeError):
            errors += 1
            continue  # left in the content for the client to see
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments)
                                   if not isinstance(arguments, str) else arguments}})
    kept.append(text[position:])
    return ParsedReply("".join(kept).strip() if calls else text, calls, errors)
