"""Math correctness with math-verify: the response's last `\\boxed{...}` against the answer."""

from __future__ import annotations

from reroll.rewards.base import RewardResult, RewardSample
from reroll.rewards.pool import ProcessPool


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def verify_boxed(response: str, answer: str, timeout_s: int = 5) -> tuple[float, dict]:
    """(1.0 if the last boxed answer equals `answer` mathematically else 0.0, info). Runs in a
    worker process: math-verify's own timeouts use signals."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None:
        return 0.0, {"parsed": None, "reason": "no \\boxed{} answer"}
    predicted = parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout_s)
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"the reference answer {answer!r} could not be parsed")
    correct = bool(predicted) and verify(gold, predicted, timeout_seconds=timeout_s)
    return float(correct), {"parsed": boxed}


WARM_UP_ANSWERS = ("12", "-3", "1.5", "3/4", "\\frac{1}{2}", "10\\%", "x+1", "y^2", "x=3",
                   "2\\sqrt{3}", "\\pi", "(1,2)")
"""One of each kind of answer a model writes: math-verify and sympy set up each kind's parsing
and comparison on first use (a symbolic answer's first check took 180 ms, a tuple's 95 ms)."""


def warm_up_verifier() -> None:
    """Check one answer of each kind against itself and against a different number (the
    slow first use is comparing unlike kinds: `x+1` against `9` took 150 ms), so a worker's
    first real calls are not the slow ones."""
    for answer in WARM_UP_ANSWERS:
        for gold in (answer, "9"):
            verify_boxed(f"The answer is \\boxed{{{answer}}}.", gold)


class MathRewardFn:
    """score = (1 - format_weight) * correct + format_weight * (a boxed answer and a clean stop)."""

    name = "math"
    times_itself = True
    """The pool bounds each call (counting the call, not the wait for a worker)."""

    def __init__(self, format_weight: float = 0.0, timeout_s: float = 5.0, num_workers: int = 1,
                 memory_bytes: int | None = None):
        self.format_weight = format_weight
        self.timeout_s = timeout_s
        # Warm up: math-verify's imports (sympy, latex2sympy) take ~0.4 s per worker.
        self.pool = ProcessPool(num_workers, warm_up=(warm_up_verifier, ()),
                                memory_bytes=memory_bytes)
        self.queue_metrics = self.pool.queue_metrics

    async def __call__(self, sample: RewardSample) -> RewardResult:
        if sample.answer is None:
            raise ValueError("the math reward needs an `answer` in every dataset row")
        inner_timeout = max(1, int(self.timeout_s))
        correct, info = await self.pool.run(verify_boxed, sample.response, sample.answer,
                                            inner_timeout, timeout=self.timeout_s + 1.0)
        well_formed = float(info["parsed"] is not None and sample.finish_reason == "stop")
        score = (1 - self.format_weight) * correct + self.format_weight * well_formed
        return RewardResult(score, {**info, "correct": correct, "format": well_formed})

    def close(self) -> None:
        self.pool.close()
