"""``peerlm bench cpm``: the quick benchmark runs and reports every metric."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from peerlm.bench.cli import app, parse_sizes
from peerlm.bench.cpm import (
    METHODS,
    METRIC_KEYS,
    BenchParams,
    RunSpec,
    mabwiser_available,
    params_with,
    run_benchmark,
    run_one,
    summarise,
)
from typer.testing import CliRunner

TINY = params_with(
    BenchParams.quick(),
    sizes=(6,),
    heterogeneities=("high",),
    rounds=8,
    seeds=2,
    final_window=2,
    speed_n_prefilter=80,
    speed_n_exact=12,
    observe_updates=500,
    mabwiser_n=6,
    mabwiser_updates=40,
)


@pytest.mark.slow
def test_quick_benchmark_reports_every_metric() -> None:
    report = run_benchmark(BenchParams.quick())
    rows = report["results"]
    settings = {(r["n"], r["heterogeneity"]) for r in rows}
    assert settings == {(8, "high"), (8, "low"), (16, "high"), (16, "low")}
    for row in rows:
        assert set(row) == set(METRIC_KEYS)
    by = {(r["n"], r["heterogeneity"], r["method"]): r for r in rows}
    for n, het in settings:
        for method in METHODS:
            row = by[(n, het, method)]
            assert row["seeds"] == 2
            assert 0.0 < row["final_pass_at_1"] < 1.0
            assert row["regret_final"] >= row["regret_half"] - 1e-9
            assert 0.0 <= row["js_mean"] <= 1.0
        assert by[(n, het, "random")]["gain_vs_random_pct"] == pytest.approx(0.0)
        assert by[(n, het, "oracle")]["fraction_of_oracle"] == pytest.approx(1.0)
        assert abs(by[(n, het, "oracle")]["regret_final"]) < 1e-6
        assert by[(n, het, "linucb")]["rewards_per_s"] > 0
        assert by[(n, het, "random")]["rewards_per_s"] is None
    speed = report["speed"]
    assert speed["select_prefilter"]["prefilter"] is True
    assert speed["select_prefilter"]["median_ms"] > 0
    assert speed["select_exact"]["prefilter"] is False
    scaling = speed["select_scaling"]
    assert [r["n"] for r in scaling["rows"]] == [100, 200]
    assert all(r["cpu_median_ms"] > 0 and r["wall_median_ms"] > 0 for r in scaling["rows"])
    assert isinstance(scaling["cpu_growth_exponent"], float)
    assert isinstance(scaling["allocator_retains_freed_memory"], bool)
    # Below the clustering threshold the search is exact: recall 1 by construction.
    assert all(r["top_k_search"] == "exact" for r in scaling["rows"])
    assert all(r["top_k_recall"] == 1.0 for r in scaling["rows"])
    assert speed["observe"]["updates_per_s"] > 0
    if mabwiser_available():
        assert report["mabwiser_compared"] is True
        assert speed["mabwiser"]["mabwiser_partial_fit_single_per_s"] > 0
        assert (8, "high", "mabwiser-linucb") in by
    else:
        assert "skipped" in speed["mabwiser"]
    curve = report["curves"]["8/high/linucb"]
    assert len(curve["pass_mean"]) == 13 and len(curve["regret_mean"]) == 12


def test_runs_are_deterministic_and_share_the_initial_state() -> None:
    a = run_one(RunSpec(8, "high", 3, "linucb", 6))
    b = run_one(RunSpec(8, "high", 3, "linucb", 6))
    assert a.pass_curve == b.pass_curve and a.regret_curve == b.regret_curve
    c = run_one(RunSpec(8, "high", 3, "random", 6))
    assert c.pass_curve[0] == a.pass_curve[0]


def test_oracle_has_no_regret_and_others_do() -> None:
    runs = [run_one(RunSpec(8, "low", s, m, 6)) for s in range(2) for m in METHODS]
    rows = summarise(runs, 2)["results"]
    for row in rows:
        if row["method"] == "oracle":
            assert abs(row["regret_final"]) < 1e-6
        else:
            assert row["regret_final"] > 0
            assert (
                row["cum_expected_reward"]
                <= next(r for r in rows if r["method"] == "oracle")["cum_expected_reward"] + 1e-9
            )


def test_parallel_jobs_give_the_same_results() -> None:
    params = params_with(TINY, speed=False, mabwiser=False)
    one = run_benchmark(params)
    two = run_benchmark(params_with(params, jobs=2))
    strip = ("rewards_per_s", "select_ms")
    assert [{k: v for k, v in r.items() if k not in strip} for r in one["results"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in two["results"]
    ]


def test_cli_json_output_parses(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the optional 'bench' extra draws the plots
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["cpm", "--quick", "--json", "--sizes", "6", "--rounds", "6", "--seeds", "2",
         "--jobs", "1", "--no-speed", "--plots", str(tmp_path / "plots")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {r["n"] for r in report["results"]} == {6}
    assert report["params"]["rounds"] == 6
    assert "speed" not in report
    for row in report["results"]:
        assert set(row) == set(METRIC_KEYS)
        assert math.isfinite(row["final_pass_at_1"])
    assert len(report["plots"]) == 2
    assert all(Path(p).stat().st_size > 0 for p in report["plots"])


@pytest.mark.slow
def test_cli_tables() -> None:
    result = CliRunner().invoke(
        app,
        ["cpm", "--quick", "--sizes", "6", "--rounds", "4", "--seeds", "2", "--jobs", "1"],
        env={"COLUMNS": "220"},
    )
    assert result.exit_code == 0, result.output
    assert "Oracle" in result.stdout and "Speed" in result.stdout


def test_parse_sizes() -> None:
    assert parse_sizes("8,16, 32") == (8, 16, 32)
    import typer

    for bad in ("", "a,b", "1"):
        with pytest.raises(typer.BadParameter):
            parse_sizes(bad)
