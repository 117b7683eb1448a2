"""`env.id: terminal_tasks` in sandbox sessions (issue 45, part 3 "Faults"): the episode runs in
one session (cwd and variables persist, the tests cannot be touched by what the agent left), and a
session lost to the service's death, its time to live or a crash fails the episode as an
infrastructure failure naming the cause, never a reward of 0; once the service is back, new
episodes use it. Nothing leaks: the episode's session is closed when it ends."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from reroll.envs import EnvError, make_env, reset_async, step_async
from reroll.envs.process import EnvProcesses
from reroll.sandbox import shared
from tests.envs.test_terminal_tasks import hand_written

pytestmark = [pytest.mark.unit, pytest.mark.bwrap]

ROOT = Path(__file__).resolve().parents[2]
MOUNTS = os.geteuid() == 0
"""A session's disk is a tmpfs mount only when the host process is root."""
LOCAL = {"mode": "local", "warm": 0, "reap_interval_s": 0.2}


def session_mounts(under: str) -> int:
    """Session tmpfs mounts (those below ``under``: other runs on the machine have theirs)."""
    with open("/proc/self/mountinfo") as handle:
        return sum("reroll-session " in line and line.split()[4].startswith(under)
                   for line in handle)


def live_sessions() -> int:
    return len(shared._live)


def test_an_episode_runs_in_one_session_and_the_tests_are_out_of_the_agents_reach(tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host-only\n")
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=12,
                   sessions=LOCAL)
    env.reset(0)
    out, *_ = env.step("mkdir sub && cd sub && export GREETING=hello")
    assert out == "[exit 0]"
    out, *_ = env.step("pwd; echo $GREETING")
    assert out == "/work/sub\nhello\n[exit 0]"  # cwd and variables persist
    out, *_ = env.step(f"cat {secret}; ls {tmp_path}")  # no host path is readable
    assert "host-only" not in out and "No such file" in out
    env.step("cd /work && chmod +x tool.sh")
    # what an agent could leave to fool the tests: a PATH with a fake `awk`, a BASH_ENV that
    # ends every bash at once (exit 0: success), a function, and a daemon that writes a full
    # reward once the tests' reward file appears
    env.step("mkdir fake; printf '#!/bin/sh\\necho 1\\n' > fake/awk; echo 'exit 0' > fake/rc;"
             " chmod +x fake/*; awk() { echo 1; }; export -f awk;"
             " export PATH=/work/fake:$PATH BASH_ENV=/work/fake/rc")
    env.step("setsid sh -c 'while :; do echo 1 > /tmp/.reroll-reward; sleep 0.05; done' "
             ">/dev/null 2>&1 &")
    disk = env._box[0].session.dir.path  # the session's tmpfs on the host
    assert live_sessions() == 1 and session_mounts(disk) == MOUNTS
    obs, reward, done, _, info = env.step("submit")
    assert done and reward == 0.5 and obs == "Tests failed."  # n.txt was never written
    assert live_sessions() == 0 and session_mounts(disk) == 0  # closed with the episode
    assert not os.path.exists(disk)


def test_a_session_lost_to_its_time_to_live_or_a_crash_is_named(tmp_path):
    env = make_env("terminal_tasks", tasks=str(hand_written(tmp_path)), max_turns=6,
                   sessions=LOCAL)
    env.reset(0)
    env._box[0].session.expires_at = time.time()  # its time to live passes now
    time.sleep(1.0)  # the manager's reaper closes it
    with pytest.raises(EnvError, match=r"session \w+ was lost .*time to live .* passed"):
        env.step("ls")
    env.reset(1)  # a new episode gets a new session
    with pytest.raises(EnvError, match=r"was lost .*(ended on its own|closed its pipe)"):
        env.step("kill -9 $PPID")  # the command kills the session's driver: a crash
    for _ in range(50):  # the lost session is closed in the background
        if live_sessions() == 0:
            break
        time.sleep(0.1)
    assert live_sessions() == 0


def start_service(port: int = 0) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REROLL_SANDBOX_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reroll.cli", "sandbox", "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()
    match = re.search(r"http://[\d.]+:(\d+)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, match.group(0)


def test_killing_the_service_fails_its_episodes_as_infrastructure_and_a_restart_heals(tmp_path):
    folder = str(hand_written(tmp_path))
    proc, url = start_service()
    try:
        sessions = {"mode": "remote", "url": url, "request_timeout_s": 5}
        env = make_env("terminal_tasks", tasks=folder, max_turns=6, sessions=sessions)
        env.reset(0)
        assert env.step("export N=3; echo $N > n.txt")[0] == "[exit 0]"
        proc.send_signal(signal.SIGKILL)  # the service dies mid-episode
        proc.wait(timeout=10)

        async def next_step():  # as the agent loop calls it (an EnvError ends the episode)
            return await step_async(env, "chmod +x tool.sh", 30)

        with pytest.raises(EnvError, match=r"session \w+ was lost .*ServiceUnreachable.*"
                                           r"unreachable"):
            asyncio.run(next_step())
        later = make_env("terminal_tasks", tasks=folder, sessions=sessions)
        with pytest.raises(EnvError, match="unreachable"):  # a reset while it is down
            later.reset(0)
        proc, _ = start_service(int(url.rsplit(":", 1)[1]))  # back, on the same port
        for seed in (0, 1):  # new episodes use it
            env = make_env("terminal_tasks", tasks=folder, max_turns=6, sessions=sessions)
            env.reset(seed)
            env.step("chmod +x tool.sh && export N=3")
            _, reward, done, _, info = env.step("echo $N > n.txt")
            assert done is False and reward == 0.0
            _, reward, done, _, info = env.step("submit")
            assert done and reward == 1.0 and info["success"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_bad_sessions_kwargs_are_config_errors_naming_the_key(tmp_path):
    from reroll.config.errors import ConfigError

    folder = str(hand_written(tmp_path))
    with pytest.raises(ConfigError, match=r"sessions.url.*required"):
        make_env("terminal_tasks", tasks=folder, sessions={"mode": "remote"})
    with pytest.raises(ConfigError, match=r"sessions.wram: Extra inputs"):
        make_env("terminal_tasks", tasks=folder, sessions={"mode": "local", "wram": 0})
    with pytest.raises(ConfigError, match=r"sessions.api_key_env names NO_SUCH_KEY_SET"):
        make_env("terminal_tasks", tasks=folder, sessions={
            "mode": "remote", "url": "http://127.0.0.1:8377", "api_key_env": "NO_SUCH_KEY_SET"})


def test_an_env_host_closes_the_sessions_of_episodes_cut_short(tmp_path, monkeypatch):
    """Episodes in an env host process (`env.isolation: process`) that never reach their end
    (the run stops mid-episode): closing the hosts closes their sessions, warm ones included,
    and unmounts every session tmpfs."""
    scratch = tempfile.mkdtemp(prefix="reroll-test-host-")  # the sandbox uid must reach it
    os.chmod(scratch, 0o711)
    monkeypatch.setenv("TMPDIR", scratch)  # the host's sessions live below it
    factory = functools.partial(make_env, "terminal_tasks", tasks=str(hand_written(tmp_path)),
                                sessions={**LOCAL, "warm": 1})
    hosts = EnvProcesses(factory, "terminal_tasks")

    async def cut_short():
        envs = [hosts.make() for _ in range(2)]
        for env in envs:
            await reset_async(env, 0, 60)
            assert (await step_async(env, "cd /tmp && export X=1", 60))[0] == "[exit 0]"
        return envs

    envs = asyncio.run(cut_short())
    try:
        assert session_mounts(scratch) == 3 * MOUNTS  # their two sessions and the warm one
        hosts.close()
        del envs
        assert session_mounts(scratch) == 0
    finally:
        hosts.close()
        shutil.rmtree(scratch, ignore_errors=True)


def test_the_expert_solves_a_task_of_every_family_in_a_session_and_doing_nothing_fails():
    env = make_env("terminal_tasks", sessions=LOCAL)
    tasks = env.env.train
    seeds = {t.config.metadata.category: seed for seed, t in reversed(list(enumerate(tasks)))}
    assert len(seeds) >= 5
    for seed in sorted(seeds.values()):
        env.reset(seed)
        assert env.step("submit")[1] == 0.0, tasks[seed].name
        env.reset(seed)
        done = False
        while not done:
            _, reward, done, _, _ = env.step(env.expert_action())
        assert reward == 1.0, tasks[seed].name
