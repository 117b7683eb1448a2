"""The session driver that runs inside a session's sandbox (never imported by the host).

The host hands this source to the launcher (``_launcher.py``) as the program's Python code, so
it runs with the session's rlimits (but RLIMIT_CPU, which it sets per command instead: its own
CPU time grows over a long session). It reads one JSON request per line on stdin and answers
each with one JSON line on stdout:

- ``{"op": "exec", "cmd", "stdin", "wall_time_s", "cpu_time_s", "output_bytes", "env"}`` runs
  ``cmd`` with bash (``sh`` where there is no bash) in its own process group, in the session's
  saved cwd with its saved environment. An EXIT trap hands the shell's final ``$PWD`` and
  environment back through a pipe, so a ``cd`` or an ``export`` lasts into the next command.
  Past the wall clock or the output budget the command's process group is killed; what it
  started in a new session (a daemon) keeps running, as in a terminal.
- ``{"op": "state"}`` returns the saved ``cwd`` and ``env``; ``{"op": "set", "cwd", "env"}``
  replaces them (a fork's copy of its source's state).

It makes itself non-dumpable first, so the commands, which run as the same uid, can neither
ptrace it nor write into its pipes through ``/proc`` to forge an answer; they can kill it,
which ends the session (the host reports it as failed). Only the standard library is used.
"""

import base64
import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time

_DROP = ("_", "SHLVL", "PWD")
_TRAP = ("trap '__reroll_rc=$?; { printf \"%s\\0\" \"$PWD\"; env -0; } >&FD 2>/dev/null; "
         "exit $__reroll_rc' EXIT\n__reroll_c=$1; shift; eval \"$__reroll_c\"\n")
_SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
STATE = {"cwd": os.getcwd(), "env": dict(os.environ)}
HOME = os.getcwd()


def _nondumpable():
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def _parse_state(data):
    """``cwd\\0K=V\\0...`` from the EXIT trap; None when it is not that."""
    parts = data.split(b"\0")
    if len(parts) < 2 or not parts[0].startswith(b"/"):
        return None
    env = {}
    for item in parts[1:]:
        name, sep, value = item.decode("utf-8", "surrogateescape").partition("=")
        if sep and name and name not in _DROP:
            env[name] = value
    return parts[0].decode("utf-8", "surrogateescape"), env


def _drain(fd, sink, budget):
    """Read what ``fd`` holds now (non-blocking) into ``sink``, within ``budget``; the new
    budget, negative when it was exceeded."""
    os.set_blocking(fd, False)
    while budget >= 0:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        sink += chunk[: max(budget, 0)]
        budget -= len(chunk)
    return budget


def _spawn(req, state_w):
    env = dict(STATE["env"])
    env.update(req.get("env") or {})
    cpu = max(1, int(req["cpu_time_s"] + 0.999))

    def limit_cpu():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    argv = [_SHELL, "-c", _TRAP.replace("FD", str(state_w)), "sh", req["cmd"]]
    if _SHELL.endswith("bash"):
        argv[1:1] = ["--noprofile", "--norc"]
    cwd = STATE["cwd"] if os.path.isdir(STATE["cwd"]) else HOME
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=(state_w,), env=env, cwd=cwd,
                            start_new_session=True, preexec_fn=limit_cpu)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def run(req):
    state_r, state_w = os.pipe()
    started = time.monotonic()
    try:
        proc = _spawn(req, state_w)
    finally:
        os.close(state_w)
    stdin = base64.b64decode(req.get("stdin") or "")
    sel = selectors.DefaultSelector()
    out, err = bytearray(), bytearray()
    budget = int(req["output_bytes"])
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    deadline = started + float(req["wall_time_s"])
    timed_out = exited = False
    while not exited and budget >= 0:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            if key.data == "exit":
                exited = True
            elif key.data == "stdin":
                try:
                    stdin = stdin[os.write(key.fd, stdin[:65536]):]
                except OSError:
                    stdin = b""
                if not stdin:
                    sel.unregister(key.fileobj)
                    proc.stdin.close()
            else:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                key.data.extend(chunk[: max(budget, 0)])
                budget -= len(chunk)
    if not exited:
        _kill(proc)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    sel.close()
    os.close(pidfd)
    budget = _drain(proc.stdout.fileno(), out, budget)
    budget = _drain(proc.stderr.fileno(), err, budget)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        try:
            pipe.close()
        except OSError:
            pass
    proc.returncode = 0  # reaped above; keeps Popen from waiting again
    state = bytearray()
    _drain(state_r, state, 1 << 22)
    os.close(state_r)
    saved = _parse_state(bytes(state)) if exited else None
    if saved is not None:
        for name in req.get("env") or {}:  # this command's own variables do not last
            if name in STATE["env"]:
                saved[1][name] = STATE["env"][name]
            else:
                saved[1].pop(name, None)
        STATE["cwd"], STATE["env"] = saved
    code = os.waitstatus_to_exitcode(status)
    return {
        "exit_code": 128 - code if code < 0 else code,
        "stdout": base64.b64encode(bytes(out)).decode(),
        "stderr": base64.b64encode(bytes(err)).decode(),
        "timed_out": timed_out,
        "output_truncated": budget < 0,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "cwd": STATE["cwd"],
    }


def answer(line):
    req = json.loads(line)
    op = req.get("op")
    if op == "exec":
        return run(req)
    if op == "set":
        STATE["cwd"], STATE["env"] = str(req["cwd"]), dict(req["env"])
        return {"cwd": STATE["cwd"]}
    if op == "state":
        return {"cwd": STATE["cwd"], "env": STATE["env"]}
    return {"error": f"unknown op {op!r}"}


def _write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def main():
    _nondumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        try:
            reply = answer(line)
        except Exception as exc:  # a bad request must not end the session
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _write(json.dumps(reply).encode() + b"\n")


main()
