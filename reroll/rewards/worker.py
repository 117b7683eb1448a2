"""A reward worker process: reads (function, args) frames on stdin, writes (ok, value) on stdout.

Started by `reroll.rewards.pool.ProcessPool`; not meant to be run by hand.
"""

from __future__ import annotations

import pickle
import resource
import sys

from reroll.rewards.pool import read_frame, write_frame


def cap_memory(memory_bytes: int) -> None:
    """Cap this process's writable private memory (0: no cap): past it, allocations raise
    MemoryError. RLIMIT_DATA (heap and anonymous mappings, Linux 4.7+) rather than RLIMIT_AS,
    which would also count the shared libraries mapped by an import (CUDA torch maps GBs)."""
    if memory_bytes > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def serve() -> None:
    cap_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints from reward code must not corrupt the frames
    # The first frame is the parent's import path, so functions from its modules unpickle here.
    first = read_frame(stdin)
    if first is None:
        return
    sys.path[:] = pickle.loads(first)
    while (frame := read_frame(stdin)) is not None:
        try:
            fn, args = pickle.loads(frame)
            reply = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - sent back to the caller
            reply = (False, e)
        try:
            payload = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
            payload = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
        write_frame(stdout, payload)


if __name__ == "__main__":
    serve()
