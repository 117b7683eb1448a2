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

import uuid
from dataclasses import dataclass

from reroll.tools import parse_tool_calls, render_messages, supports_tools

PLACEHOLDER = "\x00reroll-reply\x00"


def normalise(messages: list[dict]) -> list[dict]:
    """Messages as the chat template expects them: OpenAI's content parts joined into text, a
    null content as empty text (tool-call arguments are handled by `reroll.tools.render`)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p.get("text", "") for p in m["content"]
                                   if isinstance(p, dict))
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


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
    """A tokenizer's chat template with tools (`reroll.tools.render`: the template's own
    `tools=` rendering, else the documented Hermes-style system block), and `parser` the
    tool-call format the model writes (`reroll.tools.parsers`)."""

    def __init__(self, tokenizer, parser: str = "hermes"):
        self.tokenizer, self.parser = tokenizer, parser
        self.native_tools = supports_tools(tokenizer)
        closed = self.render([{"role": "user", "content": "x"},
                              {"role": "assistant", "content": PLACEHOLDER}], None, False)
        self.turn_end = closed[closed.index(PLACEHOLDER) + len(PLACEHOLDER):]
        """The template's markup after an assistant message (e.g. `<|im_end|>\\n`)."""

    def render(self, messages: list[dict], tools: list[dict] | None,
               generation_prompt: bool) -> str:
        return render_messages(self.tokenizer, normalise(messages), tools, self.parser,
                               add_generation_prompt=generation_prompt,
                               native=self.native_tools)

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


@dataclass
class ParsedReply:
    content: str
    tool_calls: list[dict]
    errors: int
    """Tool calls that could not be read (counted; the text stays in `content`)."""


def parse_reply(text: str, tools: list[dict] | None, parser: str = "hermes") -> ParsedReply:
    """The model's tool calls (only when the request offered tools) as OpenAI `tool_calls`,
    with ids unique across the conversation; the rest of the text is the content."""
    if not tools:
        return ParsedReply(text, [], 0)
    parsed = parse_tool_calls(text, parser)
    calls = [call.openai() | {"id": f"call_{uuid.uuid4().hex[:24]}"} for call in parsed.calls]
    if parsed.errors and not calls:
        return ParsedReply(text, [], len(parsed.errors))
    return ParsedReply(parsed.content if calls else text, calls, len(parsed.errors))
