"""SFT on multi-turn conversations: every assistant turn trained, everything else masked.

A `messages` row with several assistant turns (tool calls and `tool` results included, the
row's `tools` rendered as the agent loop renders them: `reroll.tools.render`) becomes one
sequence built as the agent loop builds an episode: the template's text up to each assistant
turn is one piece (mask 0), the turn's text up to the template's stop token plus the stop token
is the next (mask 1), each piece tokenised on its own, so the trained tokens are the ones the
engine later generates turn by turn and the rest is what it is shown between turns. A template
that renders earlier turns differently once a turn is added (Qwen3's drops the `<think>` block
of turns before a later user message) cannot give one such sequence: the row is refused,
naming it.
"""

from __future__ import annotations

from typing import Any

from reroll.config.errors import ConfigError
from reroll.data.batch import Trajectory
from reroll.tools.render import render_messages, supports_tools


def is_tool_conversation(messages: list[dict[str, Any]], tools: Any = None) -> bool:
    """Whether a row is a tool conversation: tool calls, tool results or tools."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def is_multi_turn(messages: list[dict[str, Any]], tools: Any = None) -> bool:
    """Whether a row needs `multi_turn_example`: several assistant turns, tool calls, tool
    results or tools (a row with one final assistant message is trained as a prompt and one
    response, as before)."""
    assistants = sum(m.get("role") == "assistant" for m in messages)
    return bool(tools) or assistants > 1 or any(
        m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def turn_pieces(tokenizer, messages: list[dict[str, Any]], tools: list | None = None,
                parser: str = "hermes", source: str = "") -> list[tuple[str, bool]]:
    """The conversation's text as (piece, trained) pairs up to its last assistant turn: the
    template's text before each assistant turn (not trained), then the turn up to and including
    the tokenizer's stop token (trained). What follows the stop token in the template (`\\n`)
    opens the next untrained piece."""
    native = supports_tools(tokenizer) if tools or is_multi_turn(messages) else None

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        return render_messages(tokenizer, msgs, tools, parser, generation_prompt, native)

    stop = tokenizer.eos_token or ""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        context, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not context.startswith(done) or not full.startswith(context):
            raise ConfigError(
                f"{source}: the chat template renders this conversation's earlier turns "
                f"differently once turn {len(pieces) // 2 + 1} is added (it rewrites history, "
                f"e.g. drops <think> blocks as Qwen3's does), so its assistant turns cannot be "
                f"trained as one sequence; remove the reasoning from earlier assistant turns or "
                f"split the row into one row per turn")
        turn = full[len(context):]
        cut = turn.find(stop) if stop else -1
        end = len(context) + (cut + len(stop) if cut >= 0 else len(turn))
        pieces += [(context[len(done):], False), (full[len(context):end], True)]
        done = full[:end]
    return pieces


def multi_turn_example(tokenizer, messages: list[dict[str, Any]], tools: list | None,
                       max_tokens: int, source: str = "", parser: str = "hermes") -> Trajectory:
    """An SFT sample training every assistant turn (see the module doc): the prompt is the
    text before the first assistant turn; `policy_mask` marks the assistant turns' tokens."""
    if messages[-1].get("role") != "assistant":
        raise ConfigError(f"{source}: a multi-turn SFT row must end with an assistant message")
    try:
        pieces = turn_pieces(tokenizer, messages, tools, parser, source)
    except ValueError as e:  # a malformed tool schema
        raise ConfigError(f"{source}: {e}") from None
    stop = tokenizer.eos_token
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        if trained and stop and text.endswith(stop):  # the stop token as the engine emits it
            piece = _encode(tokenizer, text[: -len(stop)]) + [tokenizer.eos_token_id]
        else:
            piece = _encode(tokenizer, text)
        ids += piece
        mask += [int(trained)] * len(piece)
    prompt = len(_encode(tokenizer, pieces[0][0]))
    if len(ids) > max_tokens:
        raise ConfigError(f"{source}: {len(ids)} tokens, over data.max_tokens={max_tokens}")
    response = ids[prompt:]
    return Trajectory(ids[:prompt], response, [0.0] * len(response), "stop", group_id=0,
                      policy_mask=mask[prompt:])


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
