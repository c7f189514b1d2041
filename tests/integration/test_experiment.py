"""``peerlm run-experiment`` with micro models: all five strategies, outputs, determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerlm.app.devfed import AGENT_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_all_five_strategies_run_and_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "peerlm", "run-experiment", "--micro", "--json",
        "-n", "4", "-r", "2", "--local-steps", "2", "--transfer-limit", "4",
        "--test-limit", "6", "--samples", "5", "--max-new-tokens", "12",
        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
        "--out", str(out), "--jobs", "2",
    ]  # fmt: skip
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=900, env={**os.environ, **AGENT_ENV}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    strategies = result["strategies"]
    assert list(strategies) == ["local", "random", "heuristic", "central_kd", "cpm"]
    for name, r in strategies.items():
        assert len(r["curve"]) == 3 and len(r["rounds"]) == 2, name
        assert set(r["mean"]) == {"greedy_pass@1", "pass@1", "pass@5"}
        for client in r["clients"].values():
            assert 0.0 <= client["pass@1"] <= client["pass@5"] <= 1.0
            assert sum(client["status_counts"].values()) == 6 * 5  # problems x samples
        exchanges = [x for rnd in r["rounds"] for x in rnd["exchanges"]]
        if name == "local":
            assert not exchanges and r["kilobytes"] == 0
        elif name == "central_kd":
            # Every client distils from the one ensemble teacher every round.
            assert len(exchanges) == 4 * 2 and {x["teacher"] for x in exchanges} == {"central"}
        else:
            # Four clients, K_p = 2 disjoint pairs a round, each with a real Eq. 3 reward.
            assert len(exchanges) == 2 * 2
            for rnd in r["rounds"]:
                people = [x["teacher"] for x in rnd["exchanges"]]
                people += [x["student"] for x in rnd["exchanges"]]
                assert len(set(people)) == 4
            for x in exchanges:
                assert x["kilobytes"] > 0 and x["mode"] == "text"
                expected = x["loss_pre"] - x["loss_post"] - 0.001 * x["kilobytes"]
                assert x["reward"] == pytest.approx(expected, abs=1e-4)
    # Every strategy starts from the same round 0 and the same round-1 local update.
    curves = {r["curve"][0] for r in strategies.values()}
    assert len(curves) == 1
    first = {json.dumps(r["rounds"][0]["train_loss"], sort_keys=True) for r in strategies.values()}
    assert len(first) == 1
    # The CPM learnt from the rewards: normalised rewards came back for every exchange.
    cpm = [x for rnd in strategies["cpm"]["rounds"] for x in rnd["exchanges"]]
    assert all(x["normalised_reward"] is not None for x in cpm)

    table = (out / "table.md").read_text()
    for label in ("LocalOnly", "Random-P2P", "Heuristic-P2P", "Central-KD", "KNEXA-FL"):
        assert label in table
    assert json.loads((out / "results.json").read_text())["plan"]["rounds"] == 2
    for png in ("pass1_by_round.png", "per_client.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_strategy_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "peerlm", "run-experiment", "--micro", "--strategies", "gossip"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "unknown strategies" in proc.stderr


@pytest.mark.timeout(900)
def test_parallel_strategies_give_the_same_results(tmp_path: Path) -> None:
    """Each strategy is seeded on its own: worker processes change the wall time only."""
    from peerlm.app.experiment import ExperimentPlan, run_experiment

    plan = ExperimentPlan(
        agents=2, rounds=1, strategies=("local", "random"), size="micro", local_steps=1,
        transfer_limit=2, val_limit=2, test_limit=3, samples=2, max_new_tokens=8,
    )  # fmt: skip
    runs = [
        run_experiment(plan, models=tmp_path / "models", work=tmp_path / f"w{jobs}", jobs=jobs)
        for jobs in (1, 2)
    ]
    for run in runs:
        for r in run["strategies"].values():
            r.pop("seconds")
    assert runs[0]["strategies"] == runs[1]["strategies"]
