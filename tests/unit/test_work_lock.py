"""One command at a time in a work directory: a second ``run-experiment`` on a held work
directory is refused at once, naming the holder, and leaves the holder's world alone."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from peerlm.app.work_lock import WorkDirBusy, work_dir_lock
from tests.cli import invoke_peerlm

HOLD = """
import sys
from pathlib import Path
from peerlm.app.work_lock import work_dir_lock
with work_dir_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def held_elsewhere(work: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``work`` until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(work)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_held_work_directory_is_refused_naming_its_holder(tmp_path: Path) -> None:
    work = tmp_path / "work"
    with held_elsewhere(work) as holder:
        busy = rf"pid {holder.pid}\b.*--work-dir"
        with pytest.raises(WorkDirBusy, match=busy), work_dir_lock(work):
            pass
    # Released when the holder ends (a dead holder releases it too: the lock is the kernel's).
    with work_dir_lock(work):
        pass


def test_the_lock_is_taken_again_after_the_body_and_after_an_error(tmp_path: Path) -> None:
    with work_dir_lock(tmp_path):
        pass
    with pytest.raises(KeyError), work_dir_lock(tmp_path):
        raise KeyError("boom")
    with work_dir_lock(tmp_path):
        pass


def test_run_experiment_on_a_held_work_directory_exits_2_and_touches_nothing(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    world = work / "data" / "manifest.json"
    world.parent.mkdir(parents=True)
    world.write_text("the holder's world")
    with held_elsewhere(work) as holder:
        result = invoke_peerlm(
            ["run-experiment", "--quick", "--micro", "--work-dir", str(work),
             "--out", str(tmp_path / "out")],
        )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--work-dir" in result.output and str(holder.pid) in result.output
    assert world.read_text() == "the holder's world"
    assert not (tmp_path / "out").exists()
