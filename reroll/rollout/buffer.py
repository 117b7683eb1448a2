"""The buffer between the rollout side and the trainer in asynchronous training.

Completed groups wait here tagged with the policy version behind their oldest token. The
trainer at version v takes only groups with staleness v - version <= max_staleness; older ones
are dropped (and counted), never trained on. Producer and consumer run in different threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from reroll.rollout.scheduler import Group


@dataclass
class BufferedGroup:
    group: Group
    version: int
    """Oldest policy version that generated any token of the group."""


class StaleBatchError(RuntimeError):
    """The producer stopped before the trainer got a batch (it failed or was closed)."""


class VersionedBuffer:
    def __init__(self, max_staleness: int, capacity_groups: int):
        self.max_staleness = max_staleness
        self.capacity = capacity_groups
        self._groups: deque[BufferedGroup] = deque()
        self._cond = threading.Condition()
        self._closed: BaseException | bool = False
        self.dropped_stale_groups = 0
        self.wait_s = 0.0

    def put(self, group: BufferedGroup) -> None:
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def take(self, num_groups: int, version: int, timeout_s: float | None = None
             ) -> list[BufferedGroup]:
        """Block until `num_groups` groups with staleness <= max_staleness are available at
        trainer version `version`; groups found too stale on the way are dropped."""
        start = time.perf_counter()
        with self._cond:
            while True:
                self._drop_stale(version)
                if len(self._groups) >= num_groups:
                    taken = [self._groups.popleft() for _ in range(num_groups)]
                    self._cond.notify_all()
                    self.wait_s += time.perf_counter() - start
                    return taken
                if self._closed:
                    raise StaleBatchError(f"the rollout producer stopped: {self._closed!r}") \
                        from (self._closed if isinstance(self._closed, BaseException) else None)
                if not self._cond.wait(timeout_s):
                    raise TimeoutError(f"no batch of {num_groups} groups within {timeout_s}s")

    def _drop_stale(self, version: int) -> None:
        fresh = deque(g for g in self._groups if version - g.version <= self.max_staleness)
        self.dropped_stale_groups += len(self._groups) - len(fresh)
        self._groups = fresh

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed = error or True
            self._cond.notify_all()
