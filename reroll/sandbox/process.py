"""One sandbox process on the host side: start it, hand it its single job, watch it, kill it.

The host never trusts what runs inside. It learns the outcome from outside: the exit status and
resource usage of the host-side process (``wait4``), and the stdout/stderr pipes, read with a byte
budget. Exit is observed through a pidfd, so no SIGCHLD handler or asyncio child watcher is used.
With bubblewrap, killing means SIGKILL to the init of the sandbox's pid namespace (through a
pidfd, so a recycled pid can never be hit): the kernel then kills every process in the namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from reroll.sandbox.backends import LaunchSpec
from reroll.sandbox.result import SandboxError, SandboxLost
from reroll.sandbox.seccomp import filter_fd

_STDERR_ON_FAILURE = 4096
_KILL_GRACE_S = 2.0
_SETPRIV_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_MOUNT = shutil.which("mount", path=_SETPRIV_PATH) or "mount"


@dataclass
class Outcome:
    """The raw observation of one execution, before it becomes an `ExecResult`."""

    stdout: bytes
    stderr: bytes
    exit_code: int
    timed_out: bool
    output_exceeded: bool
    wall_s: float
    cpu_s: float
    max_rss_bytes: int


class _OutputBudget:
    def __init__(self, limit: int, on_exceed) -> None:
        self.remaining = limit
        self.exceeded = False
        self._on_exceed = on_exceed

    def take(self, n: int) -> int:
        granted = min(n, self.remaining)
        self.remaining -= granted
        if granted < n and not self.exceeded:
            self.exceeded = True
            self._on_exceed()
        return granted


class _Capture(asyncio.Protocol):
    """Collects one pipe until EOF, within the shared output budget."""

    def __init__(self, budget: _OutputBudget, loop: asyncio.AbstractEventLoop) -> None:
        self.chunks: list[bytes] = []
        self.budget = budget
        self.closed = loop.create_future()

    def data_received(self, data: bytes) -> None:
        granted = self.budget.take(len(data))
        if granted:
            self.chunks.append(data[:granted])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


async def _read_to_eof(fd: int) -> bytes:
    """Read a non-blocking pipe until EOF without blocking the loop."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            chunks.append(chunk)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


def _popen(spec: LaunchSpec, channel_fd: int, info_fd: int | None) -> subprocess.Popen:
    """Start the host command of ``spec`` (the launcher gets ``channel_fd``)."""
    fds = [channel_fd]
    cmd = list(spec.argv)
    if info_fd is not None:
        fds.append(info_fd)
        cmd += ["--info-fd", str(info_fd)]
    seccomp_fd = filter_fd(spec.seccomp) if spec.seccomp is not None else None
    if seccomp_fd is not None:
        fds.append(seccomp_fd)
        cmd += ["--seccomp", str(seccomp_fd)]
    try:
        return _spawn(spec, cmd, fds, channel_fd)
    finally:
        if seccomp_fd is not None:
            os.close(seccomp_fd)


def _spawn(spec: LaunchSpec, cmd: list[str], fds: list[int], channel_fd: int) -> subprocess.Popen:
    cmd += [*spec.tail, str(channel_fd)]
    kwargs = {}
    if spec.user is not None:
        setpriv = shutil.which("setpriv", path=_SETPRIV_PATH)
        if setpriv is not None:  # lets Popen use vfork: no copy of a large host process
            ids = [f"--reuid={spec.user}", f"--regid={spec.group}", "--clear-groups", "--"]
            cmd = [setpriv, *ids, *cmd]
        else:
            kwargs = {"user": spec.user, "group": spec.group, "extra_groups": []}
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=fds,
        env=spec.env,
        cwd=spec.cwd,
        start_new_session=True,
        **kwargs,
    )


def _remount_inodes(init_pid: int, spec: LaunchSpec) -> str | None:
    """Cap each tmpfs's inodes; an error message, or None."""
    namespace = f"/proc/{init_pid}/ns/mnt"
    for target in spec.tmpfs_mounts:
        done = subprocess.run([_MOUNT, "-N", namespace, "-o", f"remount,nr_inodes="
                               f"{spec.tmpfs_inodes}", target], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            return f"cannot cap the inodes of the sandbox's {target}: {done.stderr.strip()}"
    return None


class SandboxProcess:
    """A started sandbox waiting for its one job. Create with ``await SandboxProcess.start(...)``."""

    def __init__(
        self, spec: LaunchSpec, popen: subprocess.Popen, channel: socket.socket, tmpfs_bytes: int
    ) -> None:
        self.spec = spec
        self.tmpfs_bytes = tmpfs_bytes
        self.popen = popen
        self.channel = channel
        self.loop = asyncio.get_running_loop()
        self.spawn_s = 0.0
        self.used = False
        self._exited: asyncio.Future[tuple[int, object]] = self.loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        self._init_pidfd: int | None = None
        self._init_pid: int | None = None
        self.loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, spec: LaunchSpec, tmpfs_bytes: int, timeout: float) -> SandboxProcess:
        """Start a sandbox and wait until its launcher is ready for a job."""
        t0 = time.perf_counter()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent.setblocking(False)
        info_r, info_w = os.pipe() if spec.info_fd else (None, None)
        try:
            popen = _popen(spec, child.fileno(), info_w)
        except OSError as exc:
            parent.close()
            if info_r is not None:
                os.close(info_r)
            raise SandboxError(f"cannot start the sandbox ({spec.argv[:1]}): {exc}") from exc
        finally:
            child.close()
            if info_w is not None:
                os.close(info_w)
        proc = cls(spec, popen, parent, tmpfs_bytes)
        info = proc.loop.create_task(_read_to_eof(info_r)) if info_r is not None else None
        try:
            # `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` returns the result when
            # the caller is cancelled just as the handshake ends, and the cancelled run went on
            # to run its program to the end (the cancellation was lost).
            async with asyncio.timeout(timeout):
                await proc._handshake(info)
        except BaseException as exc:
            await asyncio.shield(proc._abort_start(info))
            if isinstance(exc, TimeoutError):
                raise SandboxError(f"the sandbox was not ready within {timeout:.1f}s") from None
            raise
        finally:
            if info_r is not None:
                os.close(info_r)
        proc.spawn_s = time.perf_counter() - t0
        return proc

    async def _learn_init(self, info: asyncio.Task) -> None:
        """bubblewrap reports the pid of the namespace's init (``--info-fd``) before it lets that
        process run; from then on the sandbox is killed through the init's pidfd."""
        if self._init_pidfd is None:
            data = json.loads(await asyncio.shield(info))
            self._init_pidfd = os.pidfd_open(int(data["child-pid"]))
            self._init_pid = int(data["child-pid"])

    async def _handshake(self, info: asyncio.Task | None) -> None:
        if info is not None:
            with contextlib.suppress(ValueError, KeyError, ProcessLookupError):
                await self._learn_init(info)
        ready = b""
        with contextlib.suppress(OSError):
            ready = await self.loop.sock_recv(self.channel, 1)
        if ready != b"R" or (info is not None and self._init_pidfd is None):
            await self._exited
            err = os.read(self.popen.stderr.fileno(), _STDERR_ON_FAILURE).decode(errors="replace")
            raise SandboxError(f"the sandbox failed to start: {err.strip() or 'no message'}")
        if self.spec.tmpfs_mounts and self._init_pid is not None:
            await self._cap_inodes()

    async def _cap_inodes(self) -> None:
        """Remount the sandbox's tmpfs mounts with ``nr_inodes`` (bubblewrap cannot pass that
        option), from the host, in the sandbox's mount namespace, before any job arrives."""
        error = await self.loop.run_in_executor(None, _remount_inodes, self._init_pid, self.spec)
        if error:
            raise SandboxError(error)

    async def _abort_start(self, info: asyncio.Task | None) -> None:
        """Tear down a sandbox whose start failed or was cancelled. Killing bubblewrap before it
        released its child would leave that child blocked forever, so wait (bounded) for the
        init's pid first, then kill through it."""
        if info is not None and self._init_pidfd is None and self.alive:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._learn_init(info), _KILL_GRACE_S)
        if info is not None and not info.done():
            info.cancel()
        await self.destroy()

    def _on_exit(self) -> None:
        self.loop.remove_reader(self._pidfd)
        try:
            _, status, rusage = os.wait4(self.popen.pid, 0)
        except ChildProcessError:  # reaped by someone else: the status is lost
            status, rusage = 255 << 8, None
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        if not self._exited.done():
            self._exited.set_result((status, rusage))

    @property
    def alive(self) -> bool:
        return not self._exited.done()

    def kill(self) -> None:
        """SIGKILL the whole sandbox (idempotent). With bubblewrap the target is the namespace's
        init: the kernel kills every process in the namespace, and bubblewrap, still alive,
        reaps the init and exits. Killing bubblewrap itself is only the fallback (`_terminate`)."""
        if self._init_pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
        elif self.spec.process_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        else:
            self._kill_host_process()

    def _kill_host_process(self) -> None:
        if not self._exited.done() and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def _terminate(self) -> None:
        """Kill and wait until every process of the sandbox is gone."""
        self.kill()
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), _KILL_GRACE_S)
        except TimeoutError:
            self._kill_host_process()
        await self._await_gone()

    async def _await_gone(self) -> None:
        await self._exited
        if self._init_pidfd is not None:
            gone = self.loop.create_future()
            self.loop.add_reader(self._init_pidfd, lambda: gone.done() or gone.set_result(None))
            try:
                await gone
            finally:
                self.loop.remove_reader(self._init_pidfd)

    async def execute(self, job: bytes, stdin: bytes | None, wall_s: float, output_bytes: int):
        """Hand the job over, wait for the exit (or the wall clock), return an `Outcome`."""
        if self.used:
            raise SandboxError("a sandbox runs exactly one job")
        self.used = True
        budget = _OutputBudget(output_bytes, self.kill)
        out = _Capture(budget, self.loop)
        err = _Capture(budget, self.loop)
        transports: list = []
        try:  # from the first await on: a cancelled caller still kills the sandbox (`_finish`)
            transports.append((await self.loop.connect_read_pipe(lambda: out, self.popen.stdout))[0])
            transports.append((await self.loop.connect_read_pipe(lambda: err, self.popen.stderr))[0])
            t0 = time.perf_counter()
            await self._deliver(job, stdin, transports)
            done, _ = await asyncio.wait({self._exited}, timeout=wall_s)
            timed_out = not done
            if timed_out:
                await self._terminate()
            status, rusage = self._exited.result()
            wall = time.perf_counter() - t0
            await self._await_gone()
            await asyncio.wait({out.closed, err.closed}, timeout=1.0)
        finally:
            await self._finish(transports)
        return Outcome(
            stdout=b"".join(out.chunks),
            stderr=b"".join(err.chunks),
            exit_code=_exit_code(status),
            timed_out=timed_out,
            output_exceeded=budget.exceeded,
            wall_s=wall,
            cpu_s=rusage.ru_utime + rusage.ru_stime if rusage is not None else 0.0,
            max_rss_bytes=rusage.ru_maxrss * 1024 if rusage is not None else 0,
        )

    async def _deliver(self, job: bytes, stdin: bytes | None, transports: list) -> None:
        ack = b""
        with contextlib.suppress(OSError):
            await self.loop.sock_sendall(self.channel, job)
            self.channel.shutdown(socket.SHUT_WR)
            ack = await self.loop.sock_recv(self.channel, 1)
        if ack != b"J":
            raise SandboxLost("the sandbox died before it got its job")
        stdin_transport, _ = await self.loop.connect_write_pipe(asyncio.Protocol, self.popen.stdin)
        transports.append(stdin_transport)
        if stdin:
            stdin_transport.write(stdin)
        stdin_transport.close()

    async def _finish(self, transports: list) -> None:
        if self.alive or self.spec.process_group:
            await asyncio.shield(self._terminate())
        for transport in transports:
            transport.close()
        self._release()

    def _release(self) -> None:
        self.channel.close()
        for fd in (self._pidfd, self._init_pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pidfd = self._init_pidfd = None
        if self.spec.host_dir is not None:
            shutil.rmtree(self.spec.host_dir, ignore_errors=True)

    async def destroy(self) -> None:
        """Kill an unused (or failed) sandbox and wait until it is gone."""
        if self._pidfd is None:
            return
        await asyncio.shield(self._terminate())
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
        self._release()

    def destroy_now(self) -> None:
        """Synchronous `destroy` for finalizers: SIGKILL and reap, without the event loop."""
        if self._pidfd is None:
            return
        if not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self._pidfd)
        self.kill()
        deadline = time.monotonic() + _KILL_GRACE_S
        while self.popen.returncode is None:
            try:
                pid, status = os.waitpid(self.popen.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                self.popen.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                self._kill_host_process()
                os.waitpid(self.popen.pid, 0)
                break
            else:
                time.sleep(0.002)
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
        self._release()
