"""Reading the model's action out of its text."""

from __future__ import annotations

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
INT = re.compile(r"-?\d+")
CODE_BLOCK = re.compile(r"```(?:python|py|bash|sh)?\s*\n(.*?)```", re.DOTALL)


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, or None."""
    found = BOXED.findall(text)
    return found[-1].strip() if found else None


def integer(text: str) -> int | None:
    """The boxed integer if any, else the last integer in the text, else None."""
    inner = boxed(text)
    found = INT.findall(inner if inner is not None else text)
    return int(found[-1]) if found else None


def code_block(text: str) -> str | None:
    """The first fenced code block's body, or None."""
    match = CODE_BLOCK.search(text)
    return match.group(1) if match else None


def word(text: str, choices: tuple[str, ...]) -> str | None:
    """The last of `choices` that appears in the text as a word (case-insensitive)."""
    hits = re.findall(r"[a-z]+", text.lower())
    for token in reversed(hits):
        if token in choices:
            return token
    return None
