"""A run with no Ray address starts its own local instance, as `ensure_ray` promises, even when
another Ray cluster is running on the machine (a `ray start`, or another test run's: Ray's own
`ray.init()` would join the newest such cluster, and then refuse the instance's sizes). Joining a
cluster is what `distributed.ray_address` / `RAY_ADDRESS` are for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

# What a user's run does, with no address configured: its instance and its CPUs.
RUN = """
import json, ray
from reroll.distributed.ray_runtime import ensure_ray
ensure_ray(num_cpus=3)
print(json.dumps({"cpus": ray.cluster_resources().get("CPU"),
                  "gcs": ray.get_runtime_context().gcs_address}))
"""

# In a child process: the test session's own Ray instance is neither joined nor disturbed.
# Like `ray start --head`, `Cluster` records its address where ray.init() looks for one.
OTHER_CLUSTER_RUNNING = """
import json, subprocess, sys
from ray.cluster_utils import Cluster

other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
try:
    run = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True,
                         timeout=240)
    print(json.dumps({"returncode": run.returncode, "stdout": run.stdout,
                      "stderr": run.stderr[-3000:], "other_gcs": other.gcs_address}))
finally:
    other.shutdown()
"""


def test_a_run_without_an_address_starts_its_own_instance_beside_another_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    done = subprocess.run([sys.executable, "-c", OTHER_CLUSTER_RUNNING, RUN], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["returncode"] == 0, report["stderr"]
    run = json.loads(report["stdout"].strip().splitlines()[-1])
    assert run["cpus"] == 3.0  # its own instance, sized as asked
    assert run["gcs"] != report["other_gcs"]
