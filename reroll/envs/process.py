"""Environments in processes of their own (`env.isolation: process`, the default for a user's
`module:Class` environment): an environment that kills its process (`os._exit`, a crash in a C
extension, the out-of-memory killer) or never returns from a step cannot take the run with it.

`EnvProcesses(factory, label)` starts `num_processes` env hosts: fresh interpreters (`python -c`,
never a fork of the trainer nor a re-run of the user's script) that import only what `factory`
needs; `factory` travels to them pickled (`functools.partial(make_env, id, **kwargs)`). A host
builds one environment per episode and runs its `reset`/`step` on an event loop of its own (a
sync call in a thread, an `async def` one on the loop), so concurrent episodes overlap there as
they do in the driver. `EnvProcesses.make()` is the agent loop's `make_env`: a `ProcessEnv` on
the host with the fewest live environments, whose `areset`/`astep` the loop awaits under its
usual step time limit.

When a host dies, every call it was running fails its episode with the exit code and what was
running (`env/errors`, the trajectory's `env_error`), the same line goes to the console, and the
next episode starts a new host. A step past the time limit is abandoned in its host (its thread
stays there); a host whose driver has gone (the pipe's end closed) exits by itself, after
closing the sandbox sessions its environments still hold (`reroll.sandbox.shared`), and the
run's close waits `EXIT_GRACE_S` for that before it kills the hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from reroll.envs.base import EnvError, in_thread, reset_async, step_async
from reroll.sandbox import shared

START_TIMEOUT_S = 120.0
"""Longest a host may take to start and build its first environment (imports included)."""
EXIT_GRACE_S = 15.0
"""How long a closed host may take to close its sandbox sessions (and unmount their tmpfs)
before it is killed."""


def picklable(factory: Callable[[], Any]) -> str | None:
    """None if `factory` can be sent to a host process, else why not."""
    try:
        pickle.dumps(factory)
    except Exception as e:  # noqa: BLE001 - lambdas, local classes, open handles...
        return f"{type(e).__name__}: {e}"
    return None


class EnvProcesses:
    """The env host processes of a run; `make()` gives each new episode an environment."""

    def __init__(self, factory: Callable[[], Any], label: str, num_processes: int = 1):
        self.factory, self.label = factory, label
        self.hosts = [_Host(factory, label) for _ in range(num_processes)]
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def make(self) -> ProcessEnv:
        with self._lock:
            for i, host in enumerate(self.hosts):
                if host.dead is not None:  # its episodes have failed; later ones get a new host
                    host.close()
                    try:
                        self.hosts[i] = _Host(self.factory, self.label)
                    except EnvError as e:  # the episode fails on the dead host, not the run
                        host.dead = f"{host.dead}, and a new process did not start ({e})"
            host = min(self.hosts, key=lambda h: h.live)
            host.live += 1
            return ProcessEnv(host, next(self._keys))

    def pids(self) -> list[int]:
        return [host.process.pid for host in self.hosts]

    def close(self) -> None:
        hosts, self.hosts = self.hosts, []
        for host in hosts:
            host.close()


class ProcessEnv:
    """One episode's environment in a host process; the Env protocol's async variant."""

    def __init__(self, host: _Host, key: int):
        self.host, self.key = host, key

    async def areset(self, seed: int | None = None):
        return await self.host.call(self.key, "reset", seed)

    async def astep(self, action: str):
        return await self.host.call(self.key, "step", action)

    def __del__(self):
        self.host.release(self.key)


class _Host:
    """One host process, the pipe to it, and the calls waiting for its replies."""

    def __init__(self, factory: Callable[[], Any], label: str):
        self.label, self.live, self.dead = label, 0, None
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from reroll.envs.process import host_main; "
                                   f"host_main({theirs.fileno()})"],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._ids = itertools.count()
        self._lock = threading.RLock()  # __del__ of a ProcessEnv may run anywhere
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, str]] = {}
        self.episodes: dict[int, list] = {}  # key -> [env seed, steps so far], for the messages
        try:
            self.conn.send(list(sys.path))
            self.conn.send(factory)
            if not self.conn.poll(START_TIMEOUT_S):
                raise EOFError(f"no answer in {START_TIMEOUT_S:.0f}s")
            problem = self.conn.recv()
        except (EOFError, OSError) as e:
            problem = f"its process ended while starting ({self._exit()}; {e})"
        if problem is not None:
            self.close()
            raise EnvError(f"env {label}: cannot be built in a process of its own: {problem}")
        threading.Thread(target=self._read, daemon=True, name="reroll-env-host").start()

    async def call(self, key: int, method: str, arg: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.dead is not None:
                raise EnvError(f"env {method}: {self.dead}")
            call_id = next(self._ids)
            self.pending[call_id] = (loop, future, self._what(key, method, arg))
            try:
                self.conn.send((call_id, key, method, arg))
            except OSError:
                pass  # it died: the reader fails this call with the exit code
        try:
            return await future
        finally:
            with self._lock:
                self.pending.pop(call_id, None)

    def _what(self, key: int, method: str, arg: Any) -> str:
        """The call in words: `step 3 (env seed 17)`."""
        if method == "reset":
            self.episodes[key] = [arg, 0]
            return f"reset (env seed {arg})"
        episode = self.episodes.setdefault(key, [None, 0])
        episode[1] += 1
        return f"step {episode[1]} (env seed {episode[0]})"

    def release(self, key: int) -> None:
        with self._lock:
            self.live -= 1
            self.episodes.pop(key, None)
            if self.dead is None:
                try:
                    self.conn.send((None, key, "drop", None))
                except OSError:
                    pass

    def _read(self) -> None:
        """Hand each reply to the call waiting for it; at the host's end, fail every call it
        was running, naming the exit code and the calls."""
        while True:
            try:
                call_id, ok, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                entry = self.pending.pop(call_id, None)
            if entry is not None:
                _settle(entry[0], entry[1], payload if ok else EnvError(payload))
        with self._lock:
            running, self.pending = list(self.pending.values()), {}
            if self.dead is not None:  # closed by the run
                return
            self.dead = (f"the environment's process (pid {self.process.pid}) "
                         f"{self._exit()}")
        calls = ", ".join(what for _, _, what in running) or "no call"
        print(f"reroll: env {self.label}: {self.dead} while running {calls}; "
              f"{len(running)} episode(s) failed (env/errors), later episodes get a new process",
              file=sys.stderr, flush=True)
        for loop, future, what in running:
            _settle(loop, future, EnvError(f"env {what.split()[0]}: {self.dead} during it"))

    def _exit(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def close(self) -> None:
        with self._lock:
            self.dead = self.dead or "closed"
        # A hang-up, not just a close: the reader thread's pending recv holds the socket
        # open, so a close alone never reaches the host. It then ends by itself, after
        # closing its sessions (stuck steps or not).
        with contextlib.suppress(OSError):
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        try:
            self.process.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    def settle() -> None:
        if not future.done():  # the episode may have given up (time limit, abort)
            future.set_exception(value) if isinstance(value, BaseException) \
                else future.set_result(value)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its event loop has closed: nobody waits any more
        pass


# -- the host process ---------------------------------------------------------------------------


def host_main(fd: int) -> None:
    """The body of a host process: `fd` is its end of the pipe to the driver."""
    conn = Connection(fd)
    sys.path[:0] = [p for p in conn.recv() if p not in sys.path]
    try:
        factory = conn.recv()
        factory()  # a factory that cannot build here fails at start, named
    except Exception as e:  # noqa: BLE001 - reported to the driver, which refuses to start
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send(None)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    host = _HostBody(factory, conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver has gone: end, stuck steps and all
            break
        asyncio.run_coroutine_threadsafe(host.handle(*message), loop)
    shared.shutdown(EXIT_GRACE_S - 5)  # sessions left open by episodes cut short
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # daemon threads stuck in a step are not waited for


class _HostBody:
    """The environments of one host, by key, and the replies to the driver."""

    def __init__(self, factory: Callable[[], Any], conn: Connection):
        self.factory, self.conn, self.envs = factory, conn, {}
        self.send_lock = threading.Lock()

    async def handle(self, call_id: int | None, key: int, method: str, arg: Any) -> None:
        if method == "drop":
            env = self.envs.pop(key, None)
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - a failing close loses nothing
                    pass
            return
        try:
            if method == "reset":
                try:  # in a thread: a slow constructor must not hold up the other episodes
                    self.envs[key] = await in_thread(self.factory)
                except Exception as e:  # noqa: BLE001 - the episode fails, named
                    raise EnvError(f"env reset: building it raised {type(e).__name__}: {e}") \
                        from None
                reply = (call_id, True, await reset_async(self.envs[key], arg))
            else:
                reply = (call_id, True, await step_async(self.envs[key], arg))
        except EnvError as e:
            reply = (call_id, False, str(e))
        with self.send_lock:
            try:
                self.conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                self.conn.send((call_id, False, f"env {method} returned what cannot be sent "
                                                f"between processes ({e})"))
