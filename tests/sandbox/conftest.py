"""Shared helpers of the sandbox tests: a real bubblewrap sandbox and host-side process probes."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from reroll.sandbox import Limits, Sandbox


def host_pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def descendants(root: int | None = None) -> set[int]:
    """Live (non-zombie) host processes descending from ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    for pid in host_pids():
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
        if not stat:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] != "Z":
            parent[pid] = int(fields[1])
    found = set()
    for pid in parent:
        cursor, seen = pid, 0
        while cursor in parent and seen < 1000:
            cursor, seen = parent[cursor], seen + 1
            if cursor == root:
                found.add(pid)
                break
    return found


def procs_with(token: str) -> list[int]:
    """Host processes whose command line or environment contains ``token``."""
    needle = token.encode()
    return [
        pid
        for pid in host_pids()
        if pid != os.getpid()
        and (needle in _read(f"/proc/{pid}/cmdline") or needle in _read(f"/proc/{pid}/environ"))
    ]


def procs_in_namespace(ns_link: str) -> list[int]:
    """Host processes in the pid namespace named ``ns_link`` (e.g. ``pid:[4026532181]``)."""
    found = []
    for pid in host_pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ns_link:
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture
def host() -> SimpleNamespace:
    """Host-side process probes: ``descendants()``, ``procs_with(token)``,
    ``procs_in_namespace(link)``, ``pids()``."""
    return SimpleNamespace(
        descendants=descendants,
        procs_with=procs_with,
        procs_in_namespace=procs_in_namespace,
        pids=host_pids,
    )


@pytest.fixture
def sandbox() -> Sandbox:
    """A real bubblewrap sandbox (fails with the install hint when bubblewrap is missing)."""
    return Sandbox(limits=Limits(wall_time_s=20, cpu_time_s=10))
