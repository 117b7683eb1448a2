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
