"""write_atomic: the whole file or the old one, with the mode asked for."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from peerlm.atomic_file import write_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_replaces_and_creates_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "file.bin"
    assert write_atomic(target, b"one") == target
    assert target.read_bytes() == b"one" and _mode(target) == 0o600  # private by default
    write_atomic(target, b"two", mode=0o644)
    assert target.read_bytes() == b"two" and _mode(target) == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]  # no temp left


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    write_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]
    with pytest.raises(FileExistsError):  # the directory is a file
        write_atomic(target / "inner", b"x")
