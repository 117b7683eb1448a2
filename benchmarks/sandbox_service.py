"""Sandbox service benchmark: 1,000 sessions through `reroll sandbox serve`, at most 64 at once.

    .venv/bin/python benchmarks/sandbox_service.py [--sessions 1000] [--concurrency 64]

The service is started as a user starts it (a subprocess on a free loopback port). Each of
``--concurrency`` callers loops: create a session, run one command in it (its output is
checked), close it, until ``--sessions`` sessions were made. Then one session is prepared (a
file, a cwd, a variable) and forked 16 times, one fork at a time; every fork is checked and all
are closed. Latencies are measured by the client around each HTTP call (``*_ms``), and by
the service around the work itself (``service_*_ms``, from ``GET /stats``): the difference is
HTTP and the client's own CPU, which shares the machine.

After the run it counts what leaked: sessions the service still lists, session tmpfs mounts
beyond the warm sandboxes' while it runs, and, once it has exited (SIGTERM), any of its
processes still alive and any session mount left. The last line is JSON with
``create_p50_ms``, ``create_p99_ms`` (goal <= 1000 on 2 cores), ``exec_p50_ms``,
``fork_p50_ms``, ``failures`` (goal 0) and the leak counts (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reroll.sandbox import SessionClient  # noqa: E402
from reroll.sandbox.metrics import percentile  # noqa: E402


def session_mounts() -> int:
    with open("/proc/self/mountinfo") as handle:
        return sum("reroll-session " in line for line in handle)


def descendants(root: int) -> set[int]:
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z":
                parent[int(name)] = int(fields[1])
    found = set()
    for pid in parent:
        cursor = pid
        while cursor in parent and cursor > 1:
            cursor = parent[cursor]
            if cursor == root:
                found.add(pid)
                break
    return found


def start_service(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    config = Path(tempfile.mkdtemp(prefix="reroll-bench-")) / "sessions.yaml"
    config.write_text(f"sessions:\n  warm: {args.warm}\n  max_starting: {args.max_starting}\n"
                      f"  max_sessions: {args.concurrency + 64}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reroll.cli", "sandbox", "serve", "--port", "0", "--config",
         str(config)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    shutil.rmtree(config.parent, ignore_errors=True)  # read at the service's start
    match = re.search(r"http://[\d.]+:\d+", line)
    if match is None:
        proc.kill()
        raise SystemExit(f"the service did not start: {line!r}")
    return proc, match.group(0)


async def churn(client: SessionClient, args: argparse.Namespace, stats: dict) -> None:
    todo = iter(range(args.sessions))

    async def worker() -> None:
        for i in todo:
            try:
                t0 = time.perf_counter()
                s = await client.create(ttl_s=300)
                t1 = time.perf_counter()
                r = await s.exec(f"echo $(( {i} * {i} ))")
                t2 = time.perf_counter()
                await s.close()
                stats["create"].append(t1 - t0)
                stats["exec"].append(t2 - t1)
                if r.stdout != f"{i * i}\n":
                    stats["failures"]["wrong_output"] = stats["failures"].get("wrong_output", 0) + 1
            except Exception as exc:  # counted, the run goes on
                key = type(exc).__name__
                stats["failures"][key] = stats["failures"].get(key, 0) + 1
                stats["errors"].append(str(exc)[:300])
            done = len(stats["create"]) + sum(stats["failures"].values())
            if done % 100 == 0:
                print(f"  {done}/{args.sessions} sessions", flush=True)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def forks(client: SessionClient, args: argparse.Namespace, stats: dict) -> None:
    source = await client.create(ttl_s=300)
    await source.exec("mkdir app && cd app && echo prepared > state && export STEP=ready")
    made = []
    for _ in range(args.forks):
        t0 = time.perf_counter()
        (copy,) = await source.fork(1)
        stats["fork"].append(time.perf_counter() - t0)
        made.append(copy)
    for copy in made:
        r = await copy.exec("pwd; cat state; echo $STEP")
        if r.stdout != "/work/app\nprepared\nready\n":
            stats["failures"]["bad_fork"] = stats["failures"].get("bad_fork", 0) + 1
        await copy.close()
    await source.close()


async def run(args: argparse.Namespace, url: str) -> dict:
    stats: dict = {"create": [], "exec": [], "fork": [], "failures": {}, "errors": []}
    async with SessionClient(url, timeout_s=600) as client:
        started = time.perf_counter()
        await churn(client, args, stats)
        churn_s = time.perf_counter() - started
        await forks(client, args, stats)
        left = await client.list()
        health = await client.health()
        metrics = await client.metrics()
        served = await client.stats()
    service_failures = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'reroll_sandbox_session_failures_total\{cause="([^"]+)"\} (\S+)', metrics)}
    return {"stats": stats, "churn_s": churn_s, "leaked_sessions": len(left),
            "mounts_at_end": session_mounts(), "warm": health["warm"],
            "service_failures": service_failures, "served": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--forks", type=int, default=16)
    parser.add_argument("--warm", type=int, default=8, help="the service's warm sandboxes")
    parser.add_argument("--max-starting", type=int, default=8,
                        help="the service's cap on sessions starting at once")
    args = parser.parse_args()
    mounts_before = session_mounts()
    service, url = start_service(args)
    print(f"service at {url}; {args.sessions} sessions, {args.concurrency} at once", flush=True)
    try:
        cpu0 = os.times()
        out = asyncio.run(run(args, url))
        tree = descendants(service.pid)
        fields = Path(f"/proc/{service.pid}/stat").read_text().rsplit(")", 1)[1].split()
        service_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        cpu1 = os.times()
        client_cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=120)
    time.sleep(0.5)
    leaked_procs = sum(1 for pid in tree if os.path.exists(f"/proc/{pid}"))
    stats = out["stats"]
    ms = 1000.0
    failures = sum(stats["failures"].values())
    infra = {k: v for k, v in out["service_failures"].items() if k not in ("warm_died",)}
    figures = {
        "sessions": args.sessions,
        "concurrency": args.concurrency,
        "create_p50_ms": round(percentile(stats["create"], 50) * ms, 1),
        "create_p99_ms": round(percentile(stats["create"], 99) * ms, 1),
        "exec_p50_ms": round(percentile(stats["exec"], 50) * ms, 1),
        "exec_p99_ms": round(percentile(stats["exec"], 99) * ms, 1),
        "fork_p50_ms": round(percentile(stats["fork"], 50) * ms, 1),
        "service_create_p50_ms": round(out["served"]["create_p50_ms"], 1),
        "service_create_p99_ms": round(out["served"]["create_p99_ms"], 1),
        "service_exec_p50_ms": round(out["served"]["exec_p50_ms"], 1),
        "sessions_per_s": round(args.sessions / out["churn_s"], 1),
        "failures": failures,
        "failures_by_cause": {**stats["failures"], **{f"service:{k}": v for k, v in infra.items()}},
        "leaked_sessions": out["leaked_sessions"],
        "leaked_processes": leaked_procs,
        # mounts the run added: those left while the service ran beyond its warm sandboxes, and
        # any left after it stopped (mounts already there, from other runs, are not this one's)
        "leaked_mounts": max(out["mounts_at_end"] - mounts_before - out["warm"], 0)
        + max(session_mounts() - mounts_before, 0),
        "service_cpu_s": round(service_cpu, 1),
        "client_cpu_s": round(client_cpu, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for error in stats["errors"][:5]:
        print("error:", error)
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
