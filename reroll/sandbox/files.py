"""A session's files on the host: its directory (a size-capped tmpfs), and reads, writes,
listings and copies that can never leave it.

The session's programs own the directory's contents and may plant symlinks, FIFOs or ``..``
tricks in it, while the host (root here) reads and writes it for the caller. So every path is
walked one component at a time from a descriptor of the session root with ``O_NOFOLLOW``: a
symlink anywhere on the path is refused, not followed, and no check-then-open race exists
because nothing is resolved by name from the top again. Only regular files are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import posixpath
import shutil
import stat
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_LIBC = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV = 2, 4  # no set-uid file or device node of a session means anything
SUBDIRS = {"work": 0o755, "tmp": 0o1777, "shm": 0o1777}
"""The session tmpfs's directories: the workdir, /tmp and /dev/shm (one quota for the three)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathError(ValueError):
    """A path that is not inside the session, or names no file of the right kind."""


@dataclass(frozen=True)
class Entry:
    path: str
    """Relative to the session's workdir."""
    type: str
    """``file``, ``dir``, ``symlink`` or ``other`` (FIFO, socket)."""
    size: int

    def as_dict(self) -> dict:
        return {"path": self.path, "type": self.type, "size": self.size}


def relative(path: str, workdir: str) -> str:
    """``path`` (relative, or absolute under ``workdir``) as a normalised relative path; ``""``
    is the workdir itself. Raises `PathError` for anything that leaves it."""
    if not isinstance(path, str) or "\0" in path:
        raise PathError(f"path {path!r} must be a string without NUL bytes")
    if path.startswith("/"):
        if path != workdir and not path.startswith(workdir + "/"):
            raise PathError(f"path {path!r} is outside the session's {workdir}")
        path = path[len(workdir):]
    norm = posixpath.normpath(path.lstrip("/") or ".")
    if norm == "..." or norm.split("/")[0] == "..":
        raise PathError(f"path {path!r} leaves the session's {workdir}")
    return "" if norm == "." else norm


def _open_dir(root_fd: int, parts: list[str], create: bool, owner: tuple[int, int] | None) -> int:
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except OSError:
        os.close(fd)
        raise


def _explain(exc: OSError, path: str) -> PathError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return PathError(f"{path!r}: a symlink or a non-directory is on the path (symlinks are "
                         "not followed on the host)")
    if exc.errno == errno.ENOENT:
        return PathError(f"{path!r}: no such file or directory")
    if exc.errno == errno.ENOSPC:
        return PathError(f"{path!r}: the session's disk quota is full")
    return PathError(f"{path!r}: {exc.strerror}")


class SessionDir:
    """The host directory of one session, bound read-write as the sandbox's workdir."""

    def __init__(self, path: str, workdir: str, owner: tuple[int, int] | None,
                 mounted: bool = False) -> None:
        self.path = path
        self.workdir = workdir
        self.owner = owner
        """The sandbox's host uid/gid (as root); files the host writes are given to it."""
        self.mounted = mounted and os.path.ismount(path)

    def create(self, quota_bytes: int, inodes: int) -> None:
        """Make the directory; as root, a tmpfs of ``quota_bytes`` (the session's disk quota),
        holding the sandbox's workdir, /tmp and /dev/shm (``SUBDIRS``)."""
        os.makedirs(self.path, mode=0o700)
        if os.geteuid() != 0:
            logger.warning("sandbox sessions: the host process is not root, so a session's "
                           "directory is a plain directory and its disk quota is not enforced")
        else:
            uid, gid = self.owner or (0, 0)
            options = f"size={quota_bytes},nr_inodes={inodes},mode=0755,uid={uid},gid={gid}"
            if _LIBC.mount(b"reroll-session", self.path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                           options.encode()) != 0:
                err = ctypes.get_errno()
                os.rmdir(self.path)
                raise OSError(err, f"cannot mount the session's tmpfs: {os.strerror(err)}")
            self.mounted = True
        for name, mode in SUBDIRS.items():
            target = os.path.join(self.path, name)
            os.mkdir(target)
            os.chmod(target, mode)
            if self.owner is not None:
                os.chown(target, *self.owner)

    def remove(self) -> None:
        if self.mounted:
            if _LIBC.umount2(self.path.encode(), _MNT_DETACH) == 0:
                self.mounted = False
            else:
                logger.warning("cannot unmount %s: %s", self.path,
                               os.strerror(ctypes.get_errno()))
        if not self.mounted:
            shutil.rmtree(self.path, ignore_errors=True)

    async def remove_async(self) -> None:
        """`remove` in a thread (an unmount waits ~5-12 ms for RCU here, which would stall the
        event loop); it completes even if the caller is cancelled meanwhile."""
        loop = asyncio.get_running_loop()
        await asyncio.shield(loop.run_in_executor(None, self.remove))

    def binds(self, workdir: str) -> dict[str, str]:
        """Sandbox path -> host path, for bubblewrap's ``--bind``."""
        return {workdir: os.path.join(self.path, "work"), "/tmp": os.path.join(self.path, "tmp"),
                "/dev/shm": os.path.join(self.path, "shm")}

    @property
    def root(self) -> str:
        """The workdir's host path: what the file API reads and writes."""
        return os.path.join(self.path, "work")

    def usage(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    @contextlib.contextmanager
    def _parent(self, path: str, create: bool = False):
        rel = relative(path, self.workdir)
        if not rel:
            raise PathError(f"{path!r} is the workdir itself, not a file")
        *dirs, name = rel.split("/")
        root = os.open(self.root, _DIR_FLAGS)
        try:
            fd = _open_dir(root, dirs, create, self.owner)
        except OSError as exc:
            raise _explain(exc, path) from None
        finally:
            os.close(root)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def read(self, path: str, max_bytes: int) -> bytes:
        with self._parent(path) as (parent, name):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=parent)
            except OSError as exc:
                raise _explain(exc, path) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PathError(f"{path!r} is not a regular file")
            if st.st_size > max_bytes:
                raise PathError(f"{path!r} has {st.st_size} bytes, more than the {max_bytes} a "
                                "read may return")
            with os.fdopen(fd, "rb", closefd=False) as handle:
                return handle.read(max_bytes + 1)[:max_bytes]
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        with self._parent(path, create=True) as (parent, name):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_NONBLOCK | os.O_CLOEXEC, mode & 0o777, dir_fd=parent)
            except OSError as exc:
                raise _explain(exc, path) from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise PathError(f"{path!r} exists and is not a regular file")
                if self.owner is not None:
                    os.fchown(fd, *self.owner)
                os.fchmod(fd, mode & 0o777)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                raise _explain(exc, path) from None
            finally:
                os.close(fd)

    def list(self, path: str = "", recursive: bool = False, limit: int = 10000) -> list[Entry]:
        rel = relative(path, self.workdir)
        root = os.open(self.root, _DIR_FLAGS)
        try:
            fd = _open_dir(root, rel.split("/") if rel else [], False, None)
        except OSError as exc:
            raise _explain(exc, path) from None
        finally:
            os.close(root)
        found: list[Entry] = []
        try:
            self._scan(fd, rel, recursive, found, limit)
        finally:
            os.close(fd)
        return sorted(found, key=lambda e: e.path)

    def _scan(self, fd: int, prefix: str, recursive: bool, found: list[Entry], limit: int) -> None:
        for name in sorted(os.listdir(fd)):
            if len(found) >= limit:
                return
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
            rel = f"{prefix}/{name}" if prefix else name
            found.append(Entry(rel, kind, st.st_size))
            if recursive and kind == "dir":
                with contextlib.suppress(OSError):
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        self._scan(sub, rel, True, found, limit)
                    finally:
                        os.close(sub)

    def copy_to(self, other: SessionDir) -> None:
        """Copy this session's workdir and /tmp (files, directories, and symlinks as links, never
        followed; FIFOs and sockets skipped) into ``other``'s."""
        for name in ("work", "tmp"):
            src = os.open(os.path.join(self.path, name), _DIR_FLAGS)
            dst = os.open(os.path.join(other.path, name), _DIR_FLAGS)
            try:
                _copy_tree(src, dst, other.owner)
            finally:
                os.close(src)
                os.close(dst)


def _copy_tree(src: int, dst: int, owner: tuple[int, int] | None) -> None:
    for name in os.listdir(src):
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(name, st.st_mode & 0o1777, dir_fd=dst)
            sub_src = os.open(name, _DIR_FLAGS, dir_fd=src)
            sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst)
            try:
                _copy_tree(sub_src, sub_dst, owner)
                os.fchmod(sub_dst, st.st_mode & 0o1777)
            finally:
                os.close(sub_src)
                os.close(sub_dst)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src, dst, name, st.st_mode)
        else:
            continue
        if owner is not None:
            os.chown(name, *owner, dir_fd=dst, follow_symlinks=False)


def _copy_file(src: int, dst: int, name: str, mode: int) -> None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fin = os.open(name, flags, dir_fd=src)
    try:
        fout = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                       mode & 0o777, dir_fd=dst)
        try:
            offset, size = 0, os.fstat(fin).st_size
            while offset < size:
                sent = os.sendfile(fout, fin, offset, size - offset)
                if sent == 0:
                    break
                offset += sent
            os.fchmod(fout, mode & 0o777)  # never set-uid bits
        finally:
            os.close(fout)
    finally:
        os.close(fin)
