"""``peerlm`` commands invoked in-process through typer's ``CliRunner``, for tests of what a
command refuses before it runs anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog
from typer.testing import CliRunner, Result


def invoke_peerlm(args: Sequence[str]) -> Result:
    """``peerlm ARGS`` in this process; the result (exit code, output).

    The command points structlog at CliRunner's stderr, which is closed after ``invoke``:
    the suite's structlog configuration is put back, or later tests' log lines would fail
    on a closed file."""
    from peerlm.app.cli import app

    saved = structlog.get_config()
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        structlog.configure(**saved)


def assert_run_experiment_refuses(out: Path, flags: Sequence[str], mentions: str) -> None:
    """``peerlm run-experiment --out OUT FLAGS`` is refused before anything runs: exit 2, a
    message that names ``mentions``, and nothing written."""
    result = invoke_peerlm(["run-experiment", "--out", str(out), *flags])
    assert result.exit_code == 2, result.output
    assert mentions in result.output
    assert not out.exists()
