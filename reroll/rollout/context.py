"""Context management of the built-in agent loop (`env.context`): what an episode does when its
history outgrows `max_context_tokens`.

`end` ends the episode (finish reason `length`). The other policies edit the conversation the
model sees next: `drop_oldest` drops the oldest exchanges (a model turn and the observation or
tool results answering it), keeping the system prompt, the first user message (the task) and
the latest exchange; `truncate` cuts every observation after the first to its first N tokens;
`hook` hands a copy of the conversation to the user's `function(messages) -> messages`.

An edit is not append-only: the next request is the chat template's rendering of the edited
conversation, a new token chain (`reroll.rollout.gateway.assembly.chains`). The agent loop
trains the episode's last chain, token for token as the engine saw it, and counts the earlier
ones (`env/chains_dropped`); see `agent_loop.py`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reroll.config.errors import ConfigError
from reroll.rewards.custom import resolve

POLICIES = ("end", "drop_oldest", "truncate", "hook")

Messages = list[dict[str, Any]]


class HookError(Exception):
    """The user's hook raised or returned something other than a conversation."""


@dataclass
class ContextPolicy:
    """What `env.context` chose, ready for the loop."""

    name: str = "end"
    target_fraction: float = 0.5
    """`drop_oldest`: drop until the history plus one reply fits in this fraction."""
    observation_tokens: int = 128
    """`truncate`: most tokens each observation keeps."""
    hook: Callable[[Messages], Messages] | None = None
    """`hook`: the user's function (resolved and checked at start)."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"context policy must be one of {POLICIES}, not {self.name!r}")
        if self.name == "hook" and self.hook is None:
            raise ValueError("the hook policy needs its function")

    @property
    def edits(self) -> bool:
        return self.name != "end"

    def edit(self, messages: Messages, length: Callable[[Messages], int], tokenizer,
             budget: int) -> Messages:
        """The conversation the model sees next. `length(messages)` counts its rendered
        tokens; `budget` is how many the history plus one reply should take (`drop_oldest`).
        May return `messages` unchanged (nothing left to drop or cut)."""
        if self.name == "drop_oldest":
            return drop_oldest(messages, length, budget)
        if self.name == "truncate":
            return truncate(messages, tokenizer, self.observation_tokens)
        return call_hook(self.hook, messages)


def from_config(section: Any) -> ContextPolicy:
    """The policy of an `env.context` section; a hook that does not import or cannot take one
    conversation is a ConfigError naming `env.context.function` (checked at start)."""
    if section is None or section.policy == "end":
        return ContextPolicy()
    if section.policy != "hook":
        return ContextPolicy(section.policy, **section.model_dump(exclude={"policy"}))
    hook = resolve(section.function, "env.context.function")
    try:
        inspect.signature(hook).bind([])
    except TypeError as e:
        raise ConfigError(f"env.context.function {section.function!r} does not fit "
                          f"function(messages) -> messages: {e}") from None
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
    return ContextPolicy("hook", hook=hook)


def _head(messages: Messages) -> int:
    """How many messages never go: up to and including the first user message."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i + 1
    return len(messages)


def _exchanges(messages: Messages, head: int) -> list[Messages]:
    """The messages after the head, each group starting at a model turn."""
    groups: list[Messages] = []
    for m in messages[head:]:
        if m.get("role") == "assistant" or not groups:
            groups.append([])
        groups[-1].append(m)
    return groups


def drop_oldest(messages: Messages, length: Callable[[Messages], int], budget: int) -> Messages:
    """`messages` without its oldest exchanges, dropped one at a time until `length` of the
    rest fits `budget`, or only the latest exchange is left after the head."""
    head = _head(messages)
    exchanges = _exchanges(messages, head)
    kept = messages
    while len(exchanges) > 1:
        exchanges = exchanges[1:]
        kept = messages[:head] + [m for group in exchanges for m in group]
        if length(kept) <= budget:
            break
    return kept


def truncate(messages: Messages, tokenizer, limit: int) -> Messages:
    """Every observation after the head (user and tool messages) cut to its first `limit`
    tokens; the head and the model's turns as they are."""
    head = _head(messages)
    out = list(messages[:head])
    for m in messages[head:]:
        if m.get("role") != "assistant" and isinstance(m.get("content"), str):
            m = m | {"content": cut(m["content"], tokenizer, limit)}
        out.append(m)
    return out


def cut(text: str, tokenizer, limit: int) -> str:
    """`text`'s first `limit` tokens, as text that encodes to at most `limit` tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= limit:
        return text
    n = limit
    while n > 0:  # decoding may merge into more tokens on re-encoding: shorten until it fits
        short = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if len(tokenizer.encode(short, add_special_tokens=False)) <= limit:
            return short
        n -= 1
    return ""


def call_hook(hook: Callable[[Messages], Messages], messages: Messages) -> Messages:
    """The hook's conversation, checked; a HookError naming what was wrong otherwise."""
    name = getattr(hook, "__qualname__", repr(hook))
    try:
        out = hook(copy.deepcopy(messages))
    except Exception as e:  # noqa: BLE001 - the user's code fails its episode only
        raise HookError(f"env.context.function {name} raised {type(e).__name__}: {e}") from None
    ok = isinstance(out, list) and out and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in out)
    if not ok:
        raise HookError(f"env.context.function {name} returned {type(out).__name__}: it must "
                        f"return a non-empty list of messages, each a dict with a `role` and a "
                        f"string `content`")
    return out
