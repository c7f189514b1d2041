"""``peerlm bench cpm-replay``: the CPM replayed on an oracle run's measured pair gains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peerlm.bench.cli import app
from peerlm.bench.cpm_replay import ReplaySetting, replay
from typer.testing import CliRunner

NAMES = ("agent-0", "agent-1", "agent-2", "agent-3")
QUALITY = {"agent-0": 0.4, "agent-1": 0.05, "agent-2": 0.6, "agent-3": 0.05}


def _result(rounds: int = 6, *, profiles: bool = True) -> dict[str, Any]:
    """An oracle run where a pair's gain is its teacher's quality (which profile[8] shows)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(rounds):
        gains = {
            f"{t}>{s}": round(QUALITY[t] + float(rng.normal(0, 0.01)), 6)
            for t in NAMES
            for s in NAMES
            if t != s
        }
        best = [("agent-2", "agent-1"), ("agent-0", "agent-3")]
        row: dict[str, Any] = {
            "oracle_gains": gains,
            "exchanges": [{"teacher": t, "student": s} for t, s in best],
        }
        if profiles:
            row["profiles"] = {}
            for k, n in enumerate(NAMES):
                p = np.zeros(32)
                p[k] = 1.0
                p[8] = QUALITY[n]
                p[20 + k] = 1.0
                row["profiles"][n] = p.tolist()
        out.append(row)
    return {"runs": {"oracle": {"0": {"rounds": out}}}}


def test_replay_places_each_setting_between_random_and_the_oracle() -> None:
    settings = [ReplaySetting("performance", False, 0.25, "blossom"), ReplaySetting()]
    report = replay(_result(), settings, bandit_seeds=4)
    assert report["runs"] == 1 and report["rounds"] == 6
    assert report["random_gain"] < report["best_fixed_matching_gain"] <= report["oracle_gain"] + 0.1
    assert report["best_fixed_matching_share"] == pytest.approx(1.0, abs=0.1)
    for row in report["settings"]:
        assert row["cpm_gain"] <= report["oracle_gain"] + 0.1
        assert row["share"] is not None
    # The teacher-quality feature alone, matched exactly, learns who should teach.
    small = next(r for r in report["settings"] if r["columns"] == "performance")
    assert small["share"] > 0.3


def test_results_without_an_oracle_run_or_its_profiles_are_refused() -> None:
    with pytest.raises(ValueError, match="no Oracle-pairing run"):
        replay({"runs": {"cpm": {}}}, [ReplaySetting()])
    with pytest.raises(ValueError, match="lacks per-round profiles"):
        replay(_result(profiles=False), [ReplaySetting()])
    with pytest.raises(ValueError, match="bandit_seeds"):
        replay(_result(), [ReplaySetting()], bandit_seeds=0)


def test_the_command_prints_json_and_refuses_a_bad_setting(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_result(3)))
    runner = CliRunner()
    ok = runner.invoke(
        app,
        [
            "cpm-replay",
            str(path),
            "--setting",
            "performance/plain/0.5/blossom",
            "--bandit-seeds",
            "2",
            "--json",
        ],
    )
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout.strip().splitlines()[-1])
    assert [r["label"] for r in report["settings"]] == ["performance / plain / beta 0.5 / blossom"]
    bad = runner.invoke(app, ["cpm-replay", str(path), "--setting", "all/cubic/1/greedy"])
    assert bad.exit_code != 0
    missing = runner.invoke(app, ["cpm-replay", str(tmp_path / "nope.json")])
    assert missing.exit_code != 0
