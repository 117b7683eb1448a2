"""Reward functions that misbehave on purpose, imported by path from test configs."""

import time


def hangs_or_crashes(sample) -> float:
    """Sample-dependent: some calls hang past the limit, some raise, the rest score."""
    marker = len(sample.response) % 5
    if marker == 0:
        time.sleep(60)
    if marker == 1:
        raise RuntimeError("broken verifier")
    return 1.0 if "boxed" in sample.response else 0.0


def states_the_answer(sample) -> float:
    """1.0 when the reference answer appears as a number in the response: a reward a pretrained
    model earns sometimes from the first step (short responses rarely reach a \\boxed{})."""
    import re

    return float(sample.answer in re.findall(r"-?\d+", sample.response))
