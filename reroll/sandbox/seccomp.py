"""The seccomp filter bubblewrap installs in every sandbox (``bwrap --seccomp FD``).

It denies ``memfd_create`` (EPERM). Memory held in memfd files is charged to no rlimit:
RLIMIT_AS counts only what is mapped and the tmpfs size caps do not cover anonymous files, so one
program held 1920 MiB under a 1 GiB limit by writing into memfds. A memory cgroup would count it,
but needs a writable cgroup tree on the host, which containers often lack; the filter works
wherever bubblewrap does. Everything else a program may allocate is bounded already: mapped
memory by RLIMIT_AS, files by the size-capped tmpfs mounts (workdir, /tmp, /dev/shm, which also
back POSIX shared memory).

The program is classic BPF built here (no libseccomp): check the architecture, then the syscall
number. On x86-64 the x32 ABI (numbers with bit 30 set) is denied as a whole, and so is every
syscall of a foreign architecture (i386 through ``int 0x80``).
"""

from __future__ import annotations

import errno
import os
import platform
import struct

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
_X32_BIT = 0x40000000

# machine -> (AUDIT_ARCH_*, memfd_create's number, whether the x32 ABI exists)
ARCHES = {
    "x86_64": (0xC000003E, 319, True),
    "aarch64": (0xC00000B7, 279, False),
}

DENIED = ("memfd_create",)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The BPF program (``struct sock_filter[]``) for this machine; None where the architecture
    is not known here (the caller then runs without it and says so)."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, memfd_nr, has_x32 = arch
    body = [_insn(_LD_W_ABS, 0)]  # A = seccomp_data.nr
    if has_x32:
        body.append(_insn(_JGE_K, _X32_BIT, jt=1 + 1, jf=0))  # x32: to DENY (skip JEQ, ALLOW)
    body.append(_insn(_JEQ_K, memfd_nr, jt=1, jf=0))  # memfd_create: to DENY
    body.append(_insn(_RET_K, _ALLOW))
    deny = _insn(_RET_K, _DENY)
    # arch check first: a foreign arch jumps over the body straight to DENY
    head = [_insn(_LD_W_ABS, 4), _insn(_JEQ_K, audit_arch, jt=0, jf=len(body))]
    return b"".join([*head, *body, deny])


def filter_fd(program: bytes) -> int:
    """A readable descriptor holding ``program`` (bubblewrap reads it to the end); the caller
    passes it to bubblewrap and closes it after the start."""
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few dozen bytes: always fits the pipe's buffer
    finally:
        os.close(write)
    return read
