"""A process killed with SIGKILL runs no handler, so its sessions' tmpfs mounts outlive it; the
next `SessionManager` to start on the machine removes them (its owner is gone), and never those
of a manager still alive."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from reroll.sandbox import SessionManager, SessionsConfig
from reroll.sandbox.sessions import sweep_stale

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KILLED = """
import asyncio, os, sys
from reroll.sandbox import SessionManager, SessionsConfig

async def main():
    manager = SessionManager(SessionsConfig(warm=1))
    await manager.start()
    session = await manager.create()
    await session.exec("echo kept > f")
    await asyncio.sleep(0.5)  # the warm sandbox starts
    print(manager.root, flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""


def mounts_under(path: str) -> int:
    with open("/proc/self/mountinfo") as handle:
        return sum("reroll-session " in line and line.split()[4].startswith(path)
                   for line in handle)


def test_the_mounts_of_a_killed_process_are_swept_and_a_live_managers_are_kept():
    scratch = tempfile.mkdtemp(prefix="reroll-test-sweep-")
    os.chmod(scratch, 0o711)  # the sandbox uid must reach the sessions below it
    try:
        proc = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": scratch},
                              timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        dead = proc.stdout.strip()
        assert mounts_under(dead) == 2 * (os.geteuid() == 0)  # its session and warm one: left

        async def live_manager() -> tuple[int, int, bool]:
            async with SessionManager(SessionsConfig(warm=0)) as live:  # its start sweeps
                await live.create()
                swept = sweep_stale(scratch, live.workdir)  # again: the live one stays
                return swept, mounts_under(live.root), os.path.isdir(dead)

        tempfile.tempdir, before = scratch, tempfile.tempdir
        try:
            swept, live_mounts, dead_left = asyncio.run(live_manager())
        finally:
            tempfile.tempdir = before
        assert not dead_left and mounts_under(dead) == 0 and swept == 0
        assert live_mounts == (os.geteuid() == 0)  # the live manager's own session is kept
        assert mounts_under(scratch) == 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
