"""The sandbox service started as a user starts it (`reroll sandbox serve`, a subprocess), driven
through its HTTP client; and the one session interface, local or remote."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from reroll.cli import main
from reroll.sandbox import (
    SandboxError,
    SessionClient,
    SessionGone,
    SessionNotFound,
    SessionsConfig,
    open_sessions,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789"


def session_mounts(under: str) -> int:
    """The session tmpfs mounts below `under` (other runs on the machine mount their own)."""
    with open("/proc/self/mountinfo") as handle:
        return sum("reroll-session " in line and line.split()[4].startswith(under)
                   for line in handle)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`reroll sandbox serve --port 0` with an API key and a config file; yields its URL."""
    config = tmp_path_factory.mktemp("service") / "sessions.yaml"
    config.write_text("sessions:\n  warm: 2\n  max_sessions: 32\n  session:\n    ttl_s: 120\n"
                      "    limits: {processes: 40}\n")
    # the service's session folders go under a temporary folder of its own (TMPDIR), so that
    # its mounts are told apart from those of other tests running beside it
    # (under /tmp itself: the sandbox's uid must reach it, and pytest's folders are private)
    tmp = tempfile.mkdtemp(prefix="reroll-service-test-")
    os.chmod(tmp, 0o711)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MY_SANDBOX_KEY": KEY, "TMPDIR": tmp}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reroll.cli", "sandbox", "serve", "--port", "0", "--config",
         str(config), "--api-key-env", "MY_SANDBOX_KEY"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()
    match = re.search(r"http://[\d.]+:\d+", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    assert "API key required" in line
    yield match.group(0)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert session_mounts(tmp) == 0  # every session was closed on the way out
    shutil.rmtree(tmp, ignore_errors=True)


def run(coro):
    return asyncio.run(coro)


def test_sessions_through_the_service(service):
    async def scenario():
        async with SessionClient(service, api_key=KEY) as client:
            s = await client.create(env={"A": "1"})
            await s.exec("mkdir w && cd w && export B=2")
            r = await s.exec("pwd; echo $A$B", stdin="ignored")
            await s.write("w/in.txt", "data\n", mode=0o600)
            cat = await s.exec("cat in.txt; stat -c %a in.txt")
            listed = await s.list("w")
            forks = await s.fork(2)
            forked = [await f.exec("pwd; cat in.txt; echo $B") for f in forks]
            await forks[0].write("w/only0", b"x")
            other = await forks[1].list("w")
            state = await s.describe()
            sessions = await client.list()
            metrics = await client.metrics()
            served = await client.stats()
            assert served["create_p50_ms"] > 0 and served["states"]["running"] == 3
            await s.close()
            with pytest.raises(SessionGone, match="closed"):
                await s.exec("true")
            with pytest.raises(SessionNotFound):
                await client.get("nope")
            with pytest.raises(ValueError, match="leaves"):
                await forks[0].read("../../etc/passwd")
            slow = await forks[0].exec("sleep 5", wall_time_s=0.3)
            return r, cat, listed, forked, other, state, sessions, metrics, slow

    r, cat, listed, forked, other, state, sessions, metrics, slow = run(scenario())
    assert r.ok and r.stdout == "/work/w\n12\n"
    assert cat.stdout == "data\n600\n"
    assert [e["path"] for e in listed] == ["w/in.txt"]
    assert all(f.stdout == "/work/w\ndata\n2\n" for f in forked)
    assert [e["path"] for e in other] == ["w/in.txt"]
    assert [h["state"] for h in state["history"]] == ["starting", "running"]
    assert state["spec"]["ttl_s"] == 120  # the service's configured default
    assert len(sessions) == 3
    for name in ("reroll_sandbox_session_create_seconds_bucket",
                 "reroll_sandbox_session_exec_seconds_count", 'reroll_sandbox_sessions{state="running"}',
                 "reroll_sandbox_session_fork_seconds_count"):
        assert name in metrics
    assert slow.limit == "wall_time" and slow.timed_out


def test_the_key_is_required_and_bad_requests_get_one_message(service):
    with httpx.Client(base_url=service) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/sessions").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        wrong = http.get("/sessions", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        bad = http.post("/sessions", json={"disk_bytes": "1k"}, headers=auth)
        assert bad.status_code == 400 and "disk_bytes" in bad.json()["error"]["message"]
        typo = http.post("/sessions", json={"tll_s": 5}, headers=auth)
        assert typo.status_code == 400 and "tll_s" in typo.json()["error"]["message"]
        made = http.post("/sessions", json={"limits": {"open_files": 64}}, headers=auth).json()
        assert made["spec"]["limits"]["open_files"] == 64
        assert made["spec"]["limits"]["processes"] == 40  # the service's own default stays
        sid = made["id"]
        extra = http.post(f"/sessions/{sid}/exec", json={"command": "ls"}, headers=auth)
        assert extra.status_code == 400 and "cmd" in extra.json()["error"]["message"]
        missing = http.post("/sessions/nope/exec", json={"cmd": "ls"}, headers=auth)
        assert missing.status_code == 404
        schema = http.get("/openapi.json", headers=auth).json()
        assert "/sessions/{sid}/exec" in schema["paths"]
        assert http.delete(f"/sessions/{sid}", headers=auth).json()["state"] == "closed"


def test_serving_beyond_loopback_needs_a_key_and_the_config_is_checked(tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.delenv("REROLL_SANDBOX_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["sandbox", "serve", "--host", "0.0.0.0"])
    assert exit_.value.code == 2
    assert "without an API key" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("sessions:\n  max_starting: 0\n")
    with pytest.raises(SystemExit) as exit_:
        main(["sandbox", "serve", "--config", str(bad)])
    assert exit_.value.code == 2
    assert "sessions.max_starting" in capsys.readouterr().err


def test_an_unreachable_service_is_a_sandbox_error_not_the_programs():
    async def scenario():
        async with SessionClient("http://127.0.0.1:9", timeout_s=2) as client:
            await client.create()

    with pytest.raises(SandboxError, match="unreachable"):
        run(scenario())


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_local_and_remote_sessions_share_one_interface(mode, service, monkeypatch):
    monkeypatch.setenv("MY_SANDBOX_KEY", KEY)
    config = SessionsConfig(mode=mode, warm=0, url=service if mode == "remote" else None,
                            api_key_env="MY_SANDBOX_KEY" if mode == "remote" else None)

    async def scenario():
        async with open_sessions(config) as sessions:
            s = await sessions.create(ttl_s=60)
            await s.write("x.sh", "echo from-file\n")
            first = await s.exec("export V=kept; sh x.sh")
            second = await s.exec("echo $V")
            (copy,) = await s.fork(1)
            third = await copy.exec("echo $V; ls")
            await copy.close()
            await s.close()
            return first.stdout, second.stdout, third.stdout, (await s.describe())["state"]

    assert run(scenario()) == ("from-file\n", "kept\n", "kept\nx.sh\n", "closed")


def test_a_remote_config_needs_a_url():
    with pytest.raises(ValueError, match="sessions.url"):
        SessionsConfig(mode="remote")
