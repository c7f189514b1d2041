"""`peerlm up` checks every flag before it touches the previous run's state."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from peerlm.app.cli import app


@pytest.mark.parametrize(
    "flags",
    [
        ["--family", "gtp2"],
        ["--simulated", "--overlay"],
        ["--simulated", "--family", "gpt2"],
        ["--overlay", "--aggregation", "fedavg"],
        ["--aggregation", "svd_hka"],  # aggregation is of overlay pulls
        ["--protocols", "akd,h_ties"],  # not on the CPM's menu
        ["--protocols", "pmix,pmix"],
        ["--protocols", ","],
        ["--simulated", "--protocols", "pmix"],  # simulated agents execute akd only
        ["--merge-senders", "3"],  # co-senders are for merge protocols: akd has none
        ["--protocols", "pmix", "--merge-senders", "0"],
        ["--protocols", "pmix", "--merge-senders", "17"],
        ["--workflow", "--simulated"],  # FedWave experts host models
        ["--workflow", "--overlay"],
        ["--workflow", "--protocols", "pmix"],
        ["--workflow", "--resume"],  # the expert loop does not checkpoint
        ["--workflow", "-n", "4"],  # one agent per stage of the code chain: 3
        ["--workflow", "--family", "gtp2"],
    ],
)
def test_a_bad_flag_leaves_the_last_run_untouched(tmp_path: Path, flags: list[str]) -> None:
    state = tmp_path / "fed"
    (state / "agents" / "agent-0" / "checkpoints").mkdir(parents=True)
    checkpoint = state / "agents" / "agent-0" / "checkpoints" / "round-3.safetensors"
    checkpoint.write_bytes(b"weights")
    db = state / "cpm.db"
    db.write_bytes(b"bandit")
    result = CliRunner().invoke(app, ["up", "--state-dir", str(state), *flags])
    assert result.exit_code == 2, result.output
    assert db.read_bytes() == b"bandit"
    assert checkpoint.read_bytes() == b"weights"
    assert not (state / "pki").exists()  # nothing provisioned either
