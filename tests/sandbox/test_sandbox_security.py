"""Attacks on the sandbox. Each test checks the attack was contained *and* that the host is
unchanged afterwards (no connection reached it, no file appeared, no process survived, the
parent and its neighbours are alive and untraced) — not just that the program ran."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from reroll.sandbox import Limits

pytestmark = pytest.mark.unit

PROJECT = Path(__file__).resolve().parents[2]
NS_PROBE = "import os as _o\nprint('NS=' + _o.readlink('/proc/self/ns/pid'), flush=True)\n"


def run(sandbox, code, **kwargs):
    return asyncio.run(sandbox.run(code, **kwargs))


def namespace_of(result) -> str:
    match = re.search(r"^NS=(pid:\[\d+\])$", result.stdout, re.MULTILINE)
    assert match, (result.stdout[-500:], result.stderr[-2000:])
    return match.group(1)


def json_line(result) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, (result.stdout[-500:], result.stderr[-2000:])
    return json.loads(lines[-1])


def assert_all_gone(host, result, before: set[int]) -> None:
    """No process of the sandbox's pid namespace is left, and no new child of this process."""
    assert host.procs_in_namespace(namespace_of(result)) == []
    assert host.descendants() - before == set()


def test_network_sockets_and_dns_are_unreachable(sandbox, host):
    name = f"reroll-sandbox-test-{uuid.uuid4().hex}"
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        tcp.settimeout(0.3)
        unix.bind("\0" + name)
        unix.listen()
        unix.settimeout(0.3)
        port = tcp.getsockname()[1]
        code = f"""
import json, socket
out = {{}}
def attempt(key, fn):
    try:
        fn()
        out[key] = "ok"
    except Exception as exc:
        out[key] = type(exc).__name__ + ": " + str(exc)
def tcp(addr):
    with socket.create_connection(addr, timeout=2) as s:
        s.sendall(b"escaped")
attempt("tcp_host_loopback", lambda: tcp(("127.0.0.1", {port})))
attempt("tcp_internet", lambda: tcp(("1.1.1.1", 80)))
attempt("tcp6", lambda: tcp(("::1", {port})))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("udp_dns", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"q", ("8.8.8.8", 53)))
attempt("abstract_unix", lambda: socket.socket(socket.AF_UNIX).connect("\\0{name}"))
out["interfaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
print(json.dumps(out))
"""
        before = host.descendants()
        result = run(sandbox, NS_PROBE + code)
        out = json_line(result)
        for key in ("tcp_host_loopback", "tcp_internet", "tcp6", "dns", "udp_dns", "abstract_unix"):
            assert out[key] != "ok", (key, out)
        assert out["interfaces"] == ["lo"]
        # Host side: nothing ever connected to the listeners.
        for listener in (tcp, unix):
            with pytest.raises(TimeoutError):
                listener.accept()
    assert_all_gone(host, result, before)


def test_host_files_and_parent_environment_are_invisible(sandbox, host, monkeypatch):
    secret = f"reroll-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("REROLL_TEST_SECRET", secret)
    targets = [
        str(PROJECT / "pyproject.toml"),
        str(Path(__file__).resolve()),
        "/etc/shadow",
        "/etc/passwd",
        "/root/.bashrc",
        os.path.realpath(sys.executable),
        f"/proc/{os.getpid()}/environ",
        "/proc/1/root/etc/shadow",
    ]
    code = f"""
import json, os
out = {{"env": dict(os.environ), "read": {{}}, "dumps": []}}
for path in {targets!r}:
    try:
        with open(path, "rb") as f:
            out["read"][path] = "READ " + f.read(200).decode("latin-1")
    except Exception as exc:
        out["read"][path] = "ERR " + type(exc).__name__
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("environ", "cmdline"):
            try:
                out["dumps"].append(open(f"/proc/{{pid}}/{{what}}", "rb").read().decode("latin-1"))
            except Exception:
                pass
out["root_listing"] = sorted(os.listdir("/"))
out["project_visible"] = os.path.exists({str(PROJECT)!r})
print(json.dumps(out))
"""
    before = host.descendants()
    result = run(sandbox, NS_PROBE + code)
    out = json_line(result)
    assert secret not in result.stdout and secret not in result.stderr
    assert "REROLL_TEST_SECRET" not in out["env"]
    assert all(value.startswith("ERR") for value in out["read"].values()), out["read"]
    assert not out["project_visible"]
    assert set(out["root_listing"]) <= {
        "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "work",
    }  # fmt: skip
    assert out["dumps"], "the sandbox sees its own processes"
    assert_all_gone(host, result, before)


def test_writes_outside_the_workdir_fail_and_private_ones_vanish(sandbox, host):
    token = f"reroll-{uuid.uuid4().hex}"
    read_only = ["/usr", "/etc", "/", "/dev", "/proc", "/bin", "/lib", str(PROJECT)]
    private = ["/tmp", "/work", "/dev/shm"]
    targets = [f"{d.rstrip('/')}/{token}" for d in read_only + private]
    code = f"""
import json
out = {{}}
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        out[path] = "written"
    except Exception as exc:
        out[path] = type(exc).__name__
print(json.dumps(out))
"""
    before = host.descendants()
    result = run(sandbox, NS_PROBE + code)
    out = json_line(result)
    for directory in read_only:
        assert out[f"{directory.rstrip('/')}/{token}"] != "written", out
    for directory in private:  # writable inside, but a private tmpfs that never reaches the host
        assert out[f"{directory}/{token}"] == "written", out
    for path in targets:
        assert not Path(path).exists(), f"{path} appeared on the host"
    assert_all_gone(host, result, before)


def test_fork_bomb_is_contained_and_other_sandboxes_keep_working(sandbox, host):
    limits = Limits(processes=24, wall_time_s=4, cpu_time_s=10)
    bomb = NS_PROBE + (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    before = host.descendants()

    async def scenario():
        bomb_task = asyncio.create_task(sandbox.run(bomb, limits=limits))
        await asyncio.sleep(1.5)
        during = len(host.descendants() - before)
        neighbour = await sandbox.run("print(6 * 7)", limits=Limits(wall_time_s=10))
        return await bomb_task, during, neighbour

    result, during, neighbour = asyncio.run(scenario())
    assert result.timed_out and result.limit == "wall_time"
    assert result.wall_s < 8
    # The host saw at most the bomb's allowance (+ the outer bwrap processes).
    assert during <= limits.processes + 4, during
    assert neighbour.ok and neighbour.stdout == "42\n", neighbour
    assert_all_gone(host, result, before)


def test_memory_bomb_hits_the_memory_limit(sandbox, host):
    limits = Limits(memory_bytes="256M", wall_time_s=20)
    code = NS_PROBE + "blocks = []\nwhile True:\n    blocks.append(bytearray(8 << 20))\n"
    before = host.descendants()
    result = run(sandbox, code, limits=limits)
    assert not result.ok and result.limit == "memory", result
    assert "MemoryError" in result.stderr
    assert_all_gone(host, result, before)


def test_filling_the_private_tmpfs_stops_at_its_size(sandbox, host):
    limits = Limits(tmpfs_bytes="8M", file_size_bytes="64M")
    code = (
        NS_PROBE
        + """
import json, os
out = {}
for directory in ("/tmp", "/work", "/dev/shm"):
    written = 0
    try:
        for i in range(1000):
            with open(f"{directory}/fill{i}", "wb") as f:
                f.write(b"x" * (1 << 20))
            written += 1 << 20
    except OSError as exc:
        out[directory + "_error"] = exc.errno
    out[directory] = written
print(json.dumps(out))
"""
    )
    before = host.descendants()
    result = run(sandbox, code, limits=limits)
    out = json_line(result)
    for directory in ("/tmp", "/work", "/dev/shm"):
        assert out[directory] <= 8 << 20, out
        assert out[directory + "_error"] == 28, out  # ENOSPC
    assert_all_gone(host, result, before)


def test_cpu_spin_hits_the_cpu_limit(sandbox, host):
    limits = Limits(cpu_time_s=1, wall_time_s=20)
    before = host.descendants()
    result = run(sandbox, NS_PROBE + "while True:\n    pass\n", limits=limits)
    assert result.limit == "cpu_time" and not result.timed_out, result
    # The kernel's RLIMIT_CPU check and the rusage it reports account CPU time differently; on a
    # virtualised CI machine rusage read 0.85 s at the 1 s limit's SIGXCPU.
    assert 0.5 <= result.cpu_s < 3.0
    assert result.wall_s < 10
    assert_all_gone(host, result, before)


def test_sleep_forever_is_killed_at_the_wall_clock(sandbox, host):
    code = NS_PROBE + (
        "import subprocess, time\nsubprocess.Popen(['sleep', '100000'])\ntime.sleep(100000)\n"
    )
    before = host.descendants()
    started = time.perf_counter()
    result = run(sandbox, code, limits=Limits(wall_time_s=1))
    elapsed = time.perf_counter() - started
    assert result.timed_out and result.limit == "wall_time"
    assert 1.0 <= result.wall_s < 4 and elapsed < 8
    assert_all_gone(host, result, before)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_capped(sandbox, host, stream):
    limits = Limits(output_bytes="1M", wall_time_s=30)
    code = NS_PROBE + f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)\n"
    before = host.descendants()
    started = time.perf_counter()
    result = run(sandbox, code, limits=limits)
    assert result.limit == "output" and result.output_truncated
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 1 << 20
    assert time.perf_counter() - started < 10
    assert_all_gone(host, result, before)


def _sentinel() -> subprocess.Popen:
    """A host process of the same uid the sandbox runs as: only the pid namespace protects it."""
    kwargs = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    return subprocess.Popen(["sleep", "300"], **kwargs)


def _tracer_pid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^TracerPid:\s+(\d+)", status, re.MULTILINE).group(1))


def test_killing_or_tracing_the_parent_and_neighbours_fails(sandbox, host):
    sentinel = _sentinel()
    try:
        targets = [os.getpid(), os.getppid(), sentinel.pid]
        code = (
            NS_PROBE
            + f"""
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
out = {{"kill": {{}}, "ptrace": {{}}}}
for pid in {targets!r}:
    try:
        os.kill(pid, signal.SIGKILL)
        out["kill"][pid] = "sent"
    except OSError as exc:
        out["kill"][pid] = exc.errno
    rc = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    out["ptrace"][pid] = "attached" if rc == 0 else ctypes.get_errno()
for pid in (os.getppid(), 1, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
out["ppid"] = os.getppid()
print(json.dumps(out))
"""
        )
        before = host.descendants()
        result = run(sandbox, code)
        out = json_line(result)
        assert result.ok, result
        for pid in targets:
            assert out["kill"][str(pid)] == 3, out  # ESRCH: not even visible
            assert out["ptrace"][str(pid)] == 3, out
        assert out["ppid"] == 1  # the sandbox's own init, not a host process
        assert sentinel.poll() is None, "the neighbour process was killed"
        assert _tracer_pid(os.getpid()) == 0 and _tracer_pid(sentinel.pid) == 0
        assert_all_gone(host, result, before)
    finally:
        sentinel.kill()
        sentinel.wait()


def test_host_processes_are_invisible_in_proc(sandbox, host):
    code = (
        NS_PROBE
        + """
import json, os
procs = {}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            procs[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        except OSError:
            procs[pid] = "?"
print(json.dumps({"procs": procs, "loadavg_ok": os.path.exists("/proc/loadavg")}))
"""
    )
    before = host.descendants()
    result = run(sandbox, code)
    procs = json_line(result)["procs"]
    assert set(procs) <= {"1", "2"}, procs  # the launcher (init) and the program
    host_cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    for cmdline in procs.values():
        assert "python" in cmdline and "bwrap" not in cmdline
        assert cmdline.strip() != host_cmdline.strip()
    assert "pytest" not in result.stdout
    assert_all_gone(host, result, before)


def test_background_processes_do_not_outlive_the_run(sandbox, host):
    token = f"reroll-bg-{uuid.uuid4().hex}"
    code = (
        NS_PROBE
        + f"""
import os, subprocess, sys
if os.fork() == 0:  # a classic double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(100000)", {token!r}])
    os._exit(0)
subprocess.Popen(["sh", "-c", "trap '' HUP TERM INT; sleep 100000; : {token}"], start_new_session=True)
subprocess.Popen(["sh", "-c", "sleep 100000 # {token}"], stdout=subprocess.DEVNULL)
print("spawned")
"""
    )
    before = host.descendants()
    started = time.perf_counter()
    result = run(sandbox, code)
    assert result.ok and "spawned" in result.stdout, result
    assert time.perf_counter() - started < 5  # the run did not wait for its children
    assert host.procs_with(token) == []
    assert_all_gone(host, result, before)


def test_no_privileges_descriptors_or_nested_namespaces(sandbox, host):
    code = (
        NS_PROBE
        + """
import json, os, subprocess
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
nested = subprocess.run(["unshare", "--user", "true"], capture_output=True)
print(json.dumps({
    "uid": os.getuid(), "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(), "fds": sorted(os.listdir("/proc/self/fd")),
    "nested_userns_rc": nested.returncode, "hostname": os.uname().nodename,
}))
"""
    )
    before = host.descendants()
    result = run(sandbox, code)
    out = json_line(result)
    assert out["uid"] != 0
    assert out["cap_eff"] == out["cap_bnd"] == "0000000000000000"
    assert out["no_new_privs"] == "1"
    assert out["nested_userns_rc"] != 0
    assert out["hostname"] == "sandbox"
    # Only stdin/stdout/stderr (+ the one listdir itself opened): the job channel is closed.
    assert len(out["fds"]) <= 4 and {"0", "1", "2"} <= set(out["fds"])
    assert_all_gone(host, result, before)


def test_killing_signals_from_inside_cannot_stop_the_host_pipeline(sandbox, host):
    """The program stops its own init and closes its pipes: the host still gets a result."""
    code = NS_PROBE + (
        "import os, signal, time\n"
        "for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGINT):\n"
        "    os.kill(1, sig)\n"
        "os.close(0)\n"
        "time.sleep(0.2)\n"
        "print('still here', flush=True)\n"
        "os.close(1); os.close(2)\n"
        "time.sleep(100000)\n"
    )
    before = host.descendants()
    result = run(sandbox, code, limits=Limits(wall_time_s=1.5))
    assert "still here" in result.stdout
    assert result.timed_out and result.limit == "wall_time"
    assert_all_gone(host, result, before)
