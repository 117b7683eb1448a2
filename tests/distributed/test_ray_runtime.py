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


# A run's start as far as Ray goes: its own instance, then a named worker actor, as a run's
# `RayExecutor(name_prefix=...)` makes them; prints when it is up, then waits to be killed.
RUN_WITH_A_WORKER = """
import json, os, time
from reroll.distributed.cluster import Cluster, RayExecutor, WorkerSpec
from reroll.distributed.ray_runtime import ensure_ray

class Pid:
    def __init__(self, rank, world_size):
        pass
    def pid(self):
        return os.getpid()

ensure_ray(num_cpus=2)
cluster = Cluster(WorkerSpec(Pid, {}, role="policy"), 1,
                  RayExecutor([{"num_cpus": 1}], name_prefix="run"))
print(json.dumps({"worker": cluster.call("pid")[0]}), flush=True)
time.sleep(300)
"""


def test_a_run_starts_right_after_the_previous_one_was_killed(monkeypatch):
    """Issue 49: after `kill -9` of a run, two helpers of its Ray instance live on for about a
    minute (docs/distributed.md). The next run (a resume) must start beside them at once: its
    own instance, the same actor names, its workers answering."""
    import contextlib
    import os
    import signal

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def start() -> tuple[subprocess.Popen, dict]:
        run = subprocess.Popen([sys.executable, "-c", RUN_WITH_A_WORKER], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
        line = run.stdout.readline()
        assert line, "the run did not start"
        return run, json.loads(line)

    killed, first = start()
    os.kill(killed.pid, signal.SIGKILL)  # the driver only, as `kill -9 PID` does
    killed.wait()
    try:
        resumed, second = start()  # while the killed instance's helpers still live
        try:
            assert second["worker"] != first["worker"]
        finally:
            os.killpg(resumed.pid, signal.SIGTERM)
            resumed.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the helpers: not left for a minute
            os.killpg(killed.pid, signal.SIGKILL)
