"""The FedProxy benchmark runs end to end on a tiny model (compress, rounds, merge, fuse);
it reports numbers but no test asserts which method wins."""

from __future__ import annotations

import io
import json

import pytest
from peerlm.bench.cli import app
from peerlm.bench.fedproxy import FedProxyBenchConfig, render_report, run_benchmark
from rich.console import Console
from typer.testing import CliRunner


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.mark.timeout(600)
def test_one_small_run_reports_every_method_for_proxy_and_fused_model() -> None:
    seen: list[str] = []
    # two rounds: the second trains with PCR on the first round's conflict scores
    cfg = FedProxyBenchConfig(rounds=2, local_steps=1, clients=2, methods=("fedavg", "h_ties_pcr"))
    report = run_benchmark(cfg, lambda label, done, total: seen.append(label))
    names = set(report["mean_nll"])
    assert names == {
        "base_full", "base_proxy", "fedavg_proxy", "fedavg_fused", "h_ties_pcr_proxy",
        "h_ties_pcr_fused",
    }  # fmt: skip
    for slices in report["mean_nll"].values():
        assert slices["private"] > 0 and slices["public"] > 0
    diff = report["vs_fedavg"]["h_ties_pcr_proxy"]["private"]
    assert diff["low"] <= diff["mean"] <= diff["high"]
    # training moved the proxy away from the compressed start
    assert report["mean_nll"]["fedavg_proxy"] != report["mean_nll"]["base_proxy"]
    assert len(report["compress"]["kept_blocks"]) == 2
    json.dumps(report)
    out = io.StringIO()
    render_report(report, Console(file=out, width=160))
    assert "h_ties_pcr_fused" in out.getvalue()
    assert len(seen) == 2 * 2 * 2


def test_the_cli_refuses_methods_without_the_fedavg_reference() -> None:
    result = CliRunner().invoke(app, ["fedproxy", "--methods", "h_ties"])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["fedproxy", "--methods", "fedavg,magic"])
    assert result.exit_code == 2
