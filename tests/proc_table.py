"""The process table as tests read it (psutil): who is alive, who is whose child."""

from __future__ import annotations

import psutil


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children(pid: int) -> set[int]:
    """Live children of ``pid`` (none if it is gone)."""
    try:
        return {c.pid for c in psutil.Process(pid).children() if alive(c.pid)}
    except psutil.NoSuchProcess:
        return set()


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty if it is gone)."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
