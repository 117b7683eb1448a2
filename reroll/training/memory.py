"""Keep freed training memory from piling up in glibc's heap, without paying for it in page
faults.

glibc serves allocations below its mmap threshold from heap arenas and, after a large block is
freed, raises that threshold (up to 32 MiB). A training step allocates and frees many
activation-sized blocks (a decoder layer's temporaries are 5-30 MB at a few thousand tokens),
so after the first step they all come from the heap, which fragments: on SmolLM2-135M (16x256
tokens) the process's peak RSS was 3.9 GiB while at most 2.5 GiB was live. A fixed threshold
gives such blocks back to the OS when freed.

The threshold is 4 MiB, not lower: every block above it is a fresh mapping whose pages fault in
when first touched. At 1 MiB a small model's step (the tiny model's DPO: [8, 102, 384] float
blocks of 1.25 MB) made about a million minor faults in 60 steps and spent ~15% of its CPU
time on them; at 4 MiB, 0.1 million (SmolLM2's update peaks at 2.87 GiB instead of 2.72). The
trim threshold is raised with it, so the heap's free top is kept for the next step rather than
given back and faulted in again (a fixed mmap threshold turns glibc's own adjustment of it off).

That suits small models only. A real model's blocks between 1 and 4 MiB (SmolLM2-135M's
key/value projections at 16x256 tokens are 2.5 MB) then fragment the heap: its LoRA update
peaked at 1.78-1.89 GiB instead of 1.48 (`benchmarks/lora.py`), and its step is seconds long,
so the page faults of fresh mappings cost it nothing measurable. A model of
`LARGE_MODEL_PARAMETERS` or more keeps the 1 MiB threshold and glibc's trim threshold.
A user's own `MALLOC_MMAP_THRESHOLD_` (or `MALLOC_TRIM_THRESHOLD_`) wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from reroll import settings

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
THRESHOLD_BYTES = 4 << 20
TRIM_BYTES = 64 << 20
LARGE_THRESHOLD_BYTES = 1 << 20
LARGE_MODEL_PARAMETERS = 50_000_000


def limit_heap_fragmentation(parameters: int = 0) -> bool:
    """Fix glibc's mmap threshold for this process: 4 MiB with a 64 MiB trim threshold for a
    model of fewer than LARGE_MODEL_PARAMETERS `parameters`, 1 MiB for a larger one. False
    where that does not apply (not Linux/glibc, or the user set MALLOC_MMAP_THRESHOLD_)."""
    if not sys.platform.startswith("linux") or settings.read("MALLOC_MMAP_THRESHOLD_"):
        return False
    large = parameters >= LARGE_MODEL_PARAMETERS
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        if not large and not settings.read("MALLOC_TRIM_THRESHOLD_"):
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)
        return bool(libc.mallopt(M_MMAP_THRESHOLD,
                                 LARGE_THRESHOLD_BYTES if large else THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
