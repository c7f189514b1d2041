"""A dev federation's state directory is private: owner-only files and folders.

``peerlm up`` writes what no other user of the machine may read: each client's private
training and validation data, the CA's and every member's keys, the CPM's database
(profiles, rewards, the bandit), the agents' checkpoints (adapters trained on private
data) and the logs. With the usual umask 022 all of it was created 0644 / 0755.

:func:`make_private` closes that for everything at once rather than file by file: the
process's umask becomes 077 (:data:`PRIVATE_UMASK`), which every file the command and its
child processes (the CPM, the agents, which inherit it) create afterwards obeys, whatever
code creates it (SQLite, safetensors, log handlers, JSON writers); the state directory
itself is made 0700, so nothing below it is reachable by another user even where a file's
own mode is looser; and whatever an earlier run left below it is tightened to owner-only
(group and other bits cleared: 0644 becomes 0600, 0755 becomes 0700). Symbolic links are
neither followed nor changed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Final

__all__ = ["PRIVATE_UMASK", "make_private", "tighten"]

#: Owner-only: files 0600, folders 0700.
PRIVATE_UMASK: Final = 0o077
_OTHERS: Final = stat.S_IRWXG | stat.S_IRWXO


def tighten(root: Path) -> int:
    """Clear the group and other permission bits of ``root`` and of everything below it
    (not following symbolic links); returns how many paths changed."""
    changed = 0
    for path in [root, *root.rglob("*")]:
        try:
            st = path.lstat()
        except FileNotFoundError:  # removed while we walked (a log rotated, a temp file)
            continue
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & _OTHERS:
            continue
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~_OTHERS)
        changed += 1
    return changed


def make_private(root: Path) -> int:
    """Set this process's umask to :data:`PRIVATE_UMASK`, create ``root`` (0700) if
    needed and :func:`tighten` it; returns how many existing paths were tightened.

    The umask is process-wide on purpose: the commands that call this (``peerlm up``) are
    processes of their own whose every file, and every child process's, is private.
    """
    os.umask(PRIVATE_UMASK)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return tighten(root)
