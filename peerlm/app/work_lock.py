"""One command at a time in a work directory.

``peerlm run-experiment`` rebuilds its world's data in ``<work>/data`` at start
(``build_federation_data(..., overwrite=True)``) and its worker processes read from it. Two
commands sharing a work directory (the default, ``state/experiment``) would each overwrite
the other's world: a run of ``--unskilled 1`` started beside a default run silently ran the
default world (2026-11-25). So a command holds an exclusive lock on ``<work>/.lock`` for its
whole run, and a second one is refused at once with the holder's pid, instead of waiting or
racing.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["WorkDirBusy", "work_dir_lock"]


class WorkDirBusy(RuntimeError):
    """Another process holds the work directory."""


@contextmanager
def work_dir_lock(work: Path) -> Iterator[None]:
    """Hold ``work``'s lock (created with the directory) for the body; raise
    :class:`WorkDirBusy` naming the holder when another process has it. The lock is the
    kernel's (``flock``): a holder that dies releases it."""
    work.mkdir(parents=True, exist_ok=True)
    fd = os.open(work / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise WorkDirBusy(
                f"work directory {work} is in use by another command (pid {holder}); give "
                "each concurrent run its own --work-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
