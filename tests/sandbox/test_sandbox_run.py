"""`Sandbox.run`: the execution contract, limits and their classification, backends."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

import pytest
from pydantic import ValidationError

from reroll.sandbox import (
    Limits,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    parse_size,
)
from reroll.sandbox.process import SandboxProcess

pytestmark = pytest.mark.unit


def run(sandbox, code=None, **kwargs):
    return asyncio.run(sandbox.run(code, **kwargs))


def test_stdin_stdout_and_unicode_round_trip(sandbox):
    result = run(sandbox, "import sys\nprint(sys.stdin.read()[::-1], end='')", stdin="héllo ✓")
    assert result.ok and result.stdout == "✓ olléh"
    assert result.exit_code == 0 and result.limit is None and not result.timed_out
    assert result.wall_s > 0 and result.total_s >= result.wall_s and result.cpu_s > 0


def test_large_stdin_is_fed_without_deadlock(sandbox):
    data = "x" * (3 << 20)
    result = run(sandbox, "import sys\nprint(len(sys.stdin.read()))", stdin=data)
    assert result.stdout == f"{len(data)}\n"


def test_program_that_ignores_large_stdin_still_finishes(sandbox):
    result = run(sandbox, "print('done')", stdin=b"y" * (4 << 20))
    assert result.ok and result.stdout == "done\n"


def test_files_env_and_helper_modules(sandbox):
    files = {"helper.py": "VALUE = 41\n", "data/input.txt": b"\x00\x01binary", "cfg.json": "{}"}
    code = (
        "import helper, os\n"
        "print(helper.VALUE + 1, open('data/input.txt', 'rb').read(), os.environ['GREETING'])\n"
        "print(os.getcwd(), sorted(os.listdir('.')))\n"
    )
    result = run(sandbox, code, files=files, env={"GREETING": "hi"})
    assert result.ok, result.stderr
    first, second = result.stdout.splitlines()
    assert first == "42 b'\\x00\\x01binary' hi"
    assert second == "/work ['cfg.json', 'data', 'helper.py', 'main.py']"


def test_argv_programs_run_in_the_workdir(sandbox):
    result = run(sandbox, argv=["sh", "-c", "cat in.txt; echo $0; exit 3"], files={"in.txt": "a\n"})
    assert result.stdout == "a\nsh\n" and result.exit_code == 3
    assert result.failure == "exit_code" and result.limit is None
    script = run(
        sandbox,
        argv=[sandbox.python, "prog.py", "x"],
        files={"prog.py": "import sys; print(sys.argv[1:])"},
    )
    assert script.stdout == "['x']\n"
    missing = run(sandbox, argv=["no-such-binary"])
    assert missing.exit_code == 127 and "cannot execute" in missing.stderr


def test_exceptions_exit_codes_and_exit_builtins(sandbox):
    crash = run(sandbox, "def f():\n    raise ValueError('boom')\nf()\n")
    assert crash.exit_code == 1 and not crash.ok
    assert 'File "/work/main.py", line 3' in crash.stderr and "ValueError: boom" in crash.stderr
    assert "<string>" not in crash.stderr  # the launcher's own frame is not shown
    assert run(sandbox, "import sys\nsys.exit(7)").exit_code == 7
    assert run(sandbox, "exit(5)").exit_code == 5
    assert run(sandbox, "quit()").exit_code == 0
    syntax = run(sandbox, "def broken(:\n")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_killed_by_signal_reports_the_signal(sandbox):
    result = run(sandbox, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.exit_code == 128 + 11 and result.signal == 11 and not result.ok


def test_output_before_the_timeout_is_kept(sandbox):
    code = "import time\nprint('partial', flush=True)\ntime.sleep(60)"
    result = run(sandbox, code, limits=Limits(wall_time_s=0.5))
    assert result.timed_out and result.stdout == "partial\n" and result.signal == 9


def test_file_size_limit(sandbox):
    code = "open('big', 'wb').write(b'x' * (3 << 20))"
    result = run(sandbox, code, limits=Limits(file_size_bytes="1M"))
    assert result.limit == "file_size" and "File too large" in result.stderr


def test_open_files_limit(sandbox):
    code = "files = [open('/dev/null') for _ in range(1000)]"
    result = run(sandbox, code, limits=Limits(open_files=64))
    assert result.limit == "open_files"


def test_process_limit_applies_to_threads(sandbox):
    code = (
        "import threading, time\n"
        "threads = [threading.Thread(target=time.sleep, args=(0.3,)) for _ in range(64)]\n"
        "for t in threads: t.start()\n"
    )
    result = run(sandbox, code, limits=Limits(processes=8))
    assert result.limit == "processes" and "can't start new thread" in result.stderr


def test_memory_limit_allows_what_fits(sandbox):
    code = "x = bytearray(100 << 20)\nprint(len(x) >> 20)"
    assert run(sandbox, code, limits=Limits(memory_bytes="512M")).stdout == "100\n"
    assert run(sandbox, code, limits=Limits(memory_bytes="64M")).limit == "memory"


def test_the_system_interpreter_is_used(sandbox):
    result = run(
        sandbox, "import sys\nprint(sys.executable, sys.flags.isolated, sys.flags.no_site)"
    )
    exe, isolated, no_site = result.stdout.split()
    if os.access("/usr/bin/python3", os.X_OK):
        assert exe.startswith("/usr/bin/python3")
    assert isolated == "1" and no_site == "1"


def test_cancelling_a_run_kills_the_sandbox(sandbox, host):
    before = host.descendants()

    async def scenario():
        task = asyncio.create_task(sandbox.run("import time\ntime.sleep(60)"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert host.descendants() - before == set()


def test_a_run_cancelled_just_as_its_sandbox_is_ready_stays_cancelled(sandbox, host):
    """`Sandbox.run` is start + execute; here the caller is cancelled in the very step the
    start-up handshake ends. The cancellation must not be lost: the run raises `CancelledError`
    at once and the sandbox is killed. (Python 3.11's `asyncio.wait_for` returned the started
    sandbox instead, and a code-reward test cancelled by all-or-nothing ran for its whole time
    limit.)"""
    before = host.descendants()
    runner: asyncio.Task | None = None

    class CancelledWhenReady(SandboxProcess):
        async def _handshake(self, info):
            await super()._handshake(info)
            runner.cancel()

    async def run_cancelled_when_ready():
        job = sandbox.job("import time\ntime.sleep(8)\nprint('ran to the end')")
        size = job.limits.tmpfs_bytes
        spec = sandbox.backend.launch_spec(size)
        proc = await CancelledWhenReady.start(spec, size, sandbox.config.spawn_timeout_s)
        return await sandbox.execute(proc, job, time.perf_counter())

    async def scenario():
        nonlocal runner
        runner = asyncio.create_task(run_cancelled_when_ready())
        with pytest.raises(asyncio.CancelledError):
            await runner

    started = time.perf_counter()
    asyncio.run(scenario())
    assert time.perf_counter() - started < 6
    assert host.descendants() - before == set()


def test_bad_requests_are_rejected_before_anything_runs(sandbox):
    with pytest.raises(ValueError, match="exactly one"):
        run(sandbox, "print(1)", argv=["true"])
    with pytest.raises(ValueError, match="exactly one"):
        run(sandbox)
    for name in ("../escape.py", "/etc/x", "", "a/../../b"):
        with pytest.raises(ValueError, match="relative path"):
            run(sandbox, "print(1)", files={name: "x"})
    with pytest.raises(ValueError, match="main.py"):
        run(sandbox, "print(1)", files={"main.py": "x"})


def test_missing_bubblewrap_is_refused_with_the_fix(monkeypatch, tmp_path):
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox(SandboxConfig(bwrap_path=str(tmp_path / "bwrap")))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox()


def test_broken_interpreter_fails_to_start_with_a_message():
    sandbox = Sandbox(SandboxConfig(python="/bin/false", spawn_timeout_s=5))
    with pytest.raises(SandboxError, match="failed to start"):
        run(sandbox, "print(1)")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root drops to an unprivileged uid")
def test_interpreter_in_a_private_home_is_refused_as_root():
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if not exe.startswith("/root/"):
        pytest.skip("this interpreter is not under /root")
    with pytest.raises(SandboxUnavailable, match="not reachable"):
        Sandbox(SandboxConfig(python=exe))


def test_rlimit_mode_is_explicit_and_says_it_is_weak(caplog, host):
    with caplog.at_level(logging.WARNING, logger="reroll.sandbox"):
        sandbox = Sandbox(SandboxConfig(backend="rlimit"))
    assert any("WEAK isolation" in record.getMessage() for record in caplog.records)
    before = host.descendants()
    result = run(sandbox, "import os\nprint(input(), os.getcwd())", stdin="ok")
    answer, workdir = result.stdout.split()
    assert result.ok and answer == "ok" and os.path.basename(workdir).startswith("reroll-sandbox-")
    assert not os.path.exists(workdir)  # the private directory is removed after the run
    timeout = run(sandbox, "import time\ntime.sleep(30)", limits=Limits(wall_time_s=0.5))
    assert timeout.timed_out
    assert host.descendants() - before == set()


def test_limits_schema():
    assert (
        parse_size("512M") == 512 << 20 and parse_size("1g") == 1 << 30 and parse_size(4096) == 4096
    )
    assert Limits(memory_bytes="256M").memory_bytes == 256 << 20
    with pytest.raises(ValidationError):
        Limits(unknown=1)
    with pytest.raises(ValidationError):
        Limits(wall_time_s=0)
    with pytest.raises(ValidationError):
        Limits(memory_bytes="lots")
    with pytest.raises(ValidationError):
        SandboxConfig(workdir="/usr")
