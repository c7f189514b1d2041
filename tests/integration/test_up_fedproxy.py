"""`peerlm up --fedproxy`: an owner and its cohort as real agent processes over mTLS.

The tiny gpt2 (4 blocks), not the micro one: the micro model has a single block, so κ = 0.5
removes nothing and the proxy would be the whole model; the tiny one is shipped (no build)
and its cohort rounds take seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _up(state: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "peerlm", "up", "--fedproxy", "-n", "3", "-r", "2", "--json",
            "--state-dir", str(state), *flags]  # fmt: skip


@pytest.mark.timeout(600)
def test_up_fedproxy_runs_two_cohort_rounds_and_members_pull_the_owners_merges(
    tmp_path: Path,
) -> None:
    """Owner + two members, two rounds: both merged each round; every proxy a member pulled
    is bit for bit what the owner published for that round (rounds 2 and 3: the merges of
    rounds 1 and 2); each update crossed the wire once; the members' own validation loss
    fell; the owner wrote the fused model."""
    state = tmp_path / "fed"
    out = subprocess.run(_up(state), capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 2
    cohort = result["fedproxy"]
    assert cohort["owner"] == "owner" and cohort["rounds"] == 2
    assert cohort["source_layers"] == 4 and len(cohort["kept_blocks"]) == 2
    assert [m["round"] for m in cohort["merges"]] == [1, 2]
    for merge in cohort["merges"]:
        assert merge["outcome"] == "complete", merge
        assert merge["merged"] == ["member-1", "member-2"] and not merge["deadline_passed"]
    members = {m["name"]: m for m in cohort["members"]}
    assert sorted(members) == ["member-1", "member-2"]
    for m in members.values():
        assert not m["errors"], m["errors"]
        assert m["rounds"] == 2 and m["merged_rounds"] == [1, 2] and m["absent"] == []
        assert m["proxies_pulled"] == 3 and m["proxies_as_published"] == 3
        assert m["bytes_down"] > 0 and m["bytes_up"] > 0
        # Measured on the member's own validation texts: the owner's round-1 proxy, then
        # the final merge it keeps.
        assert math.isfinite(m["heldout_before"]) and m["heldout_after"] < m["heldout_before"]
    # The owner pulls each update once: both members sent the same bytes (two updates of
    # one proxy's shapes), and what went out is what came in.
    assert members["member-1"]["bytes_up"] == members["member-2"]["bytes_up"]
    assert cohort["owner_bytes_received"] == sum(m["bytes_up"] for m in members.values())
    assert cohort["owner_bytes_sent"] == sum(m["bytes_down"] for m in members.values())
    for key in ("owner_heldout_before", "owner_heldout_after", "proxy_heldout_before"):
        assert math.isfinite(cohort[key]), key
    assert cohort["owner_heldout_texts"] > 0
    # The configurations `up` wrote: the owner's cohort is the members at their endpoints.
    configs = {n: json.loads((state / "agents" / f"{n}.yaml").read_text()) for n in members}
    owner = json.loads((state / "agents" / "owner.yaml").read_text())
    assert owner["fedproxy"]["cohort"] == {n: c["listen"] for n, c in configs.items()}
    assert owner["fedproxy"]["compress_ratio"] == 0.5
    assert all(c["fedproxy"]["owner_address"] == owner["listen"] for c in configs.values())
    ports = {c["metrics_port"] for c in (owner, *configs.values())}
    assert len(ports) == 3 and all(isinstance(p, int) and p > 0 for p in ports)
    assert (state / "agents" / "owner" / "fused" / "config.json").is_file()


def _pid_of(config: Path) -> int | None:
    """The process running ``peerlm agent --config <config>`` (a path unique to this test)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in argv and b"agent" in argv:
            return int(proc.name)
    return None


def _logged(log: Path, event: str, round_: int) -> bool:
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event and entry.get("round") == round_:
            return True
    return False


@pytest.mark.timeout(600)
def test_a_member_killed_mid_round_is_merged_without_after_the_deadline(tmp_path: Path) -> None:
    """member-2 is killed (SIGKILL) once round 1 is merged, while it pulls or trains round 2:
    the owner merges member-1 alone after the deadline and says so; `up` reports it and
    exits 1 (an agent gave no report)."""
    state = tmp_path / "fed"
    up = subprocess.Popen(
        _up(state, "--round-deadline", "45"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 400
        while not _logged(state / "logs" / "owner.log", "fedproxy_round_merged", 1):
            assert up.poll() is None, up.stderr.read() if up.stderr else ""
            assert time.monotonic() < deadline, "round 1 was not merged"
            time.sleep(0.2)
        pid = _pid_of(state / "agents" / "member-2.yaml")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 1, stderr[-3000:]
    # Why it exits 1, on stderr beside the JSON report: the member and its error.
    assert "member-2: no report (exit" in stderr
    cohort = json.loads(stdout)["fedproxy"]
    first, second = cohort["merges"]
    assert first["outcome"] == "complete"
    assert second["outcome"] == "partial" and second["deadline_passed"]
    assert second["merged"] == ["member-1"] and second["missing"] == ["member-2"]
    members = {m["name"]: m for m in cohort["members"]}
    assert members["member-1"]["merged_rounds"] == [1, 2] and not members["member-1"]["errors"]
    assert members["member-2"]["merged_rounds"] == [1]
    assert members["member-2"]["absent"] == ["2: deadline"]
    assert members["member-2"]["errors"]  # no report from a killed process
    log = (state / "logs" / "owner.log").read_text()
    assert '"fedproxy_final_not_pulled"' in log
