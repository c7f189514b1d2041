"""``peerlm data build`` prints what the agents' configuration needs, in full."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from peerlm.app.cli_data import app


def test_data_build_prints_the_full_transfer_hash(tmp_path: Path) -> None:
    args = ["build", "--dir", str(tmp_path / "d"), "--clients", "2"]
    args += ["--per-private", "8", "--per-public", "4", "--test-per-category", "1"]
    args += ["--transfer-per-private", "2", "--transfer-per-public", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    digest = manifest["transfer_sha256"]
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    # The agents' `transfer_sha256` setting must be the whole digest, so print all of it.
    assert f"transfer sha256 {digest}" in result.output
