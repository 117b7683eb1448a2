"""Backends: how a sandbox process is started (bubblewrap, or the weaker rlimit-only mode).

A backend turns a `SandboxConfig` into a `LaunchSpec`: the host command that starts one sandbox
running the launcher (``_launcher.py``), the uid it runs as, and how to kill its process tree.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from reroll.sandbox.limits import SandboxConfig
from reroll.sandbox.result import SandboxUnavailable
from reroll.sandbox.seccomp import filter_program

logger = logging.getLogger(__name__)

LAUNCHER_SOURCE = (Path(__file__).with_name("_launcher.py")).read_text()
SYSTEM_PYTHON = "/usr/bin/python3"
_HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")


@dataclass
class LaunchSpec:
    """One sandbox start: ``argv`` runs the launcher, which reads its job from fd ``channel_fd``
    (appended to argv by the caller)."""

    argv: list[str]
    """The host command up to the backend's own options (bubblewrap and its mounts)."""
    tail: list[str]
    """The launcher command (after ``--info-fd N`` when ``info_fd``)."""
    env: dict[str, str]
    workdir: str
    """The workdir as the launcher sees it."""
    user: int | None = None
    group: int | None = None
    cwd: str | None = None
    pass_fds: tuple[int, ...] = ()
    info_fd: bool = False
    """bubblewrap: append ``--info-fd N`` so the host learns the pid of the namespace's init."""
    host_dir: str | None = None
    """rlimit mode: the host directory used as workdir, removed after the run."""
    process_group: bool = False
    """rlimit mode: the launcher leads its own session; the whole group is killed at the end."""
    sandbox_env: dict[str, str] = field(default_factory=dict)
    seccomp: bytes | None = None
    """bubblewrap: the BPF filter passed with ``--seccomp FD`` (see ``seccomp.py``)."""
    tmpfs_mounts: tuple[str, ...] = ()
    """bubblewrap: the private tmpfs mounts whose inode count the host caps before the job."""
    tmpfs_inodes: int | None = None


def _run_as(config: SandboxConfig) -> tuple[int | None, int | None]:
    if os.geteuid() == 0:
        return config.run_as_uid, config.run_as_gid
    return None, None


def _readable_by(path: str, uid: int | None, gid: int | None) -> bool:
    """Whether every directory leading to ``path`` can be searched by ``uid``/``gid``."""
    if uid is None:
        return True
    current = Path(path).resolve()
    for directory in [*reversed(current.parents), current]:
        st = directory.stat()
        if not stat.S_ISDIR(st.st_mode):
            continue
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def resolve_python(config: SandboxConfig) -> tuple[str, str | None]:
    """The interpreter to run inside the sandbox and the host tree to bind for it (``None`` when it
    lives under /usr, which is always bound). Prefers the system interpreter."""
    if config.python is not None:
        exe = os.path.realpath(config.python)
        if not os.access(exe, os.X_OK):
            raise SandboxUnavailable(f"sandbox python {config.python!r} is not an executable")
    elif os.access(SYSTEM_PYTHON, os.X_OK):
        exe = os.path.realpath(SYSTEM_PYTHON)
    else:
        exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if exe.startswith("/usr/"):
        return exe, None
    prefix = str(Path(exe).parent.parent)
    return exe, prefix


def python_argv(exe: str, config: SandboxConfig) -> list[str]:
    flags = ["-I", "-B"] if config.site_packages else ["-I", "-S", "-B"]
    return [exe, *flags, "-c", LAUNCHER_SOURCE]


def _sandbox_env(config: SandboxConfig) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": config.workdir,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }
    env.update(config.env)
    return env


class BwrapBackend:
    """bubblewrap: every namespace unshared (user, pid, net, ipc, uts, cgroup, mount), nested user
    namespaces disabled, a read-only view of /usr (and /bin, /lib... as on the host), a few /etc
    files the dynamic loader wants, a fresh /proc and /dev, size-capped private tmpfs for the
    workdir, /tmp and /dev/shm (their inode count capped too), a seccomp filter denying
    memfd_create, and nothing else. The sandbox dies with its host process."""

    name = "bwrap"

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.bwrap = config.bwrap_path or shutil.which("bwrap")
        if self.bwrap is None or not os.access(self.bwrap, os.X_OK):
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed, and the sandbox refuses to run untrusted code "
                "without it. Fix: `apt-get install bubblewrap` (Debian/Ubuntu; `dnf install "
                "bubblewrap` on Fedora). A much weaker rlimit-only mode exists for machines that "
                "cannot have it: SandboxConfig(backend='rlimit')."
            )
        self.uid, self.gid = _run_as(config)
        self.python, self.python_tree = resolve_python(config)
        self.seccomp = filter_program()
        if self.seccomp is None:
            logger.warning("sandbox: no seccomp filter for this architecture; memory held in "
                           "memfd_create files is not bounded")
        if os.geteuid() != 0:
            logger.warning("sandbox: the host process is not root, so the private tmpfs mounts "
                           "keep the kernel's default inode count (tmpfs_inodes is not applied)")
        for path in [self.python, *config.extra_ro_paths]:
            if not _readable_by(path, self.uid, self.gid):
                raise SandboxUnavailable(
                    f"{path} is not reachable by uid {self.uid}, which the sandbox runs as; use a "
                    f"system interpreter (`apt-get install python3`) or a path outside private homes"
                )

    def _mounts(self, tmpfs_bytes: int, binds: dict[str, str]) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for top in _TOP_LEVEL:
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        for path in _ETC_FILES:
            args += ["--ro-bind-try", path, path]
        trees = [self.python_tree] if self.python_tree else []
        for path in [*trees, *self.config.extra_ro_paths]:
            args += ["--ro-bind", path, path]
        size = str(tmpfs_bytes)
        args += ["--proc", "/proc", "--dev", "/dev"]
        for target in ("/dev/shm", "/tmp", self.config.workdir):
            if target in binds:  # a session's host directory (see files.py)
                args += ["--bind", binds[target], target]
            else:
                args += ["--size", size, "--tmpfs", target]
        return [*args, "--remount-ro", "/dev", "--remount-ro", "/"]

    def launch_spec(self, tmpfs_bytes: int, binds: dict[str, str] | None = None) -> LaunchSpec:
        """``binds``: host directories to bind read-write at some of the workdir, /tmp and
        /dev/shm (a session's) instead of private tmpfs mounts."""
        binds = binds or {}
        argv = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--cap-drop", "ALL",
            "--hostname", "sandbox",
            *self._mounts(tmpfs_bytes, binds),
            "--chdir", self.config.workdir,
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
        ]  # fmt: skip
        return LaunchSpec(
            argv=argv,
            tail=["--", *python_argv(self.python, self.config)],
            env=dict(_HOST_ENV),
            workdir=self.config.workdir,
            user=self.uid,
            group=self.gid,
            info_fd=True,
            sandbox_env=_sandbox_env(self.config),
            seccomp=self.seccomp,
            tmpfs_mounts=tuple(m for m in ("/dev/shm", "/tmp", self.config.workdir)
                               if m not in binds) if os.geteuid() == 0 else (),
            tmpfs_inodes=self.config.tmpfs_inodes,
        )


class RlimitBackend:
    """The weak mode: the launcher runs directly on the host, in its own session, in a fresh
    temporary directory, with an empty environment, the rlimits, and (as root) an unprivileged
    uid. No network, filesystem or process isolation. Only used when configured explicitly."""

    name = "rlimit"

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.uid, self.gid = _run_as(config)
        self.python, _ = resolve_python(config)
        logger.warning(
            "sandbox backend 'rlimit': WEAK isolation — programs run on the host with rlimits only "
            "(network, host files and host processes stay reachable). Install bubblewrap "
            "(`apt-get install bubblewrap`) and use backend='bwrap' for untrusted code."
        )

    def launch_spec(self, tmpfs_bytes: int) -> LaunchSpec:
        del tmpfs_bytes  # no private tmpfs in this mode
        host_dir = tempfile.mkdtemp(prefix="reroll-sandbox-")
        if self.uid is not None:
            os.chown(host_dir, self.uid, self.gid)
        env = _sandbox_env(self.config)
        env["HOME"] = env["TMPDIR"] = host_dir
        return LaunchSpec(
            argv=[],
            tail=python_argv(self.python, self.config),
            env=dict(_HOST_ENV),
            workdir=host_dir,
            user=self.uid,
            group=self.gid,
            cwd=host_dir,
            host_dir=host_dir,
            process_group=True,
            sandbox_env=env,
        )


def make_backend(config: SandboxConfig) -> BwrapBackend | RlimitBackend:
    if config.backend == "bwrap":
        return BwrapBackend(config)
    return RlimitBackend(config)
