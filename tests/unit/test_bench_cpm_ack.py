"""``peerlm bench cpm-ack`` in quick mode: a real CPM process, the report's shape, and that
every acknowledged reward is in the bandit (no timing is asserted)."""

from __future__ import annotations

import json

from peerlm.bench.cli import app
from peerlm.bench.cpm_ack import AckParams, run_benchmark
from typer.testing import CliRunner


def test_quick_run_acknowledges_every_reward_once() -> None:
    params = AckParams(clients=(1, 3), rewards_per_client=4, min_rewards=12)
    seen: list[str] = []
    report = run_benchmark(params, lambda label, done, total: seen.append(label))
    assert [lv["clients"] for lv in report["levels"]] == [1, 3]
    for lv in report["levels"]:
        for kind in ("cpm", "cpm_stream"):
            assert lv[kind]["acked"] == 12 == lv[kind]["bandit_updates"]
            assert lv[kind]["p50_ms"] <= lv[kind]["p99_ms"]
        assert lv["sqlite"]["rows"] == 12
        assert lv["ratio"] > 0 and lv["stream_ratio"] > 0
        # The bare transport's ceiling is measured with the same client pattern.
        assert lv["echo"]["acked"] == 12
        assert lv["echo_ratio"] > 0 and lv["stream_share_of_echo"] > 0
    assert seen[-1] == "done"


def test_cli_rejects_bad_client_counts_and_prints_json() -> None:
    bad = CliRunner().invoke(app, ["cpm-ack", "--clients", "0"])
    assert bad.exit_code != 0
    out = CliRunner().invoke(
        app,
        ["cpm-ack", "--json", "--clients", "2", "--min-rewards", "6", "--rewards-per-client", "1"],
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["levels"][0]["cpm"]["acked"] == 6 == report["levels"][0]["cpm_stream"]["acked"]
