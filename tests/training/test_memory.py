"""A freed activation-sized block goes back to the OS once the mmap threshold is fixed."""

import sys

import pytest
import torch

from reroll.training.memory import limit_heap_fragmentation

pytestmark = pytest.mark.unit


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_leave_the_heap(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert limit_heap_fragmentation()
    # Blocks of 24 MiB, below glibc's dynamic threshold ceiling (32 MiB): without the fixed
    # threshold the heap would serve and keep them after the first free.
    for _ in range(3):
        block = torch.ones(6 << 20)  # touched, so resident
        before_free = rss_mib()
        del block
        assert rss_mib() < before_free - 20


def test_a_users_own_threshold_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not limit_heap_fragmentation()
