"""``peerlm bench agent-start``: both modes start every command and report its cost; the
forked mode really forks (a refusal is an error, not a silent new interpreter)."""

from __future__ import annotations

import json

from peerlm.bench.agent_start import render_report, run_benchmark
from rich.console import Console

from tests.cli import invoke_peerlm


def test_both_modes_report_wall_and_cpu_for_every_agent() -> None:
    seen: list[str] = []
    report = run_benchmark(2, 1, lambda label, done, total: seen.append(label), ("json",))
    assert [r["mode"] for r in report["rows"]] == ["interpreter", "forked"]
    for row in report["rows"]:
        assert row["agents"] == 2 and row["wall_s"] > 0 and row["cpu_s"] > 0
        assert row["cpu_per_agent_s"] == row["cpu_s"] / 2
    assert seen[-1] == "done"
    console = Console(record=True, width=120)
    render_report(report, console)
    assert "forked" in console.export_text()


def test_the_command_refuses_zero_agents_and_prints_json() -> None:
    refused = invoke_peerlm(["bench", "agent-start", "--agents", "0"])
    assert refused.exit_code == 2
    args = ["--agents", "1", "--repeats", "1", "--preload", "json", "--json"]
    done = invoke_peerlm(["bench", "agent-start", *args])
    assert done.exit_code == 0, done.output
    assert {r["mode"] for r in json.loads(done.stdout)["rows"]} == {"interpreter", "forked"}
