"""The one place reroll reads or sets process environment variables (DESIGN.md §5.8).

Reads: secrets named by config (an API key's variable). Writes: variables that libraries read at
start-up (torch.distributed's rendezvous, Ray's log de-duplication, vLLM's CPU KV-cache size);
`defaults` never overrides what the user already exported. The sandbox launcher sets its child's
environment itself: it runs inside the sandbox, without reroll on its path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def read(name: str) -> str | None:
    """The value of environment variable `name`, or None when unset."""
    return os.environ.get(name)


def defaults(values: Mapping[str, str]) -> None:
    """Set each variable that is not set yet (a user's own setting wins)."""
    for key, value in values.items():
        os.environ.setdefault(key, value)


def export(values: Mapping[str, str]) -> None:
    """Set each variable, replacing any value (for per-process facts such as a worker's rank)."""
    os.environ.update(values)


ALLOW_HUB = "REROLL_ALLOW_HUB"


def allow_hub() -> bool:
    """Whether a `model.path` that is not a local folder may be fetched as a Hugging Face hub id
    (`REROLL_ALLOW_HUB=1`). Off by default: a mistyped local path is then an error at once, not
    a minute of download retries."""
    return (read(ALLOW_HUB) or "").strip().lower() in ("1", "true", "yes")
