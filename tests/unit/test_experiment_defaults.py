"""What ``run-experiment`` runs when nothing is named: the key comparisons (the 30-minute
default), the whole table under ``--quick`` or ``--strategies table``, and one process per
usable core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerlm.app.experiment import (
    COMPARISONS,
    DEFAULT_STRATEGIES,
    STRATEGIES,
    WORKER_MEMORY_BYTES,
    ExperimentPlan,
    default_jobs,
    parse_strategies,
    quick_plan,
)
from peerlm.process import available_memory, usable_cores


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
        "from peerlm.process import available_memory, usable_cores; print(usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_default_jobs_are_cores_capped_by_runs_and_memory() -> None:
    gib = 2**30
    assert default_jobs(9, 2, 64 * gib) == 2  # the cores
    assert default_jobs(3, 16, 64 * gib) == 3  # no more workers than runs
    assert default_jobs(24, 32, 8 * gib) == 8 * gib // WORKER_MEMORY_BYTES == 5  # memory
    assert default_jobs(24, 32, None) == 24  # memory unknown: not limited
    assert default_jobs(9, 2, 100) == 1  # never fewer than one
    assert default_jobs(0, 2, None) == 1


def test_available_memory_reads_memavailable_or_says_it_cannot(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_memory(info) == 8_000_000 * 1024
    info.write_text("MemTotal:       16000000 kB\n")  # a kernel without the field
    assert available_memory(info) is None
    info.write_text("MemAvailable: lots kB\n")
    assert available_memory(info) is None
    assert available_memory(tmp_path / "missing") is None
    if Path("/proc/meminfo").exists():
        assert (available_memory() or 0) > 0
