"""The CPM's process-wide allocator setting (services/cpm/allocator.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from peerlm.services.cpm import retain_freed_memory

# In a child process: the setting is process-wide and must not leak into the test run.
_CHILD = """
import ctypes, resource, sys
import numpy as np
from peerlm.services.cpm import retain_freed_memory
if sys.argv[1] == "on":
    assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # let both allocators settle
    a = np.ones((2048, 1024)); b = np.ones((2048, 1024)); c = np.ones((2048, 1024)); del a, b, c
before = faults()
for _ in range(20):
    a = np.ones((2048, 1024)); b = np.ones((2048, 1024)); c = np.ones((2048, 1024)); del a, b, c
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_retained_memory_is_reused_without_page_faults() -> None:
    # 20 x three 16 MB arrays: by default they are mapped, faulted in and unmapped each
    # time (tens of thousands of minor faults); retained, the heap serves them again.
    default, retained = _faults("off"), _faults("on")
    assert default > 10_000
    assert retained < default / 10


def test_thresholds_must_be_positive_c_ints() -> None:
    with pytest.raises(ValueError, match="positive C ints"):
        retain_freed_memory(0, 1)
    with pytest.raises(ValueError, match="positive C ints"):
        retain_freed_memory(1, 2**31)
