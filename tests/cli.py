"""``peerlm`` commands invoked in-process through typer's ``CliRunner``, for tests of what a
command refuses before it runs anything."""

from __future__ import annotations

from collections.abc import Sequence

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
