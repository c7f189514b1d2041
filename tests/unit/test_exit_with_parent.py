"""``peerlm.process.exit_with_parent``: a worker ends once the process that started it is
gone, and not before: a spawned worker (its child) and one forked by multiprocessing's fork
server (the server's child)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proc_table import alive

SCRIPT = """
import multiprocessing, os, sys, time
from peerlm.process import exit_with_parent

def child(parent):
    exit_with_parent(parent, poll_s=0.05)
    time.sleep(600)

if __name__ == "__main__":
    how = sys.argv[1]
    ctx = multiprocessing.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload([])
    p = ctx.Process(target=child, args=(os.getpid(),))
    p.start()
    print(p.pid, flush=True)
    sys.stdin.readline()
    os._exit(0)  # gone without a word: no join, no terminate
"""


@pytest.mark.parametrize("how", ["spawn", "forkserver"])
def test_a_worker_lives_with_its_parent_and_ends_after_it(tmp_path: Path, how: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdin is not None
    child = int(proc.stdout.readline())
    try:
        time.sleep(0.5)  # ten polls of the watch
        assert alive(child), "the worker ended while its parent lived"
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(30)
        until = time.monotonic() + 20
        while alive(child) and time.monotonic() < until:
            time.sleep(0.05)
        assert not alive(child), "the worker outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        if alive(child):
            import os
            import signal

            os.kill(child, signal.SIGKILL)
