"""``peerlm bench overlay``: a tiny run reports every metric; argument parsing."""

from __future__ import annotations

import json
import math

import pytest
from peerlm.bench.cli import app
from peerlm.bench.overlay import BenchConfig, exact_top_k, parse_k, run_benchmark
from peerlm.overlay.population import PopulationSpec
from typer.testing import CliRunner

REQUIRED = {
    "recall_at_k",
    "hnsw_recall_at_k",
    "comparisons_per_query",
    "messages_per_query",
    "depth",
    "build_rounds",
    "build_seconds",
    "control_bytes_per_node",
    "unanswered_queries",
}


def test_parse_k() -> None:
    assert parse_k("10%") == (0.10, None)
    assert parse_k(" 25 ") == (None, 25)
    for bad in ("0%", "100%", "0", "x"):
        with pytest.raises(ValueError):
            parse_k(bad)
    cfg = BenchConfig(k="10%", zone_cap="5%")
    assert cfg.k_for(1000) == 100 and cfg.zone_cap_for(1000) == 50 and cfg.zone_cap_for(20) == 2
    assert BenchConfig(k="500").k_for(100) == 99


def test_exact_top_k_excludes_self() -> None:
    spec = PopulationSpec(dim=64, clusters=2, groups=1)
    from peerlm.overlay.population import ClusteredPopulation

    sigs = [m.signature for m in ClusteredPopulation(spec, 0).draw(10)]
    truth = exact_top_k(sigs, 3)
    assert all(len(t) == 3 and i not in t for i, t in enumerate(truth))


def test_small_run_with_churn_reports_every_metric() -> None:
    cfg = BenchConfig(
        peers=(60,),
        k="5",
        zone_cap="8",
        churn=0.2,
        rounds=2,
        period=12.0,
        population=PopulationSpec(dim=128, clusters=4, groups=2),
    )
    report = run_benchmark(cfg)
    assert set(report) >= REQUIRED
    run = report["runs"][0]
    assert run["n"] == 60 and run["k"] == 5 and run["zone_cap"] == 8
    assert run["queries"] == 120
    assert 0.5 <= run["recall_at_k"] <= 1.0
    assert 0.9 <= run["hnsw_recall_at_k"] <= 1.0
    assert run["depth"] >= 1 and run["roots"] == 1 and run["build_announced"] == 60
    assert run["build_rounds"] == pytest.approx(run["build_seconds"] / 0.1)
    assert run["comparisons_per_query"] > 0 and run["messages_per_query"] > 0
    assert all(math.isfinite(v) for v in run["recall_per_round"])
    json.dumps(report)


def test_cli_json() -> None:
    result = CliRunner().invoke(
        app, ["overlay", "--peers", "30", "--k", "3", "--rounds", "1", "--no-hnsw", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["runs"][0]["n"] == 30 and report["hnsw_recall_at_k"] is None
    bad = CliRunner().invoke(app, ["overlay", "--k", "150%"])
    assert bad.exit_code != 0


def test_a_missing_bench_extra_is_reported_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without usearch (the `bench` extra) the run stops at once with the fix, instead of
    failing at the HNSW step after minutes of simulation."""
    import sys

    monkeypatch.setitem(sys.modules, "usearch", None)  # what an uninstalled package looks like
    result = CliRunner().invoke(app, ["overlay", "--peers", "30", "--k", "3", "--rounds", "1"])
    assert result.exit_code == 2
    assert "bench` extra" in result.output and "usearch" in result.output
    assert "--no-hnsw" in result.output
