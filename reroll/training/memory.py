"""Keep freed training memory from piling up in glibc's heap.

glibc serves allocations below its mmap threshold from heap arenas and, after a large block is
freed, raises that threshold (up to 32 MiB). A training step allocates and frees many
activation-sized blocks (a decoder layer's temporaries are 5-30 MB at a few thousand tokens),
so after the first step they all come from the heap, which fragments: on SmolLM2-135M (16x256
tokens) the process's peak RSS was 3.9 GiB while at most 2.5 GiB was live. A fixed 1 MiB
threshold gives such blocks back to the OS when freed (2.7 GiB peak, same step time within
noise). A user's own `MALLOC_MMAP_THRESHOLD_` wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from reroll import settings

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD_BYTES = 1 << 20


def limit_heap_fragmentation() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; False where that does not apply
    (not Linux/glibc, or the user set MALLOC_MMAP_THRESHOLD_)."""
    if not sys.platform.startswith("linux") or settings.read("MALLOC_MMAP_THRESHOLD_"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
