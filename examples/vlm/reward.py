"""The counting task's reward (`reward: {type: custom, function: examples.vlm.reward:count}`):
1.0 when the response is the count alone, as the task asks ("Answer with a number."), else 0.

Why not `type: math`: it reads a `\\boxed{}` answer, and the tiny VLM learns to count far more
slowly when its answer comes after `\\boxed{` (SFT on the right answers: held-out accuracy at
chance after 300 steps, against 1.0 after 250 with the bare count; measured 2026-11-28).
"""


def count(sample) -> float:
    return float(sample.response.strip() == (sample.answer or "").strip())
