"""A user's environment cannot hang or end the run: a sync step that never returns is abandoned
at `env.step_timeout_s` (and nothing waits for it at the end), and an env that exits its
process fails only its episodes when it runs in a process of its own (`env.isolation`)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reroll.api import _env_factory
from reroll.config.agentic import EnvConfig
from reroll.config.errors import ConfigError
from reroll.envs import EnvError, make_env
from reroll.envs.base import reset_async, step_async
from reroll.envs.process import EnvProcesses
from reroll.pipelines.agentic import env_processes

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


class StuckReset:
    """A reset that never returns."""

    def reset(self, seed=None):
        time.sleep(10**6)

    def step(self, action):
        return "", 0.0, True, False, {}


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


async def _episode(env, timeout_s: float) -> str:
    """Reset and one step; the EnvError's words if either fails."""
    try:
        await reset_async(env, 1, timeout_s)
        return (await step_async(env, "x", timeout_s))[0]
    except EnvError as e:
        return str(e)


def test_a_sync_step_or_reset_that_never_returns_is_abandoned_and_the_process_exits(bad_envs):
    # asyncio's default executor, which ran sync calls, is joined by asyncio.run at its end:
    # this process hung there for ever.
    started = time.monotonic()
    done = _python("""
        import asyncio
        from reroll.envs import EnvError, make_env
        from reroll.envs.base import reset_async, step_async
        for call in (lambda: step_async(make_env("bad_envs:Stuck"), "x", 0.2),
                     lambda: reset_async(make_env("bad_envs:StuckReset"), 0, 0.2)):
            try:
                asyncio.run(call())
            except EnvError as e:
                print(e)
        """, bad_envs, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "env step took longer than 0.2s", "env reset took longer than 0.2s"]
    assert time.monotonic() - started < 30


def test_sys_exit_in_a_step_fails_the_episode_not_the_caller():
    class Exits:
        def step(self, action):
            sys.exit(3)

    with pytest.raises(EnvError, match="env step raised SystemExit: 3"):
        asyncio.run(step_async(Exits(), "x", 5))


def test_an_env_that_ends_its_process_fails_its_episode_and_the_next_gets_a_new_one(
        bad_envs, capfd):
    hosts = EnvProcesses(functools.partial(make_env, "bad_envs:Crash"), "bad_envs:Crash")
    try:
        first = hosts.pids()
        error = asyncio.run(_episode(hosts.make(), 10))
        assert error.startswith("env step: the environment's process") and \
            "exited with code 7" in error
        assert "(env seed 1)" in capfd.readouterr().err  # the run's last words name the call
        assert asyncio.run(_episode(hosts.make(), 10)) != error  # a new process, a new pid
        assert hosts.pids() != first
    finally:
        hosts.close()


def test_a_stuck_step_in_a_process_times_out_and_closing_kills_the_process(bad_envs):
    hosts = EnvProcesses(functools.partial(make_env, "bad_envs:Stuck"), "bad_envs:Stuck")
    process = hosts.hosts[0].process
    assert asyncio.run(_episode(hosts.make(), 0.3)) == "env step took longer than 0.3s"
    hosts.close()
    assert process.poll() is not None


def test_auto_isolation_puts_user_envs_in_a_process_and_builtins_in_threads(bad_envs):
    user = EnvConfig(id="bad_envs:Pid")
    hosts = env_processes(user, functools.partial(make_env, user.id), given=False)
    try:
        assert asyncio.run(_episode(hosts.make(), 10)) == str(hosts.pids()[0]) != str(os.getpid())
    finally:
        hosts.close()
    built_in = EnvConfig(id="guess_number")
    assert env_processes(built_in, functools.partial(make_env, "guess_number"), False) is None
    assert env_processes(user.model_copy(update={"isolation": "thread"}), None, False) is None
    assert env_processes(user, lambda: make_env(user.id), given=True) is None  # Python API


def test_an_object_given_to_the_python_api_runs_in_a_process_when_importable(bad_envs):
    sys.path.insert(0, str(bad_envs))  # the user's script imports its module
    import bad_envs as module

    env = EnvConfig(id="bad_envs.Pid", isolation="process")
    hosts = env_processes(env, _env_factory(module.Pid, {}), given=True)
    try:
        assert asyncio.run(_episode(hosts.make(), 10)) == str(hosts.pids()[0]) != str(os.getpid())
    finally:
        hosts.close()

    class Local:  # a class no other process can import
        def reset(self, seed=None):
            return "", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    with pytest.raises(ConfigError, match="env.isolation: process needs an environment a new "
                                          "process can import"):
        env_processes(env, _env_factory(Local, {}), given=True)


@pytest.mark.e2e
def test_agent_loop_survives_a_stuck_and_a_crashing_user_env(bad_envs, tiny_model):
    """The tiny model's episodes (2 per case) in a user's envs: one whose sync step never
    returns (threads), one that ends its process (its own process, the default for user envs).
    Every episode fails as an env error with its reason; the process then exits at once."""
    started = time.monotonic()
    done = _python(f"""
        import functools, json, torch
        from reroll.config.agentic import EnvConfig
        from reroll.engines.base import SamplingParams
        from reroll.engines.hf import HFEngine
        from reroll.envs import make_env
        from reroll.models.loading import load_model, load_tokenizer
        from reroll.pipelines.agentic import env_processes
        from reroll.rollout.agent_loop import AgentJob, run_episodes

        torch.set_num_threads(1)
        tok = load_tokenizer({tiny_model!r})
        engine = HFEngine(load_model({tiny_model!r}), 64, tok.pad_token_id)
        params = SamplingParams(4, 1.0, 1.0, 0, (tok.eos_token_id,))
        out = {{}}
        for name, isolation in (("Stuck", "thread"), ("Crash", "auto")):
            env = EnvConfig(id="bad_envs:" + name, isolation=isolation)
            factory = functools.partial(make_env, env.id)
            hosts = env_processes(env, factory, given=False)
            job = AgentJob(engine, tok, hosts.make if hosts else factory, params, max_turns=2,
                           max_context_tokens=128, step_timeout_s=0.5)
            trajectories, stats = run_episodes(job, [0], 2, run_seed=0, step=1)
            out[name] = [[t.finish_reason, t.reward_info.get("env_error")]
                         for t in trajectories]
            if hosts:
                hosts.close()
        print(json.dumps(out))
        """, bad_envs, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["Stuck"] == [["env_error", "env step took longer than 0.5s"]] * 2
    assert [reason for reason, _ in out["Crash"]] == ["env_error"] * 2
    assert all("exited with code 7" in error for _, error in out["Crash"])
    assert "reroll: env bad_envs:Crash: the environment's process" in done.stderr
    assert time.monotonic() - started < 90
