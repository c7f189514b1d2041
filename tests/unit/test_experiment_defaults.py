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
    # At least five run seeds by default: three gave intervals that moved with the seed set.
    assert len(ExperimentPlan().seeds) >= 5
    assert quick_plan(strategies=("cpm",)).strategies == ("cpm",)


def test_strategies_parse_as_a_list_or_the_table() -> None:
    assert parse_strategies("table") == STRATEGIES
    assert parse_strategies(" cpm, random ,") == ("cpm", "random")
    # "table" stands alone: inside a list it is refused, naming why.
    with pytest.raises(ValueError, match="stands alone"):
        parse_strategies("table,cpm")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_usable_cores_follow_the_affinity_mask() -> None:
    one = next(iter(os.sched_getaffinity(0)))
    code = (
        f"import os; os.sched_setaffinity(0, {{{one}}}); "
        "from peerlm.process import available_memory, usable_cores; print(usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_default_jobs_are_cores_capped_by_threads_runs_and_memory() -> None:
    gib = 2**30
    per = WORKER_MEMORY_BYTES
    assert default_jobs(9, 2, 64 * gib) == 2  # the cores
    assert default_jobs(3, 16, 64 * gib) == 3  # no more workers than runs
    assert default_jobs(24, 16, 64 * gib, threads=4) == 4  # 16 cores, 4 threads a worker
    # Memory for the workers beside the main process (counted as one more).
    assert default_jobs(24, 32, 8 * gib) == 8 * gib // per - 1 == 4
    assert default_jobs(24, 32, None) == 24  # memory unknown: not limited
    assert default_jobs(9, 2, 100) == 1  # never fewer than one
    assert default_jobs(0, 2, None) == 1
    assert default_jobs(9, 2, None, threads=8) == 1


def _cgroup(tmp_path: Path, **files: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name.replace("_", ".")).write_text(text)
    return tmp_path


def test_available_memory_reads_memavailable_and_a_cgroup_limit(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    none = tmp_path / "no-cgroup"
    info.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_memory(info, none) == 8_000_000 * 1024
    # A container limited to 2 GiB, 0.5 GiB of it in use, on a host with more available.
    box = _cgroup(tmp_path / "box", memory_max=f"{2 * 2**30}\n", memory_current=f"{2**29}\n")
    assert available_memory(info, box) == 3 * 2**29
    unlimited = _cgroup(tmp_path / "free", memory_max="max\n", memory_current="123\n")
    assert available_memory(info, unlimited) == 8_000_000 * 1024
    info.write_text("MemTotal:       16000000 kB\n")  # a kernel without the field
    assert available_memory(info, none) is None
    assert available_memory(info, box) == 3 * 2**29
    info.write_text("MemAvailable: lots kB\n")
    assert available_memory(info, none) is None
    assert available_memory(tmp_path / "missing", none) is None
    if Path("/proc/meminfo").exists():
        assert (available_memory() or 0) > 0


def test_usable_cores_follow_a_cgroup_cpu_quota(tmp_path: Path) -> None:
    affinity = usable_cores(tmp_path / "no-cgroup")
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 cores' worth
    assert usable_cores(tmp_path / "q") == min(affinity, 2)
    (tmp_path / "q" / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path / "q") == affinity
    (tmp_path / "q" / "cpu.max").write_text("garbage\n")
    assert usable_cores(tmp_path / "q") == affinity
