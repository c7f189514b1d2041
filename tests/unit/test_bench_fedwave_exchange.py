"""The FedWave exchange benchmark runs, and its byte counts are the plan's."""

from __future__ import annotations

from peerlm.bench.fedwave_exchange import run


def test_the_benchmark_reports_equal_routers_and_the_planned_bytes() -> None:
    row = run(agents=3, stages=2, width=16, rounds=2)
    assert row["all_routers_identical_every_round"] is True
    router, vclayer = row["router_bytes"], row["vclayer_bytes"]
    # w0, w2 in stage s0; w1 in s1: each pulls the two other routers and the VCLayers of
    # the adjacent stage's agents.
    assert row["bytes_pulled_per_agent_per_round"] == {
        "w0": 2 * router + vclayer,
        "w2": 2 * router + vclayer,
        "w1": 2 * router + 2 * vclayer,
    }
