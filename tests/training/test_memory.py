"""A freed activation-sized block goes back to the OS once the mmap threshold is fixed; a small
model's blocks stay in the heap for the next step, so their pages are not faulted in again."""

import os
import subprocess
import sys

import pytest

from reroll.training.memory import limit_heap_fragmentation

pytestmark = pytest.mark.unit


FREED_BLOCKS_PROGRAM = """
import torch
from reroll.training.memory import limit_heap_fragmentation

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS")) / 1024

assert limit_heap_fragmentation()
# Blocks of 24 MiB, below glibc's dynamic threshold ceiling (32 MiB): without the fixed
# threshold the heap would serve and keep them after the first free.
for _ in range(3):
    block = torch.ones(6 << 20)  # touched, so resident
    before_free = rss_mib()
    del block
    print(before_free - rss_mib())  # MiB given back by the free
"""


REUSED_BLOCKS_PROGRAM = """
import resource
import torch
from reroll.training.memory import limit_heap_fragmentation

assert limit_heap_fragmentation()
# A tiny model's activation block ([8, 102, 384] floats, 1.25 MB), allocated, touched and freed
# as each micro-batch does: from the heap it is faulted in once, as a fresh mapping every time
# (about 300 faults each, 30,000 in 100 rounds, at the former 1 MiB threshold).
torch.ones(8, 102, 384)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    block = torch.ones(8, 102, 384)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


LARGE_MODEL_BLOCKS_PROGRAM = """
import torch
from reroll.training.memory import limit_heap_fragmentation

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS")) / 1024

assert limit_heap_fragmentation(135_000_000)  # SmolLM2-135M
# A real model's mid-sized activation block (2.5 MB: SmolLM2's key/value projection of 16x256
# tokens), between 1 and 4 MiB: at the small model's 4 MiB threshold and 64 MiB trim threshold
# the heap kept it (its LoRA update peaked at 1.78-1.89 GiB instead of 1.48).
for _ in range(3):
    keep = torch.ones(1 << 10)  # a live block after it, as the step's other tensors are
    block = torch.ones(3328, 192)
    before_free = rss_mib()
    del block
    print(before_free - rss_mib())
"""


def run_fresh(program: str) -> list[float]:
    """The numbers `program` prints, run in a fresh process, as a trainer starts: in a long test
    session the heap's state depends on every test before (the check was flaky there)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    result = subprocess.run([sys.executable, "-c", program], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return [float(line) for line in result.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_leave_the_heap():
    given_back_mib = run_fresh(FREED_BLOCKS_PROGRAM)
    assert len(given_back_mib) == 3 and all(mib > 20 for mib in given_back_mib), given_back_mib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_small_blocks_are_reused_without_page_faults():
    [faults] = run_fresh(REUSED_BLOCKS_PROGRAM)
    assert faults < 3000


def test_a_users_own_threshold_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not limit_heap_fragmentation()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_models_mid_sized_blocks_leave_the_heap():
    given_back_mib = run_fresh(LARGE_MODEL_BLOCKS_PROGRAM)
    assert len(given_back_mib) == 3 and all(mib > 2 for mib in given_back_mib), given_back_mib
