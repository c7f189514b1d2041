"""What ``run-experiment`` runs when nothing is named: the key comparisons (the 30-minute
default), the whole table under ``--quick`` or ``--strategies table``, and one process per
usable core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from peerlm.app.experiment import (
    COMPARISONS,
    DEFAULT_STRATEGIES,
    STRATEGIES,
    ExperimentPlan,
    parse_strategies,
    quick_plan,
)
from peerlm.process import usable_cores


def test_the_default_runs_the_key_comparisons_and_quick_the_whole_table() -> None:
    assert ExperimentPlan().strategies == DEFAULT_STRATEGIES == ("local_plus", "random", "cpm")
    # Every key difference of the issue can be formed from the default's runs.
    for a, b in (("cpm", "random"), ("cpm", "local_plus"), ("best", "local_plus")):
        assert (a, b) in COMPARISONS
        assert {a, b} - {"best"} <= set(DEFAULT_STRATEGIES)
    assert quick_plan().strategies == STRATEGIES
    assert quick_plan(strategies=("cpm",)).strategies == ("cpm",)


def test_strategies_parse_as_a_list_or_the_table() -> None:
    assert parse_strategies("table") == STRATEGIES
    assert parse_strategies(" cpm, random ,") == ("cpm", "random")
    # "table" is not a strategy inside a list: the plan refuses it by name.
    with pytest.raises(ValueError, match="unknown strategies \\['table'\\]"):
        ExperimentPlan(strategies=parse_strategies("table,cpm"))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_usable_cores_follow_the_affinity_mask() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0))
    one = next(iter(os.sched_getaffinity(0)))
    code = (
        f"import os; os.sched_setaffinity(0, {{{one}}}); "
        "from peerlm.process import usable_cores; print(usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
