"""The answer check's ablation from one run's records: every policy's Pass@1, paired."""

from __future__ import annotations

from typing import Any

import pytest

from peerlm.app.experiment_answer_check import (
    answer_check_ablation,
    render_answer_check,
    with_answer_check,
)
from peerlm.app.experiment_strategies import LABELS

# Problem 0: each client's own skill; 1 and 2: public; 3: lacked.
UNITS = {
    "own": [[0, 0], [1, 0]],
    "public": [[0, 1], [0, 2], [1, 1], [1, 2]],
    "lacked": [[0, 3], [1, 3]],
}


def _result(checked: bool = True) -> dict[str, Any]:
    """LocalOnly+ passes both public problems; KNEXA-FL's slot answers client c0's first
    public problem wrongly (``off``), and the own adapter's answer (``own_first``) is
    LocalOnly+'s; on the lacked problem the slot's answer passes under both."""
    alone = [1.0, 1.0, 1.0, 0.0]
    runs: dict[str, Any] = {"local_plus": {}, "cpm": {}}
    for seed in ("0", "1"):
        runs["local_plus"][seed] = {"clients": {c: {"pass@1": list(alone)} for c in ("c0", "c1")}}
        clients = {}
        for c in ("c0", "c1"):
            off = [1.0, 0.0 if c == "c0" else 1.0, 1.0, 1.0]
            own_first = [1.0, 1.0, 1.0, 1.0]
            record: dict[str, Any] = {"pass@1": own_first}
            if checked:
                record["answer_checks"] = {
                    "off": off,
                    "own_first": own_first,
                    "peer_first": off,
                }
            clients[c] = record
        runs["cpm"][seed] = {"clients": clients}
    return {
        "plan": {"seeds": [0, 1], "strategies": ["local_plus", "cpm"], "answer_check": "own_first"},
        "units": UNITS,
        "clients": [{"name": "c0"}, {"name": "c1"}],
        "runs": runs,
    }


def test_another_policy_is_the_same_run_scored_by_its_record() -> None:
    result = _result()
    off = with_answer_check(result, "off")
    assert off["runs"]["cpm"]["0"]["clients"]["c0"]["pass@1"] == [1.0, 0.0, 1.0, 1.0]
    # LocalOnly+ and the original are untouched.
    assert off["runs"]["local_plus"] == result["runs"]["local_plus"]
    assert result["runs"]["cpm"]["0"]["clients"]["c0"]["pass@1"] == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="no answer_check 'best'"):
        with_answer_check(result, "best")


def test_the_ablation_pairs_the_policies_and_finds_each_ones_worst_client() -> None:
    ablation = answer_check_ablation(_result())
    assert ablation is not None and ablation["policy"] == "own_first"
    public = ablation["strategies"]["cpm"]["off"]["public"]
    # One public unit of four, every seed: own_first - off = +25 points; the bootstrap
    # resamples the units, so the interval has width but never goes below zero.
    assert public["delta"] == pytest.approx(0.25)
    assert 0.0 <= public["ci95"][0] <= 0.25 <= public["ci95"][1]
    assert ablation["strategies"]["cpm"]["off"]["lacked"]["delta"] == 0.0
    worst = ablation["worst_client_low"]["cpm"]
    assert worst["off"]["public"]["client"] == "c0"
    assert worst["off"]["public"]["delta"] == pytest.approx(-0.5)
    assert worst["own_first"]["public"]["low"] == 0.0
    text = render_answer_check(ablation, LABELS)
    assert "| KNEXA-FL (CPM) | off |" in text and "c0 -50.00" in text


def test_runs_without_the_records_have_no_ablation() -> None:
    assert answer_check_ablation(_result(checked=False)) is None
    assert render_answer_check(None, LABELS) == ""
