"""The async sources' resume check, shared by their tests: a run uninterrupted, and the same run
stopped after a checkpoint and continued from its state on a fresh source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Resumed:
    whole: list
    """What each step of the uninterrupted run trained."""
    before: list
    """... of the stopped run, up to the checkpoint."""
    after: list
    """... of the resumed run, after it."""
    state: dict
    """The stopped run's source state (`AsyncSource.state_dict`)."""


def stop_and_resume(make: Callable[[], tuple[Any, Callable[[], None]]],
                    play: Callable[[Any, range], list], steps: int, stop: int) -> Resumed:
    """`make()` -> (a fresh async source, its close); `play(source, steps)` -> what each step
    trained (the trainer's update done by the caller's play). Steps 1..`steps` uninterrupted;
    then steps 1..`stop`, the source's state, and the rest from that state."""
    source, close = make()
    try:
        whole = play(source, range(1, steps + 1))
    finally:
        close()
    source, close = make()
    try:
        before = play(source, range(1, stop + 1))
        state = source.state_dict()
    finally:
        close()
    source, close = make()
    source.load_state_dict(state)
    source.engine.load_weights([], stop)  # the checkpoint's weights
    try:
        after = play(source, range(stop + 1, steps + 1))
    finally:
        close()
    return Resumed(whole, before, after, state)
