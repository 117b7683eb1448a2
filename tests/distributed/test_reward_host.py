"""The reward host (the body of reward actors and Serve replicas) starts without loading torch,
so a replica the autoscaler adds for a burst of rewards is ready in the time its reward needs,
not the seconds torch's import takes on a busy node; its thread cap still reaches a torch that
the reward loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import sys
from reroll.distributed.reward_actor import limit_threads

print("torch loaded with the reward host:", "torch" in sys.modules)
limit_threads(1)
import torch  # as a reward model's factory would, after the cap
print("threads of a torch loaded after the cap:", torch.get_num_threads())
torch.set_num_threads(2)
limit_threads(1)
print("threads of a torch loaded before the cap:", torch.get_num_threads())
"""


def test_the_reward_host_starts_without_torch_and_still_caps_its_threads():
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env | {"PYTHONPATH": ":".join(sys.path)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch loaded with the reward host: False" in out.stdout
    assert "threads of a torch loaded after the cap: 1" in out.stdout
    assert "threads of a torch loaded before the cap: 1" in out.stdout
