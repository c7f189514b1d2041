"""Writing a file atomically: a reader sees the old content or the new, never a torn file.

Every peerlm file that another process or a restart reads back (adapters, VCLayers, task
banks) is written here: a temporary file in the same directory, flushed and fsynced, renamed
over the target, then the directory fsynced so that the rename itself survives a crash.
Written by hand (a dozen lines): the one library for it, ``atomicwrites``, has been
unmaintained since 2022 (last release 1.4.1) and its author archived it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically, creating its directory; returns ``path``.

    The file gets ``mode`` when given, else the temporary file's ``0600`` (private to the
    owner). On any failure the temporary file is removed and ``path`` is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
