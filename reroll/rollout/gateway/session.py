"""An episode's session: every call the agent made, token for token.

A session is opened for each episode and reached through its own base URL
(`http://HOST:PORT/s/<id>/v1`) or its API key alone (`sk-reroll-<id>` on `http://HOST:PORT/v1`),
so an unmodified client needs nothing but those two settings. Each call records the exact
prompt ids the engine consumed, the ids it generated with their logprobs, and the call it
extends (its parent) when its prompt was spliced onto that call's tokens. When the episode
ends the session is closed: a later call gets 409 (its tokens could no longer be trained on).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

KEY_PREFIX = "sk-reroll-"


@dataclass
class Call:
    """One engine call of a session."""

    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    parent: int | None = None
    """The call whose prompt and completion this prompt extends token for token (None: a
    fresh rendering: the first call, or history rewritten)."""
    messages: list[dict] | None = None
    """Chat calls: the conversation as the client sent it."""
    tools: list[dict] | None = None
    reply: dict | None = None
    """Chat calls: the assistant message returned (content, tool calls)."""
    stop_text: str | None = None
    """The decoded stop token the completion ended with (None: cut at a length limit)."""
    engine_s: float = 0.0
    """Seconds the engine took (the rest of a call's latency is the gateway's and HTTP's)."""
    retokenized_equal: bool | None = None
    """Whether rendering and encoding the whole conversation afresh gives the spliced prompt
    (None: not spliced, nothing to compare)."""
    token_versions: list[int] = field(default_factory=list)
    """The policy version that sampled each completion token (an async run's call can be
    resumed under new weights at a weight update, so its tokens' versions may differ)."""
    routed_experts: Any = None
    """The engine's routing record of the prompt and completion (`Completion.routed_experts`,
    a mixture-of-experts model's, for routing replay; None: none recorded)."""


@dataclass
class Session:
    id: str
    task: Any = None
    seed: int = 0
    calls: list[Call] = field(default_factory=list)
    reward: float | None = None
    """Posted by the harness to `<base_url>/reward` (`{"reward": x}`), if it did."""
    ended: bool = False
    errors: dict[str, int] = field(default_factory=dict)
    """Calls refused, by reason (`unsupported_parameter`, `context_length_exceeded`, ...)."""
    tool_parse_errors: int = 0
    engine: Any = None
    """The engine this session's calls run on (None: the gateway's). An async run's episode
    runs its calls through the producer's scheduler (`reroll.rollout.async_agents`)."""
    params: Any = None
    """The session's sampling settings (`SamplingParams`; None: the gateway's `params`)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, reason: str) -> None:
        with self.lock:
            self.errors[reason] = self.errors.get(reason, 0) + 1


class Sessions:
    """The gateway's sessions by id; ended ones stay known (so a late call is a 409, not a
    401) until `forget`."""

    def __init__(self) -> None:
        self._open: dict[str, Session] = {}
        self._ended: set[str] = set()
        self._lock = threading.Lock()
        self.late_calls = 0
        """Calls to sessions whose episode had ended."""

    def open(self, task: Any, seed: int) -> Session:
        session = Session(secrets.token_hex(12), task, seed)
        with self._lock:
            self._open[session.id] = session
        return session

    def end(self, session: Session) -> None:
        with self._lock:
            session.ended = True
            self._open.pop(session.id, None)
            self._ended.add(session.id)

    def get(self, session_id: str) -> Session | None | bool:
        """The open session; False when it ended; None when unknown."""
        with self._lock:
            if session_id in self._open:
                return self._open[session_id]
            if session_id in self._ended:
                self.late_calls += 1
                return False
            return None

    def forget_ended(self) -> None:
        with self._lock:
            self._ended.clear()


def api_key(session: Session) -> str:
    return KEY_PREFIX + session.id


def session_of_key(authorization: str | None) -> str | None:
    """The session id in an `Authorization: Bearer sk-reroll-<id>` header."""
    if not authorization:
        return None
    token = authorization.removeprefix("Bearer ").strip()
    return token[len(KEY_PREFIX):] if token.startswith(KEY_PREFIX) else None
