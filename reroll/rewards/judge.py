"""`reward: {type: judge}`: a generative judge (an LLM) scores a response.

The judge sees a prompt built from a template with the question, the response and optionally
the reference answer; its text is parsed into a verdict, a score on a scale or one of named
choices, mapped to a reward. An unparseable verdict is asked again (`retries`), then fails the
call (counted by the runner in `reward/errors`, and here in `reward/judge_parse_failures`).
Identical requests (same judge prompt) are answered once: a cache keeps each verdict, and calls
for a prompt already in flight wait for its answer.

This module knows nothing of engines (rewards sit below them): it is given `generate`, an async
function from the judge prompt (text) to the judge's reply (text); `reroll.pipelines.judge`
builds it over a reroll engine (a local model, or `remote` endpoints).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from reroll.rewards.base import RewardResult, RewardSample

Generate = Callable[[str, int], Awaitable[str]]
"""(judge prompt, attempt number) -> the judge's reply; the attempt seeds a retry's sampling."""

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class VerdictError(ValueError):
    """The judge's reply holds no verdict the parser accepts."""


def parse_score(text: str, low: float, high: float, pattern: str | None = None) -> float:
    """The judge's score mapped to [0, 1]: the first number matching `pattern` (its first group;
    None: the last number of the reply) in [low, high]."""
    if pattern is not None:
        match = re.search(pattern, text)
        found = [match.group(1) if match and match.groups() else match.group(0)] if match else []
    else:
        found = NUMBER.findall(text)[-1:]
    if not found:
        raise VerdictError(f"no score in the judge's reply {text[:200]!r}")
    value = float(found[0])
    if not low <= value <= high:
        raise VerdictError(f"score {value} outside [{low}, {high}] in {text[:200]!r}")
    return (value - low) / (high - low)


def judge_parser(config) -> Callable[[str], float]:
    """The verdict parser a `reward: {type: judge}` section's `verdict` asks for: reply text ->
    reward."""
    if config.verdict == "score":
        return partial(parse_score, low=config.score_min, high=config.score_max,
                       pattern=config.score_pattern)
    return partial(parse_choice, choices=config.choices)


def parse_choice(text: str, choices: dict[str, float]) -> float:
    """The reward of the choice the reply names first (whole words, case-insensitive)."""
    best: tuple[int, float] | None = None
    for name, reward in choices.items():
        match = re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE)
        if match and (best is None or match.start() < best[0]):
            best = (match.start(), reward)
    if best is None:
        raise VerdictError(f"none of {sorted(choices)} in the judge's reply {text[:200]!r}")
    return best[1]


def verdict_agreement(sample: RewardSample) -> float:
    """1.0 when the reply's first yes/no (as `verdict: choice` parses it) is the row's `answer`
    ("yes" or "no"), else 0.0: a judge's agreement with known verdicts, as a custom reward
    (`reroll eval --reward custom --reward-function reroll.rewards.judge:verdict_agreement` on
    the rows of `reroll make-data --judge-labels-from`)."""
    verdicts = {"yes": 1.0, "no": 0.0}
    expected = verdicts.get((sample.answer or "").strip().lower())
    if expected is None:
        raise ValueError(f"the row's answer {sample.answer!r} is not a verdict (yes or no)")
    try:
        return float(parse_choice(sample.response, verdicts) == expected)
    except VerdictError:
        return 0.0


@dataclass
class JudgeCounters:
    requests: int = 0
    """Judge generations made (retries included; cached answers excluded)."""
    cache_hits: int = 0
    parse_failures: int = 0
    """Replies without a verdict (each retry counts)."""


class JudgeRewardFn:
    """A RewardFn over a judge: template -> `generate` -> parse, with retries and a cache."""

    name = "judge"

    def __init__(self, generate: Generate, template: str, parse: Callable[[str], float],
                 retries: int = 2, cache: bool = True, close: Callable[[], None] | None = None):
        self.generate, self.template, self.parse = generate, template, parse
        self.retries, self.use_cache = retries, cache
        self.cache: dict[str, asyncio.Future | tuple[float, str]] = {}
        self.counters = JudgeCounters()
        self._close = close

    def judge_prompt(self, sample: RewardSample) -> str:
        return self.template.format(question=sample.prompt, response=sample.response,
                                    reference=sample.answer or "")

    async def __call__(self, sample: RewardSample) -> RewardResult:
        prompt = self.judge_prompt(sample)
        cached = self.cache.get(prompt) if self.use_cache else None
        if isinstance(cached, tuple):
            self.counters.cache_hits += 1
            return RewardResult(cached[0], {"judge": cached[1], "cached": True})
        if cached is not None:  # the same request is in flight: share its answer
            self.counters.cache_hits += 1
            score, reply = await asyncio.shield(cached)
            return RewardResult(score, {"judge": reply, "cached": True})
        pending = asyncio.get_running_loop().create_future() if self.use_cache else None
        if pending is not None:
            self.cache[prompt] = pending
        try:
            score, reply = await self.verdict(prompt)
        except BaseException as e:
            if pending is not None:
                del self.cache[prompt]  # a failure is not cached: the next call asks again
                pending.set_exception(e if isinstance(e, Exception) else RuntimeError(
                    f"the identical judge request was cancelled ({type(e).__name__})"))
                pending.exception()  # retrieved: the callers waiting on it re-raise it
            raise
        if pending is not None:
            self.cache[prompt] = (score, reply)
            pending.set_result((score, reply))
        return RewardResult(score, {"judge": reply})

    async def verdict(self, prompt: str) -> tuple[float, str]:
        """(reward, the reply it was parsed from); VerdictError after `retries` retries."""
        error: VerdictError | None = None
        for attempt in range(self.retries + 1):
            self.counters.requests += 1
            reply = await self.generate(prompt, attempt)
            try:
                return self.parse(reply), reply
            except VerdictError as e:
                self.counters.parse_failures += 1
                error = e
        raise VerdictError(f"{error} (after {self.retries} retries)")

    def counter_state(self) -> dict[str, int]:
        return dict(vars(self.counters))

    def load_counter_state(self, state: dict[str, int]) -> None:
        vars(self.counters).update(state)

    def queue_metrics(self) -> dict[str, float]:
        c = self.counters
        return {"reward/judge_requests": float(c.requests),
                "reward/judge_cache_hits": float(c.cache_hits),
                "reward/judge_parse_failures": float(c.parse_failures)}

    def close(self) -> None:
        if self._close is not None:
            self._close()
