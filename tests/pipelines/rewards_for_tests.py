"""Reward functions that misbehave on purpose, imported by path from test configs."""

import time


def hangs_or_crashes(sample) -> float:
    """Sample-dependent: some calls hang past the limit, some raise, the rest score. (By the
    response's characters, not its length: responses cut at max_new_tokens share one length.)"""
    marker = sum(map(ord, sample.response)) % 5
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



def nan_reward(sample) -> float:
    """Not a number, for every sample."""
    return float("nan")


def inf_reward(sample) -> float:
    return float("inf")


def nan_on_some(sample) -> float:
    """NaN for one response in eight (by its length), else 1 for a boxed answer."""
    if len(sample.response) % 8 == 0:
        return float("nan")
    return 1.0 if "boxed" in sample.response else 0.0


def always_crashes(sample) -> float:
    raise RuntimeError("this verifier never works")


def huge_reward(sample) -> float:
    """Finite (and within float32), but two of them overflow float32 when summed: the group's
    advantages, hence the loss, come out non-finite."""
    return 3e38 if len(sample.response) % 2 else -3e38


async def blocks_its_loop(sample) -> float:
    """An async reward that blocks its event loop (no await): asyncio's timeouts cannot fire."""
    time.sleep(30)
    return 1.0


async def quick_async(sample) -> float:
    return 0.5


def slow_reward(sample) -> float:
    """Takes 0.7 s: several queued on one worker wait longer than the time limit in total."""
    time.sleep(0.7)
    return 1.0


def allocates_3gb(sample) -> float:
    """Tries to hold 3 GB (lazily zeroed pages: cheap when it succeeds)."""
    block = bytearray(3 << 30)
    return float(len(block) > 0)


def always_raises(sample) -> float:
    """A verifier that is broken for every sample (a domain whose reward keeps failing)."""
    raise RuntimeError("broken verifier")
