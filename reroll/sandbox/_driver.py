"""The session driver that runs inside a session's sandbox (never imported by the host).

The host hands this source to the launcher (``_launcher.py``) as the program's Python code, so
it runs with the session's rlimits (but RLIMIT_CPU, which it sets per command instead: its own
CPU time grows over a long session). It reads one request per frame on stdin (a 4-byte length
and a ``marshal``-ed dict: only the host writes there) and answers each with one JSON line
whose values are numbers, booleans and base64 strings (the host parses JSON, never marshal,
from inside a sandbox):

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
which ends the session (the host reports it as failed). Only built-in modules and those the
launcher loaded already are used: the standard ``json``, ``base64``, ``subprocess`` and
``selectors`` cost 30-60 ms of start-up per session here.
"""

import binascii
import ctypes  # loaded already: the driver runs in the launcher's forked process
import marshal
import os
import resource
import select
import signal
import struct
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


def _b64(data):
    return binascii.b2a_base64(data, newline=False).decode()


def _json(reply):
    """The answer as JSON, written by hand (the json module costs ~10 ms of start-up): its
    values are numbers, booleans and base64 strings only."""
    items = []
    for key, value in reply.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = '"' + value + '"'
        items.append('"' + key + '": ' + text)
    return ("{" + ", ".join(items) + "}\n").encode()


def _env_blob(env):
    return _b64(b"\0".join(f"{k}={v}".encode("utf-8", "surrogateescape") for k, v in env.items()))


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
        except OSError:
            break
        if not chunk:
            break
        sink += chunk[: max(budget, 0)]
        budget -= len(chunk)
    return budget


def _fork():
    """``os.fork``, retried for up to 2 s while the session is at its process limit (the
    processes a killed command left are still being reaped by init)."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            return os.fork()
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _spawn(req, state_w):
    """Fork and exec the shell: its own session (process group), the command's CPU limit, its
    stdio on three pipes. Returns (pid, stdin, stdout, stderr) of the host side."""
    env = dict(STATE["env"])
    env.update(req.get("env") or {})
    cpu = max(1, int(req["cpu_time_s"] + 0.999))
    argv = [_SHELL, "-c", _TRAP.replace("FD", str(state_w)), "sh", req["cmd"]]
    if _SHELL.endswith("bash"):
        argv[1:1] = ["--noprofile", "--norc"]
    cwd = STATE["cwd"] if os.path.isdir(STATE["cwd"]) else HOME
    envp = [f"{k}={v}" for k, v in env.items()]
    pipes = [os.pipe(), os.pipe(), os.pipe()]
    try:
        pid = _fork()
    except OSError:
        for pair in pipes:
            os.close(pair[0])
            os.close(pair[1])
        raise
    if pid == 0:  # the child: nothing here may return
        try:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(pipes[0][0], 0)
            os.dup2(pipes[1][1], 1)
            os.dup2(pipes[2][1], 2)
            os.set_inheritable(state_w, True)  # os.pipe() makes close-on-exec descriptors
            os.closerange(3, state_w)
            os.closerange(state_w + 1, 1 << 16)
            os.chdir(cwd)
            os.execve(argv[0], argv, dict(e.split("=", 1) for e in envp))
        except BaseException as exc:
            os.write(2, f"sandbox session: cannot start the shell: {exc}\n".encode())
        os._exit(127)
    os.close(pipes[0][0])
    os.close(pipes[1][1])
    os.close(pipes[2][1])
    return pid, pipes[0][1], pipes[1][0], pipes[2][0]


def _kill(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _pump(pid, stdin_fd, out_fd, err_fd, stdin, budget, deadline):
    """Feed stdin and collect output until the shell exits, the wall clock or the output
    budget runs out. Returns (out, err, budget, exited)."""
    out, err = bytearray(), bytearray()
    sinks = {out_fd: out, err_fd: err}
    pidfd = os.pidfd_open(pid)
    poll = select.poll()
    for fd in (out_fd, err_fd, pidfd):
        poll.register(fd, select.POLLIN)
    if stdin:
        os.set_blocking(stdin_fd, False)
        poll.register(stdin_fd, select.POLLOUT)
    else:
        os.close(stdin_fd)
    exited = False
    try:
        while not exited and budget >= 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poll.poll(left * 1000):
                if fd == pidfd:
                    exited = True
                elif fd == stdin_fd:
                    try:
                        stdin = stdin[os.write(fd, stdin[:65536]):]
                    except OSError:
                        stdin = b""
                    if not stdin:
                        poll.unregister(fd)
                        os.close(fd)
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        poll.unregister(fd)
                    sinks[fd].extend(chunk[: max(budget, 0)])
                    budget -= len(chunk)
    finally:
        os.close(pidfd)
        if stdin:
            os.close(stdin_fd)
    return out, err, budget, exited


def run(req):
    state_r, state_w = os.pipe()
    started = time.monotonic()
    try:
        pid, stdin_fd, out_fd, err_fd = _spawn(req, state_w)
    except OSError as exc:  # the session's own doing (its process limit): the command's result
        os.close(state_r)
        message = f"sandbox session: cannot start the command: {exc}\n".encode()
        return {"exit_code": 126, "stdout": "", "stderr": _b64(message), "timed_out": False,
                "output_truncated": False, "wall_s": time.monotonic() - started, "cpu_s": 0.0,
                "max_rss_bytes": 0, "cwd": _b64(STATE["cwd"].encode("utf-8", "surrogateescape"))}
    finally:
        os.close(state_w)
    budget = int(req["output_bytes"])
    deadline = started + float(req["wall_time_s"])
    out, err, budget, exited = _pump(pid, stdin_fd, out_fd, err_fd, req.get("stdin") or b"",
                                     budget, deadline)
    if not exited:
        _kill(pid)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - started
    budget = _drain(out_fd, out, budget)
    budget = _drain(err_fd, err, budget)
    os.close(out_fd)
    os.close(err_fd)
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
        "stdout": _b64(bytes(out)),
        "stderr": _b64(bytes(err)),
        "timed_out": not exited and budget >= 0,
        "output_truncated": budget < 0,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "cwd": _b64(STATE["cwd"].encode("utf-8", "surrogateescape")),
    }


def answer(req):
    op = req.get("op")
    if op == "exec":
        return run(req)
    if op == "set":
        STATE["cwd"], STATE["env"] = str(req["cwd"]), dict(req["env"])
    if op in ("set", "state"):
        return {"cwd": _b64(STATE["cwd"].encode("utf-8", "surrogateescape")),
                "env": _env_blob(STATE["env"])}
    return {"error": _b64(f"unknown op {op!r}".encode())}


def _read_exact(n):
    data = bytearray()
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def main():
    _nondumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    while True:
        head = _read_exact(4)
        if head is None:
            return
        body = _read_exact(struct.unpack(">I", head)[0])
        if body is None:
            return
        try:
            reply = answer(marshal.loads(body))
        except Exception as exc:  # a bad request must not end the session
            reply = {"error": _b64(f"{type(exc).__name__}: {exc}".encode())}
        _write(_json(reply))


main()
