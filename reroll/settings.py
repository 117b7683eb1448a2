"""The one place reroll reads or sets process environment variables (DESIGN.md §5.8), and the
machine facts a default is chosen from (the cores this process may use, the machine's load).

Reads: secrets named by config (an API key's variable). Writes: variables that libraries read at
start-up (torch.distributed's rendezvous, Ray's log de-duplication, vLLM's CPU KV-cache size);
`defaults` never overrides what the user already exported. The sandbox launcher sets its child's
environment itself: it runs inside the sandbox, without reroll on its path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import NamedTuple


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


class Threads(NamedTuple):
    """The torch thread count chosen for a machine already busy when this process started."""

    threads: int
    cores: int
    load: float

    def line(self, setting: str) -> str:
        """What the run or evaluation says at its start; `setting` is how to choose instead."""
        return (f"the machine is busy (load {self.load:.1f} on {self.cores} cores): using "
                f"{self.threads} torch thread{'s' if self.threads > 1 else ''}; set {setting} "
                f"to choose")


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or `taskset`'s share,
    not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def load() -> float | None:
    """The 1-minute load average (runnable tasks) on the cores this process may use, or None
    where it is unknown: the machine's, times their share of its cores (a container pinned to 4
    of a host's 64 cores sees the host's load)."""
    try:
        machine = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return machine * min(1.0, cores() / (os.cpu_count() or cores()))


def threads_for(cores: int, load: float) -> int:
    """Threads for a process that may use `cores` cores while `load` tasks already run: the
    cores left idle (the load rounded to whole cores), at least 1. Oversubscribed torch threads
    wait on one another at every parallel op, so fewer threads than cores beat more."""
    return max(1, min(cores, cores - int(load + 0.5)))


def busy(cores: int, load: float) -> bool:
    """Whether `load` runnable tasks oversubscribe `cores`: a whole core's worth more than them
    (a process using every core brings the load to about `cores` by itself)."""
    return load >= cores + 1


@functools.cache
def contention() -> Threads | None:
    """The threads to use when the machine was already busy at this process's first call, or
    None: a quiet machine (torch's default, every core, stays), an unknown load, or
    OMP_NUM_THREADS exported (the user's choice, which torch already follows). Cached: read once,
    before the process's own work adds to the load (a restarted run must not count itself)."""
    if read("OMP_NUM_THREADS"):
        return None
    n, now = cores(), load()
    if now is None or threads_for(n, now) >= n:
        return None
    return Threads(threads_for(n, now), n, now)
