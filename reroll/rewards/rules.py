"""Rule rewards: verifiable instruction-following checks in the IFEval style, and a format reward.

Each check is a pure function `check(text, **args) -> bool` over the response's answer (the text
after `</think>` when the response thinks first). A prompt's checks come from its dataset row (the
`constraints` column by default: a list of `{"check": NAME, ARG: VALUE, ...}`) and from the
config's `reward.checks`, which apply to every prompt. The score is the share of checks passed
(`credit: fractional`) or 1.0 only when all pass (`all_or_nothing`); `format_weight` mixes in the
format reward: `<think>...</think>` followed by a non-empty answer.

Rows are checked when loaded (`check_rows`): an unknown check name or arguments the check does
not take is a ConfigError naming the dataset file and line, never a failure at step N.
"""

from __future__ import annotations

import inspect
import json
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from reroll.config.errors import ConfigError
from reroll.rewards.base import RewardResult, RewardSample

THINK = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.DOTALL)
WORD = re.compile(r"\b\w+\b", re.UNICODE)
SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S", re.MULTILINE)


def _within(count: int, min: int | None, max: int | None) -> bool:  # noqa: A002 - IFEval's names
    return (min is None or count >= min) and (max is None or count <= max)


def answer_part(response: str) -> str:
    """The answer of a response: the text after `</think>` when it opens with a think block,
    else the whole response."""
    match = THINK.match(response)
    return match.group(2) if match else response


def think_format(response: str) -> bool:
    """`<think>` reasoning `</think>` then a non-empty answer, and no second think block."""
    match = THINK.match(response)
    return bool(match and match.group(1).strip() and match.group(2).strip()
                and "<think>" not in match.group(2) and "</think>" not in match.group(2))


# -- the checks (pure functions of the answer text) --------------------------------------------


def word_count(text: str, min: int | None = None, max: int | None = None) -> bool:  # noqa: A002
    return _within(len(WORD.findall(text)), min, max)


def sentence_count(text: str, min: int | None = None, max: int | None = None) -> bool:  # noqa: A002
    """Sentences end with `.`, `!` or `?` followed by a space or the end; trailing text without
    an end mark counts as one more."""
    stripped = text.strip()
    if not stripped:
        return _within(0, min, max)
    ends = SENTENCE_END.findall(stripped)
    trailing = not SENTENCE_END.search(stripped[-1] + " ")
    return _within(len(ends) + int(trailing), min, max)


def paragraph_count(text: str, min: int | None = None, max: int | None = None) -> bool:  # noqa: A002
    """Paragraphs are separated by blank lines (or IFEval's `***`)."""
    parts = [p for p in re.split(r"\n\s*\n|\n?\*\*\*\n?", text) if p.strip()]
    return _within(len(parts), min, max)


def include_keywords(text: str, keywords: list[str]) -> bool:
    """Every keyword appears (case-insensitive, as a whole word)."""
    return all(_occurrences(text, k) > 0 for k in keywords)


def forbidden_keywords(text: str, keywords: list[str]) -> bool:
    """No keyword appears (case-insensitive, as a whole word)."""
    return all(_occurrences(text, k) == 0 for k in keywords)


def keyword_frequency(text: str, keyword: str, min: int | None = None,  # noqa: A002
                      max: int | None = None) -> bool:
    return _within(_occurrences(text, keyword), min, max)


def _occurrences(text: str, keyword: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(keyword)}(?!\w)", text, re.IGNORECASE))


def lowercase(text: str) -> bool:
    """Has letters, none of them upper case."""
    return any(c.isalpha() for c in text) and text == text.lower()


def uppercase(text: str) -> bool:
    """Has letters, none of them lower case."""
    return any(c.isalpha() for c in text) and text == text.upper()


def json_format(text: str) -> bool:
    """The answer is one JSON value (a ```json fence around it is allowed)."""
    body = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text.strip())
    try:
        json.loads(body)
    except ValueError:
        return False
    return bool(body)


def bullet_list(text: str, min: int | None = 1, max: int | None = None) -> bool:  # noqa: A002
    """Lines that are list items (`- `, `* `, `• `, `1. `, `1) `), counted."""
    return _within(len(BULLET.findall(text)), min, max)


def starts_with(text: str, phrase: str) -> bool:
    return text.strip().lower().startswith(phrase.strip().lower())


def ends_with(text: str, phrase: str) -> bool:
    return text.strip().lower().endswith(phrase.strip().lower())


def no_commas(text: str) -> bool:
    return "," not in text


SCRIPTS = {"latin": "LATIN", "cyrillic": "CYRILLIC", "greek": "GREEK", "arabic": "ARABIC",
           "hebrew": "HEBREW", "han": "CJK", "hiragana": "HIRAGANA", "katakana": "KATAKANA",
           "hangul": "HANGUL", "devanagari": "DEVANAGARI", "thai": "THAI"}
"""A language's script by the prefix of its letters' Unicode names."""


def script(text: str, name: str, min_share: float = 0.9) -> bool:
    """At least `min_share` of the letters are of the script `name` (a key of SCRIPTS)."""
    if name not in SCRIPTS:
        raise ValueError(f"unknown script {name!r} (known: {', '.join(sorted(SCRIPTS))})")
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    prefix = SCRIPTS[name]
    inside = sum(unicodedata.name(c, "").startswith(prefix) for c in letters)
    return inside / len(letters) >= min_share


CHECKS: dict[str, Callable[..., bool]] = {
    f.__name__: f for f in (word_count, sentence_count, paragraph_count, include_keywords,
                            forbidden_keywords, keyword_frequency, lowercase, uppercase,
                            json_format, bullet_list, starts_with, ends_with, no_commas, script)
}
"""Every check by the name a `constraints` entry gives (`{"check": "word_count", "max": 50}`)."""


# -- composing checks --------------------------------------------------------------------------


def parse_constraint(entry: Any) -> tuple[str, dict[str, Any]]:
    """`{"check": NAME, **args}` or `NAME` -> (NAME, args), validated against the check's
    signature (ValueError naming what is wrong)."""
    if isinstance(entry, str):
        name, args = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("check"), str):
        name, args = entry["check"], {k: v for k, v in entry.items() if k != "check"}
    else:
        raise ValueError(f"a constraint is a check name or {{\"check\": NAME, ...}}, got {entry!r}")
    if name not in CHECKS:
        import difflib

        close = difflib.get_close_matches(name, CHECKS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown check {name!r}{hint}; known: {', '.join(sorted(CHECKS))}")
    try:
        inspect.signature(CHECKS[name]).bind("", **args)
    except TypeError as e:
        raise ValueError(f"check {name!r}: {e}") from None
    if name == "script" and args.get("name") not in SCRIPTS:
        raise ValueError(f"check 'script': name must be one of {', '.join(sorted(SCRIPTS))}")
    return name, args


def row_constraints(metadata: dict[str, Any], field: str) -> list[Any]:
    value = metadata.get(field)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"`{field}` must be a list of checks, got {type(value).__name__}")
    return value


def check_rows(rows, field: str, checks: list[Any], where: str) -> None:
    """Every row's constraints (and the config's `checks`) name known checks with arguments
    they take; a bad one is a ConfigError naming `where` and the row's file and line. A row
    without any check to score is an error too (it would always score 1)."""
    for i, entry in enumerate(checks):
        try:
            parse_constraint(entry)
        except ValueError as e:
            raise ConfigError(f"{where}.checks[{i}]: {e}") from None
    for row in rows:
        try:
            entries = row_constraints(row.metadata, field)
            for entry in entries:
                parse_constraint(entry)
        except ValueError as e:
            raise ConfigError(f"{row.source}: {e}") from None
        if not entries and not checks:
            raise ConfigError(f"{row.source}: no rule to check: the row has no `{field}` and "
                              f"{where}.checks is empty")


def score_rules(response: str, constraints: list[Any], credit: str = "fractional",
                format_weight: float = 0.0) -> tuple[float, dict[str, Any]]:
    """(score, info): the checks' pass share (or all-or-nothing) on the answer part, mixed with
    the think format reward: (1 - format_weight) * checks + format_weight * format."""
    answer = answer_part(response)
    passed = {}
    for entry in constraints:
        name, args = parse_constraint(entry)
        key = name if name not in passed else f"{name}#{len(passed)}"
        passed[key] = bool(CHECKS[name](answer, **args))
    share = sum(passed.values()) / len(passed) if passed else 1.0
    rules = share if credit == "fractional" else float(share == 1.0)
    formatted = float(think_format(response))
    score = (1 - format_weight) * rules + format_weight * formatted
    return score, {"checks": passed, "rules": rules, "format": formatted}


class RulesRewardFn:
    """The `rules` reward: the row's constraints plus the config's checks, scored in process
    (pure and fast: no worker pool)."""

    name = "rules"

    def __init__(self, checks: list[Any] | None = None, field: str = "constraints",
                 credit: str = "fractional", format_weight: float = 0.0):
        self.checks, self.field = list(checks or []), field
        self.credit, self.format_weight = credit, format_weight

    async def __call__(self, sample: RewardSample) -> RewardResult:
        constraints = self.checks + row_constraints(sample.metadata, self.field)
        score, info = score_rules(sample.response, constraints, self.credit, self.format_weight)
        return RewardResult(score, info)
