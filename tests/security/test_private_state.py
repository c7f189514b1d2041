"""`peerlm up`'s state directory is owner-only: data, keys, the CPM database, logs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from peerlm.app.private_state import make_private, tighten

OTHERS = stat.S_IRWXG | stat.S_IRWXO
UP = (sys.executable, "-m", "peerlm", "up", "--json")


def _open_to_others(root: Path) -> list[str]:
    return [
        f"{p.relative_to(root)} {stat.S_IMODE(p.lstat().st_mode):o}"
        for p in [root, *root.rglob("*")]
        if not p.is_symlink() and p.lstat().st_mode & OTHERS
    ]


@pytest.mark.integration
def test_up_leaves_nothing_readable_by_others_under_a_permissive_umask(tmp_path: Path) -> None:
    """Started with umask 022 (files 0644 before), a simulated federation's state
    directory (PKI, CPM database and WAL, configs, logs, agents' state) is all owner-only,
    and a state directory an earlier run left open is tightened."""
    state = tmp_path / "fed"
    (state / "logs").mkdir(parents=True)
    old = state / "logs" / "cpm.log"
    old.write_text("an earlier run's log\n")
    os.chmod(state, 0o755)
    os.chmod(old, 0o644)
    out = subprocess.run(
        [*UP, "--state-dir", str(state), "--simulated", "-n", "2", "-r", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        umask=0o022,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["rounds_completed"] == 1
    assert (state / "cpm.db").exists() and (state / "pki" / "agent-0.key").exists()
    # The CPM's port file holds a port number, public by design (process.write_port_file).
    assert _open_to_others(state) in ([], ["cpm.port 644"])
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_tighten_clears_group_and_other_bits_and_leaves_links(tmp_path: Path) -> None:
    root = tmp_path / "state"
    (root / "data").mkdir(parents=True)
    data = root / "data" / "train.jsonl"
    data.write_text("{}\n")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\n")
    os.chmod(root / "data", 0o755)
    os.chmod(data, 0o644)
    os.chmod(script, 0o755)
    outside = tmp_path / "public.txt"
    outside.write_text("public")
    os.chmod(outside, 0o644)
    (root / "link").symlink_to(outside)
    assert tighten(root) >= 3
    assert stat.S_IMODE(data.stat().st_mode) == 0o600
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "data").stat().st_mode) == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # a link is not followed
    assert tighten(root) == 0


def test_make_private_sets_the_umask_for_what_is_written_next(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        make_private(tmp_path / "fed")
        (tmp_path / "fed" / "cpm.db").write_bytes(b"")
        assert stat.S_IMODE((tmp_path / "fed" / "cpm.db").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "fed").stat().st_mode) == 0o700
    finally:
        os.umask(before)
