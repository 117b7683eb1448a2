"""The one-shot sandbox's attacks, run against sessions: each test checks the attack was
contained *and* that the host and the session's neighbours are unchanged, and that the session
itself is still usable where the attack only hit a limit."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from pathlib import Path

import pytest

from reroll.sandbox import Limits, SessionManager, SessionsConfig

pytestmark = pytest.mark.unit

PROJECT = Path(__file__).resolve().parents[2]


def scenario(fn, **config):
    async def main():
        async with SessionManager(SessionsConfig(**{"warm": 0, **config})) as manager:
            return await fn(manager)

    return asyncio.run(main())


def test_network_is_unreachable_from_a_session(host):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        port = listener.getsockname()[1]

        async def fn(m):
            s = await m.create()
            return await s.exec(
                f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)'"
                " 2>&1 | tail -1; getent hosts example.com || echo no-dns; "
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1")

        result = scenario(fn)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "Network is unreachable" in result.stdout or "refused" in result.stdout, result
    assert "no-dns" in result.stdout and result.stdout.split()[-1] == "lo"


def test_host_files_and_secrets_are_invisible(host, monkeypatch):
    token = f"reroll-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("REROLL_TEST_SECRET", token)

    async def fn(m):
        s = await m.create()
        probe = await s.exec(
            f"ls {PROJECT} 2>&1; cat /etc/shadow 2>&1; ls /root 2>&1; env; cat /proc/1/environ; "
            f"ls /; echo; mount | grep -c reroll-session")
        return probe

    result = scenario(fn)
    out = result.stdout + result.stderr
    assert token not in out
    assert "No such file or directory" in out
    assert "root:" not in out  # no line of /etc/shadow
    assert "pyproject.toml" not in out


def test_a_fork_bomb_is_contained_and_neighbours_keep_working(host):
    async def fn(m):
        s, neighbour = await m.create(limits=Limits(processes=24)), await m.create()
        bomb = await s.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo done", wall_time_s=3)
        after = await s.exec("echo alive")
        other = await neighbour.exec("echo fine")
        return bomb, after, other

    before = host.descendants()
    bomb, after, other = scenario(fn)
    assert after.stdout == "alive\n" and other.stdout == "fine\n", (bomb, after)
    assert host.descendants() - before == set()


def test_memory_and_tmp_floods_hit_their_limits():
    async def fn(m):
        s = await m.create(limits=Limits(memory_bytes="256M"), disk_bytes="8M")
        memory = await s.exec("python3 -c 'x = bytearray(1 << 30)'")
        tmp = await s.exec("dd if=/dev/zero of=/tmp/f bs=1M count=64 2>&1 | grep -c 'No space'; "
                           "dd if=/dev/zero of=/dev/shm/f bs=1M count=64 2>&1 | grep -c 'No space'")
        memfd = await s.exec("python3 -c 'import os; os.memfd_create(\"x\")' 2>&1 | tail -1")
        after = await s.exec("echo ok")
        return memory, tmp, memfd, after

    memory, tmp, memfd, after = scenario(fn)
    assert memory.limit == "memory", memory
    assert tmp.stdout == "1\n1\n", tmp
    assert "Operation not permitted" in memfd.stdout
    assert after.stdout == "ok\n"


def test_the_driver_cannot_be_traced_or_forged(host):
    async def fn(m):
        s = await m.create()
        forged = await s.exec(
            "echo '{\"exit_code\": 0}' > /proc/$PPID/fd/1 2>&1; echo rc=$?; "
            "cat /proc/$PPID/mem 2>&1 | head -c 200; echo; "
            "python3 -c 'import ctypes, sys; print(\"ptrace\", ctypes.CDLL(None).ptrace(16, "
            "int(sys.argv[1]), 0, 0))' $PPID")
        after = await s.exec("echo $((6 * 7))")
        return forged, after, s.state

    forged, after, state = scenario(fn)
    assert "rc=1" in forged.stdout and "Permission denied" in forged.stdout, forged
    assert "ptrace -1" in forged.stdout
    assert after.stdout == "42\n" and state == "running"


def test_daemons_live_across_commands_and_die_with_the_session(host):
    token = f"reroll-daemon-{uuid.uuid4().hex}"

    async def fn(m):
        s = await m.create()
        await s.exec(f"setsid sh -c 'sleep 1000 # {token}' >/dev/null 2>&1 &")
        seen = await s.exec(f"ps -eo args | grep -c '[s]leep 1000 # {token}'")
        alive_on_host = bool(host.procs_with(token))
        await s.close()
        return seen, alive_on_host, host.procs_with(token)

    seen, alive_on_host, after_close = scenario(fn)
    assert seen.stdout == "1\n" and alive_on_host
    assert after_close == []


def test_a_fork_copies_symlinks_as_links_never_their_targets(tmp_path):
    secret = tmp_path / "host.txt"
    secret.write_text("host data")

    async def fn(m):
        s = await m.create()
        await s.exec(f"ln -s / root; ln -s {secret} link; mkfifo fifo; echo mine > own; "
                     "chmod 4755 own")
        (f,) = await s.fork(1)
        listed = {e["path"]: e["type"] for e in await f.list()}
        inside = await f.exec("readlink root link; cat own; stat -c %a own; "
                              "grep -c ' /work .*nosuid,nodev' /proc/mounts")
        return listed, inside, f.dir.usage()

    listed, inside, usage = scenario(fn)
    assert listed == {"root": "symlink", "link": "symlink", "own": "file"}
    assert inside.stdout == f"/\n{secret}\nmine\n755\n1\n", inside  # no set-uid bit; nosuid
    assert usage < 1 << 20
    assert json.dumps(listed)  # the listing is plain data
