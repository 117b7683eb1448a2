"""`SandboxPool`: warm single-use sandboxes, isolation between executions, concurrency limit,
health checks, metrics, and a load test."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import tempfile
import time
import uuid

import pytest

from reroll.sandbox import Limits, PoolConfig, Sandbox, SandboxConfig, SandboxError, SandboxPool

pytestmark = pytest.mark.unit


def test_executions_on_warm_sandboxes_are_isolated_from_each_other(sandbox, host):
    token = f"reroll-leak-{uuid.uuid4().hex}"
    first = f"""
import builtins, os, subprocess, sys
for path in ("/work/left.txt", "/tmp/left.txt", "/dev/shm/left"):
    open(path, "w").write("{token}")
builtins.LEAKED = "{token}"
sys.modules["json"] = "{token}"
os.environ["LEAK"] = "{token}"
subprocess.Popen(["sh", "-c", "sleep 100000 # {token}"])
print(os.readlink("/proc/self/ns/pid"))
"""
    second = f"""
import builtins, json, os, sys
found = [p for p in ("/work/left.txt", "/tmp/left.txt", "/dev/shm/left") if os.path.exists(p)]
procs = [open(f"/proc/{{p}}/cmdline").read() for p in os.listdir("/proc") if p.isdigit()]
print(json.dumps({{
    "files": found, "builtin": hasattr(builtins, "LEAKED"), "env": os.environ.get("LEAK"),
    "json_module": isinstance(sys.modules["json"], str), "token_in_proc": any("{token}" in c for c in procs),
    "ns": os.readlink("/proc/self/ns/pid"),
}}))
"""
    before = host.descendants()

    async def scenario():
        async with SandboxPool(sandbox, concurrency=1, warm=2) as pool:
            await asyncio.sleep(0.3)  # let the warm sandboxes start
            a = await pool.run(first)
            b = await pool.run(second)
            return a, b

    a, b = asyncio.run(scenario())
    assert a.ok and a.warm and b.ok and b.warm, (a, b)
    out = json.loads(b.stdout)
    assert out == {
        "files": [], "builtin": False, "env": None, "json_module": False, "token_in_proc": False,
        "ns": out["ns"],
    }  # fmt: skip
    assert out["ns"] != a.stdout.strip()
    assert host.procs_with(token) == []
    assert host.descendants() - before == set()


def test_a_job_with_another_tmpfs_size_gets_a_sandbox_of_that_size(sandbox):
    code = "import os\nst = os.statvfs('/work')\nprint(st.f_blocks * st.f_frsize >> 20)"

    async def scenario():
        async with SandboxPool(sandbox, concurrency=1, warm=1) as pool:
            await asyncio.sleep(0.3)
            default = await pool.run(code)
            custom = await pool.run(code, limits=Limits(tmpfs_bytes="16M"))
            return default, custom

    default, custom = asyncio.run(scenario())
    assert default.warm and default.stdout == f"{sandbox.limits.tmpfs_bytes >> 20}\n"
    assert not custom.warm and custom.stdout == "16\n"


def test_concurrency_limit_is_respected(sandbox):
    code = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint(start, time.time())"

    async def scenario():
        async with SandboxPool(sandbox, concurrency=2, warm=0) as pool:
            return await asyncio.gather(*(pool.run(code) for _ in range(6)))

    results = asyncio.run(scenario())
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2
    assert max(r.queue_s for r in results) > 0.5  # later calls waited for a free slot


def test_metrics_count_throughput_latency_and_failures_by_cause(sandbox):
    async def scenario():
        async with SandboxPool(sandbox, concurrency=2) as pool:
            await pool.run("print(1)")
            await pool.run("raise SystemExit(3)")
            await pool.run("import time\ntime.sleep(5)", limits=Limits(wall_time_s=0.3))
            await pool.run("x = bytearray(1 << 30)", limits=Limits(memory_bytes="128M"))
            return pool.metrics()

    metrics = asyncio.run(scenario())
    assert metrics["executions"] == 4
    assert metrics["failures"] == {"exit_code": 1, "wall_time": 1, "memory": 1}
    assert metrics["executions_per_s"] > 0
    assert 0 < metrics["latency_p50_ms"] <= metrics["latency_p99_ms"]
    assert metrics["queue_wait_p99_ms"] >= metrics["queue_wait_p50_ms"] >= 0
    assert metrics["in_flight"] == 0 and metrics["concurrency"] == 2


def test_health_check_and_dead_warm_sandboxes_are_replaced(sandbox, host):
    before = host.descendants()

    async def scenario():
        pool = SandboxPool(sandbox, PoolConfig(concurrency=1, warm=1))
        await pool.start()
        health = await pool.health_check()
        for _ in range(100):
            if pool.idle:
                break
            await asyncio.sleep(0.05)
        victim = pool._idle[0]
        victim.popen.send_signal(signal.SIGKILL)  # a warm sandbox dies while idle
        await asyncio.sleep(0.3)
        result = await pool.run("print('fine')")
        for _ in range(100):
            if pool.idle:
                break
            await asyncio.sleep(0.05)
        # Another dies just as it is handed a job: the pool notices and retries on a fresh one.
        signal.pidfd_send_signal(pool._idle[0]._init_pidfd, signal.SIGKILL)
        retried = await pool.run("print('fine again')")
        metrics = pool.metrics()
        await pool.close()
        return health, result, retried, metrics

    health, result, retried, metrics = asyncio.run(scenario())
    assert health.ok and health.backend == "bwrap" and health.latency_s > 0
    assert result.ok and result.stdout == "fine\n"
    assert retried.ok and retried.stdout == "fine again\n" and not retried.warm
    assert metrics["failures"] == {"slot_died": 2}
    deadline = time.monotonic() + 5
    while host.descendants() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host.descendants() - before == set()


def test_pool_refuses_to_start_on_a_broken_backend():
    async def scenario():
        pool = SandboxPool(SandboxConfig(python="/bin/false", spawn_timeout_s=5), concurrency=1)
        await pool.start()

    with pytest.raises(SandboxError, match="health check failed"):
        asyncio.run(scenario())


def test_closed_pool_refuses_work_and_leaves_nothing(sandbox, host):
    before = host.descendants()

    async def scenario():
        pool = SandboxPool(sandbox, concurrency=3, warm=3)
        await pool.start()
        await asyncio.sleep(0.3)
        await pool.close()
        with pytest.raises(SandboxError, match="closed"):
            await pool.run("print(1)")

    asyncio.run(scenario())
    assert host.descendants() - before == set()


def test_an_unclosed_pool_leaves_no_process_behind(sandbox, host):
    before = host.descendants()

    async def scenario():
        pool = SandboxPool(sandbox, concurrency=2, warm=2)
        await pool.start()
        for _ in range(100):
            if pool.idle == 2:
                break
            await asyncio.sleep(0.05)
        return pool

    pool = asyncio.run(scenario())
    assert pool.idle == 2 and len(host.descendants() - before) >= 2
    del pool
    gc.collect()
    assert host.descendants() - before == set()


def test_stopping_sandboxes_while_they_start_leaves_nothing(host):
    """Pool closed while replacements start, runs cancelled during start-up: no bubblewrap child
    may be left blocked (it would be re-parented away from us, so look for a marker in argv)."""
    mark = tempfile.mkdtemp(prefix="reroll-mark-")
    os.chmod(mark, 0o755)  # the sandbox uid must be able to bind it
    sandbox = Sandbox(SandboxConfig(extra_ro_paths=(mark,)))

    async def scenario():
        for _ in range(3):
            pool = SandboxPool(sandbox, concurrency=4, warm=4)
            await pool.start()
            await pool.close()
        for delay in (0.0, 0.001, 0.003, 0.01):
            task = asyncio.create_task(sandbox.run("print(1)"))
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
        assert host.procs_with(mark) == []
    finally:
        os.rmdir(mark)


def test_load_200_executions_with_concurrency_8(sandbox, host):
    before = host.descendants()
    programs = [
        (
            "import sys\nn = int(sys.stdin.read())\nprint(sum(i * i for i in range(n)))",
            str(i),
            str(sum(k * k for k in range(i))),
        )
        for i in range(200)
    ]

    async def scenario():
        async with SandboxPool(sandbox, concurrency=8) as pool:
            started = time.perf_counter()
            results = await asyncio.gather(
                *(pool.run(code, stdin=stdin) for code, stdin, _ in programs)
            )
            return results, time.perf_counter() - started, pool.metrics()

    results, elapsed, metrics = asyncio.run(scenario())
    assert [r.stdout.strip() for r in results] == [expected for _, _, expected in programs]
    assert all(r.ok for r in results)
    assert metrics["executions"] == 200 and metrics["failures"] == {}
    assert metrics["in_flight"] == 0
    assert host.descendants() - before == set()  # no process left behind
    print(f"200 executions in {elapsed:.1f}s: {json.dumps(metrics)}")
