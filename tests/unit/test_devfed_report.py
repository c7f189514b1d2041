"""`peerlm up`'s final report: the columns, the narrow layout, bytes with overlay pulls."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from peerlm.app.devfed_report import _agent_rows, _vertical, print_report

_AGENT: dict[str, Any] = {
    "name": "agent-0",
    "model": "/state/models/gpt2",
    "pass_at_1_before": 0.1,
    "pass_at_1_after": 0.2,
    "exchanges": 2,
    "as_teacher": 1,
    "rewards": [0.01, 0.03],
    "bytes_sent": 4096,
    "bytes_received": 2048,
    "overlay_bytes_received": 10240,
    "overlay_bytes_sent": 1024,
    "adapters_pulled": 3,
    "slices_before": {"lacked": {"pass1": 0.0, "nll": 1.5}, "own": {"pass1": 0.25, "nll": 0.9}},
    "slices_after": {"lacked": {"pass1": 0.5, "nll": 1.2}, "own": {"pass1": 0.5, "nll": 0.8}},
    "errors": [],
}
_RESULT: dict[str, Any] = {"rounds": 2, "seconds": 12.5, "agents": [_AGENT]}


def test_rows_show_slices_before_after_and_bytes_with_overlay_pulls() -> None:
    rows = dict(_agent_rows(_AGENT))
    assert rows["model"] == "gpt2"
    assert rows["lacked pass@1"] == "0.00→0.50" and rows["lacked NLL"] == "1.500→1.200"
    assert rows["own pass@1"] == "0.25→0.50"
    assert rows["rewards"] == "2, mean 0.0200"
    assert rows["KB sent/recv"] == "5/12"  # 4 + 1 KB sent, 2 + 10 KB received
    assert rows["exch s/t"] == "2/1"


def test_rows_of_an_agent_without_slices_or_rewards() -> None:
    rows = dict(_agent_rows({"name": "sim-0", "errors": ["boom"]}))
    assert rows["lacked pass@1"] == "-" and rows["rewards"] == "0" and rows["errors"] == "boom"


def test_narrow_or_piped_output_is_vertical_and_fits_100_columns() -> None:
    buf = io.StringIO()
    print_report(Console(file=buf, width=100), _RESULT)  # a file: not a terminal
    text = buf.getvalue()
    assert text == _vertical(_RESULT) + "\n"
    assert "agent-0:" in text and "lacked pass@1" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_wide_terminal_gets_a_table() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=160, force_terminal=True, color_system=None)
    print_report(console, _RESULT)
    text = buf.getvalue()
    assert "lacked NLL" in text and "1.500→1.200" in text
    assert "agent-0:" not in text  # not the vertical layout
