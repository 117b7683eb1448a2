"""A user's environment cannot hang the run: a sync step that never returns is abandoned at
`env.step_timeout_s` (and nothing waits for it at the end)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reroll.envs import EnvError
from reroll.envs.base import step_async

ROOT = Path(__file__).resolve().parents[2]

BAD_ENVS = '''
import os
import time


class Crash:
    """Ends its own process at the first step, as a buggy native extension might."""

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        os._exit(7)


class Stuck:
    """A step that never returns."""

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        time.sleep(10**6)


class Pid:
    def reset(self, seed=None):
        return str(os.getpid()), {}

    def step(self, action):
        return str(os.getpid()), 1.0, True, False, {}
'''


@pytest.fixture
def bad_envs(tmp_path, monkeypatch):
    """`bad_envs.py` in a fresh working directory, as a user's project holds it."""
    (tmp_path / "bad_envs.py").write_text(BAD_ENVS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("bad_envs", None)


def _python(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_sync_step_that_never_returns_is_abandoned_and_the_process_exits(bad_envs):
    # asyncio's default executor, which ran sync steps, is joined by asyncio.run at its end:
    # this process hung there for ever.
    started = time.monotonic()
    done = _python("""
        import asyncio
        from reroll.envs import EnvError, make_env
        from reroll.envs.base import step_async
        try:
            asyncio.run(step_async(make_env("bad_envs:Stuck"), "x", 0.2))
        except EnvError as e:
            print(e)
        """, bad_envs, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "env step took longer than 0.2s"
    assert time.monotonic() - started < 30


def test_sys_exit_in_a_step_fails_the_episode_not_the_caller():
    class Exits:
        def step(self, action):
            sys.exit(3)

    with pytest.raises(EnvError, match="env step raised SystemExit: 3"):
        asyncio.run(step_async(Exits(), "x", 5))
