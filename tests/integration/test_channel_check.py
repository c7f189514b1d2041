"""The channel check (``python -m peerlm.app.channel_check``) on micro models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peerlm.app.channel_check import main

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(600)
def test_a_student_is_measured_before_and_after_each_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--size", "micro", "--models-dir", str(tmp_path / "models"),
            "--work-dir", str(tmp_path / "work"), "--prompts", "4", "--steps", "1,2",
            "--samples", "1", "--teacher", "1", "--student", "0"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # The teacher's own private category, fresh prompts of it, two budgets from one start.
    assert out["prompts"] == 4 and out["test_problems"] > 0
    assert set(out["after"]) == {"1", "2"}
    for measured in (out["teacher"], out["before"], *out["after"].values()):
        assert 0.0 <= measured["pass@1"] <= 1.0 and 0.0 <= measured["struct"] <= 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--teacher", "1", "--student", "1"], "must differ"),
        (["--steps", "0"], "positive step counts"),
    ],
)
def test_bad_arguments_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
