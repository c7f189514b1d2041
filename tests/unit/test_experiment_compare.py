"""Paired difference of one strategy between two results.json of one world."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from peerlm.app.experiment_compare import compare_results


def _result(nll: list[list[float]], seeds: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """A minimal results.json: two clients, slice ``lacked`` = their first two problems."""
    units = {"own": [], "lacked": [[0, 0], [0, 1], [1, 0], [1, 1]], "public": []}
    runs = {}
    for s, row in zip(seeds, nll, strict=True):
        clients = {
            name: {"nll": row[2 * i : 2 * i + 2], "pass@1": [0.0, 1.0], "struct": [0.5, 0.5]}
            for i, name in enumerate(("c0", "c1"))
        }
        runs[str(s)] = {"clients": clients}
    return {
        "initial_nll": {"lacked": 2.0},
        "plan": {"seeds": list(seeds)},
        "units": units,
        "clients": [{"name": "c0"}, {"name": "c1"}],
        "runs": {"cpm_svd_hka": runs},
    }


def test_the_difference_is_cell_by_cell_with_a_paired_interval() -> None:
    a = _result([[1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0]])
    b = _result([[1.5, 2.5, 3.5, 4.5], [2.5, 3.5, 4.5, 5.5]])
    out = compare_results(a, b, "cpm_svd_hka")
    nll = out["lacked"]["nll"]
    assert nll["delta"] == pytest.approx(-0.5)
    # Every cell differs by exactly -0.5: the paired interval has no width.
    assert nll["ci95"] == pytest.approx([-0.5, -0.5])
    assert out["lacked"]["pass@1"]["delta"] == 0.0
    assert set(out) == {"lacked"}


def test_results_of_another_world_or_seeds_do_not_pair() -> None:
    a = _result([[1.0] * 4, [1.0] * 4])
    other_world = copy.deepcopy(a)
    other_world["initial_nll"] = {"lacked": 2.5}
    with pytest.raises(ValueError, match="world"):
        compare_results(a, other_world, "cpm_svd_hka")
    with pytest.raises(ValueError, match="seeds"):
        compare_results(a, _result([[1.0] * 4, [1.0] * 4], seeds=(0, 2)), "cpm_svd_hka")
    with pytest.raises(ValueError, match="strategy"):
        compare_results(a, a, "cpm_pmix")
