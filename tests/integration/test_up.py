"""`peerlm up`: a dev CA, a CPM and agents as separate processes, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_runs_a_federation_and_reports(tmp_path: Path) -> None:
    state = tmp_path / "fed"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerlm",
            "up",
            "-n",
            "4",
            "-r",
            "3",
            "--json",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["cpm_exit_code"] == 0
    assert len(result["agents"]) == 4
    assert all(not a["errors"] for a in result["agents"])
    assert all(a["rounds"] == 3 for a in result["agents"])
    # Four agents, K_p = 2 pairs per round, 3 rounds: every student reported its reward.
    assert result["rewards_observed"] == sum(a["as_student"] for a in result["agents"])
    assert result["rewards_observed"] >= 4
    assert (state / "pki" / "ca.crt").exists() and (state / "cpm.db").exists()
    logs = (state / "logs" / "cpm.log").read_text()
    assert '"security_mode"' in logs and "mtls" in logs
