"""Limits that a hostile test found unbounded (issue 16, section 7): memory in memfd files,
inodes of the private tmpfs, ptrace of the sandbox's init, and malformed `env` / `files` names
that used to crash the in-sandbox launcher."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from reroll.sandbox import Limits, Sandbox, SandboxConfig

pytestmark = pytest.mark.unit


def run(sandbox, code, **kwargs):
    return asyncio.run(sandbox.run(code, **kwargs))


def json_line(result) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, (result.stdout[-500:], result.stderr[-2000:])
    return json.loads(lines[-1])


def test_memory_in_memfd_files_cannot_be_held(sandbox):
    """A memfd's pages are charged to no rlimit: one program held 1920 MiB under a 1 GiB limit.
    The seccomp filter denies memfd_create; ordinary memory still works."""
    code = """
import errno, json, os
out = {}
try:
    fd = os.memfd_create("hold")
    os.ftruncate(fd, 256 << 20)
    os.pwrite(fd, b"x" * (1 << 20), 0)
    out["memfd"] = "created"
except OSError as exc:
    out["memfd"] = exc.errno
out["heap"] = len(bytearray(64 << 20))
print(json.dumps(out))
"""
    result = run(sandbox, code, limits=Limits(memory_bytes=256 << 20))
    out = json_line(result)
    assert result.ok, result
    assert out == {"memfd": 1, "heap": 64 << 20}  # EPERM


def test_seccomp_program_shapes():
    """Classic BPF of 8-byte instructions; an unknown architecture gets none (and a warning)."""
    from reroll.sandbox.seccomp import filter_program

    program = filter_program("x86_64")
    assert program is not None and len(program) % 8 == 0 and len(program) // 8 == 7
    assert len(filter_program("aarch64")) // 8 == 6
    assert filter_program("sparc") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the host caps tmpfs inodes only as root")
def test_tmpfs_inodes_are_capped(sandbox):
    """Empty files take no space, so the size cap alone let a program create 800,000 of them."""
    code = """
import json, os
counts = {}
for folder in (".", "/tmp", "/dev/shm"):
    n = 0
    try:
        while n < 100000:
            open(os.path.join(folder, f"f{n}"), "w").close()
            n += 1
    except OSError as exc:
        counts[folder] = [n, exc.errno]
    else:
        counts[folder] = [n, None]
print(json.dumps(counts))
"""
    small = Sandbox(SandboxConfig(tmpfs_inodes=500), Limits(wall_time_s=30))
    out = json_line(run(small, code))
    for folder in (".", "/tmp", "/dev/shm"):
        created, err = out[folder]
        assert err == 28 and 400 < created < 500, out  # ENOSPC near the cap (the root dir counts)
    assert json_line(run(sandbox, code.replace("100000", "2000")))["."] == [2000, None]


def test_the_sandbox_init_cannot_be_traced_or_its_memory_opened(sandbox):
    """A program that stops its init (PTRACE_ATTACH) made its own exit look like a wall-clock
    kill; /proc/1/mem would even let it rewrite the init."""
    code = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {"ptrace": libc.ptrace(16, 1, None, None), "errno": ctypes.get_errno()}
try:
    open("/proc/1/mem", "rb").close()
    out["mem"] = "opened"
except OSError as exc:
    out["mem"] = exc.errno
print(json.dumps(out))
"""
    result = run(sandbox, code, limits=Limits(wall_time_s=10))
    out = json_line(result)
    assert out == {"ptrace": -1, "errno": 1, "mem": 13}, out  # EPERM, EACCES
    assert result.ok and not result.timed_out


def test_the_program_itself_stays_an_ordinary_process(sandbox):
    """The init is non-dumpable; the program is not (its own /proc files are readable)."""
    result = run(sandbox, "print(open('/proc/self/status').read().count('Pid'))")
    assert result.ok and int(result.stdout) >= 1


@pytest.mark.parametrize("env, problem", [
    ({"": "x"}, "not valid"),
    ({"A=B": "x"}, "not valid"),
    ({"A\0B": "x"}, "not valid"),
    ({"A": "x\0y"}, "NUL"),
])
def test_invalid_env_is_refused_on_the_host(sandbox, env, problem):
    with pytest.raises(ValueError, match=problem):
        run(sandbox, "print(1)", env=env)
    with pytest.raises(ValueError, match=problem):
        SandboxConfig(env=env)


def test_nul_bytes_in_file_names_and_argv_are_refused_on_the_host(sandbox):
    with pytest.raises(ValueError, match="NUL"):
        run(sandbox, "print(1)", files={"a\0b.py": "x"})
    with pytest.raises(ValueError, match="NUL"):
        asyncio.run(sandbox.run(argv=["echo", "a\0b"]))
