"""The transfer benchmark runs end to end (real server process, certificates, three paths);
it reports numbers but no test asserts a timing."""

from __future__ import annotations

import io
import json

import pytest
from peerlm.bench.transfer import TransferConfig, render_report, run_benchmark
from rich.console import Console


@pytest.mark.timeout(300)
def test_one_small_run_reports_every_method() -> None:
    seen: list[str] = []
    report = run_benchmark(
        TransferConfig(sizes_mib=(1,), repeats=1, chunk_bytes=256 * 1024),
        lambda label, done, total: seen.append(label),
    )
    methods = [r["method"] for r in report["results"]]
    assert methods == ["raw_tls", "grpc", "peerlm"]
    assert all(r["bytes"] > 1024 * 1024 and r["mib_per_s"] > 0 for r in report["results"])
    assert report["results"][0]["ratio_to_raw_tls"] == 1.0
    json.dumps(report)  # --json output
    out = io.StringIO()
    render_report(report, Console(file=out, width=120))
    assert "peerlm" in out.getvalue() and seen[-1] == "done"
