"""The lacked slice's teaching ceiling: the holders' LocalOnly+ scores, its gap and shares."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from peerlm.app.experiment_ceiling import render_ceiling, teaching_ceiling
from peerlm.app.experiment_strategies import LABELS

# Clients 0 and 1 each hold two problems (0, 1 and 2, 3); client 2 holds none. Problem 4
# is lacked by client 2 and held by nobody; problem 5 is public.
UNITS = {
    "own": [[0, 0], [0, 1], [1, 2], [1, 3]],
    "lacked": [[0, 2], [0, 3], [1, 0], [1, 1], [2, 0], [2, 1], [2, 2], [2, 3], [2, 4]],
    "public": [[0, 5], [1, 5], [2, 5]],
}
NAMES = ["agent-0", "agent-1", "agent-2"]


def _result(scores: dict[str, list[list[list[float]]]], metric: str = "pass@1") -> Any:
    """``scores[strategy][seed][client]``: one value per test problem (6)."""
    strategies = list(scores)
    seeds = list(range(len(next(iter(scores.values())))))
    return {
        "plan": {"strategies": strategies, "seeds": seeds},
        "clients": [{"name": n, "arch": "gpt2"} for n in NAMES],
        "units": UNITS,
        "runs": {
            s: {
                str(seed): {
                    "clients": {
                        NAMES[c]: {metric: scores[s][seed][c], "nll": scores[s][seed][c]}
                        for c in range(3)
                    },
                    # agent-0 taught agent-2 twice (once through an overlay pull with
                    # agent-1), agent-1 taught agent-0 once.
                    "rounds": [
                        {"exchanges": [{"teacher": "agent-0", "student": "agent-2"}]},
                        {
                            "exchanges": [
                                {"teacher": "agent-0,agent-1", "student": "agent-2"},
                                {"teacher": "agent-1", "student": "agent-0"},
                                # Taught nothing (slot_scope routed): not counted.
                                {"teacher": "agent-1", "student": "agent-0", "steps": 0},
                            ]
                        },
                    ],
                }
                for seed in seeds
            }
            for s in strategies
        },
    }


def _alone(seed: int) -> list[list[float]]:
    # The holders pass their own problems at 1.0 (client 0) and 0.5 (client 1) in seed 0,
    # at 0.5 and 0.0 in seed 1; nobody passes a problem it lacks.
    high, low = (1.0, 0.5) if seed == 0 else (0.5, 0.0)
    return [
        [high, high, 0.0, 0.0, 0.0, 0.5],
        [0.0, 0.0, low, low, 0.0, 0.5],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
    ]


def _as_good_as_holders(seed: int) -> list[list[float]]:
    high, low = (1.0, 0.5) if seed == 0 else (0.5, 0.0)
    return [
        [high, high, low, low, 0.0, 0.5],
        [high, high, low, low, 0.0, 0.5],
        [high, high, low, low, 0.0, 0.5],
    ]


def test_the_ceiling_is_the_holders_mean_and_a_strategy_that_reaches_it_has_all_of_the_gap() -> (
    None
):
    result = _result(
        {
            "local_plus": [_alone(0), _alone(1)],
            "cpm": [_as_good_as_holders(0), _as_good_as_holders(1)],
            "random": [_alone(0), _alone(1)],
        }
    )
    got = teaching_ceiling(result, metrics=("pass@1",))
    assert got is not None
    # Eight lacked units have a holder; (2, 4) has none and is left out.
    assert got["units"] == 8 and got["units_without_holder"] == 1
    m = got["metrics"]["pass@1"]
    # Per lacked unit in order, the holder's LocalOnly+ score: client 1's on problems 2-3,
    # client 0's on 0-1.
    seed0 = np.mean([0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    seed1 = np.mean([0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0])
    assert m["ceiling"]["mean"] == pytest.approx((seed0 + seed1) / 2)
    assert m["local_plus"]["mean"] == 0.0
    assert m["gap"]["delta"] == pytest.approx((seed0 + seed1) / 2)
    assert m["gap"]["ci95"][0] > 0
    cpm, random = m["strategies"]["cpm"], m["strategies"]["random"]
    assert cpm["share_of_gap"]["mean"] == pytest.approx(1.0)
    assert random["share_of_gap"]["mean"] == pytest.approx(0.0)
    assert random["delta"] == 0.0
    text = render_ceiling(got, LABELS)
    assert "Teaching ceiling" in text and "8 units; 1 without a holder" in text
    assert f"| {LABELS['cpm']} |" in text and "100 %" in text
    # The transfer table: one row per student and holder of a skill it lacks.
    rows = {(r["student"], r["holder"]): r for r in got["transfer"]["cpm"]}
    assert set(rows) == {
        ("agent-0", "agent-1"),
        ("agent-1", "agent-0"),
        ("agent-2", "agent-0"),
        ("agent-2", "agent-1"),
    }
    assert rows[("agent-2", "agent-0")]["taught_per_run"] == 2.0
    assert rows[("agent-2", "agent-1")]["taught_per_run"] == 1.0
    assert rows[("agent-0", "agent-1")]["taught_per_run"] == 1.0
    assert rows[("agent-1", "agent-0")]["taught_per_run"] == 0.0
    # agent-2 scores what agent-0 scores alone on agent-0's problems: 1.0, then 0.5.
    assert rows[("agent-2", "agent-0")]["holder_alone"] == pytest.approx(0.75)
    assert rows[("agent-2", "agent-0")]["delta"] == pytest.approx(0.75)
    assert rows[("agent-2", "agent-0")]["problems"] == 2
    assert "| agent-2 (gpt2) | agent-0 (gpt2) | 2.0 | 75.0 | +75.00" in text


def test_no_ceiling_without_local_plus_or_without_a_held_lacked_problem() -> None:
    assert teaching_ceiling(_result({"cpm": [_alone(0)]})) is None
    nobody = _result({"local_plus": [_alone(0)]})
    nobody["units"] = {"own": [], "lacked": UNITS["lacked"], "public": UNITS["public"]}
    assert teaching_ceiling(nobody) is None
    assert render_ceiling(None, LABELS) == ""


def test_no_share_where_the_holders_are_no_better_than_the_students() -> None:
    # The holders' NLL is higher (worse) than the students': no gap to share.
    flat = [[0.2] * 6 for _ in range(3)]
    result = _result({"local_plus": [flat], "cpm": [flat]})
    own = {(i, j) for i, j in UNITS["own"]}
    for c, row in enumerate(result["runs"]["local_plus"]["0"]["clients"].values()):
        row["nll"] = [0.9 if (c, j) in own else 0.3 for j in range(6)]
    for c in NAMES:
        result["runs"]["cpm"]["0"]["clients"][c]["nll"] = [0.5] * 6
    got = teaching_ceiling(result)
    assert got is not None
    nll = got["metrics"]["nll"]
    assert nll["gap"]["delta"] > 0
    assert nll["strategies"]["cpm"]["share_of_gap"] is None


def test_the_ceiling_pools_over_worlds_on_the_held_lacked_units() -> None:
    """``experiment_pool`` pools the ceiling's gap and a strategy's share of it under the
    ``lacked_held`` slice; the pairs that do not name it keep their own slices."""
    from peerlm.app.experiment_pool import HELD_SLICE, pool_results

    worlds = []
    for w in (0, 17):
        result = _result(
            {
                "local_plus": [_alone(0), _alone(1)],
                "cpm": [_as_good_as_holders(0), _as_good_as_holders(1)],
            }
        )
        result["plan"]["world_seed"] = w
        for run in result["runs"].values():
            for seed_run in run.values():
                for row in seed_run["clients"].values():
                    row["struct"] = row["pass@1"]
        worlds.append(result)
    out = pool_results(
        worlds,
        [("holders", "local_plus"), ("cpm", "local_plus")],
        shares=[("cpm", "local_plus", "holders")],
    )
    held = out[HELD_SLICE]["pass@1"]
    single = teaching_ceiling(worlds[0], metrics=("pass@1",))
    assert single is not None
    gap = single["metrics"]["pass@1"]["gap"]["delta"]
    # Two copies of one world: the pooled gap is that world's, and cpm reaches all of it.
    assert held["pooled"]["holders_vs_local_plus"]["delta"] == pytest.approx(gap)
    assert held["pooled"]["share_cpm_local_plus_holders"]["share"] == pytest.approx(1.0)
    assert [w["world_seed"] for w in held["worlds"]] == [0, 17]
    # The plain slices carry only the pair that does not name the ceiling.
    assert set(out["lacked"]["pass@1"]["pooled"]) == {"cpm_vs_local_plus"}
    # A ceiling needs LocalOnly+: a world without it is refused by name.
    del worlds[1]["runs"]["local_plus"]
    with pytest.raises(ValueError, match="no run of"):
        pool_results(worlds, [("holders", "cpm")])
