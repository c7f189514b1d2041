"""Process-wide C allocator setting for the CPM: keep freed memory for reuse.

``Matchmaker.select`` allocates a few dozen numpy temporaries of 0.5–8 MB per call (score
blocks, candidate arrays, permutations). glibc's ``malloc`` serves such sizes by ``mmap`` or
returns them to the kernel when freed (its dynamic mmap threshold and heap trimming), so
the next call page-faults and the kernel zeroes every page again: measured, 6–8 ms of
system time per ``select`` at N = 1,000 (a quarter of the call) and 20–30 ms at N =
10,000 (docs/bench-cpm.md, "select() speed"). Raising the mmap threshold and the trim
threshold keeps that memory in the heap, where the next call reuses it without faults.
The cost is resident memory: the process keeps up to its peak heap instead of returning
it (a few tens of MB for ``select`` at N = 10,000).

Hand-written because no maintained Python library wraps ``mallopt``; it is two ``ctypes``
calls. On a C library without ``mallopt`` (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "retain_freed_memory"]

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations above this still get their own mapping (glibc's dynamic maximum, 32 MB).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of the heap beyond this is returned to the kernel.
TRIM_THRESHOLD_BYTES = 256 << 20


def retain_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Set glibc's mmap and trim thresholds for this whole process; True if both were set.

    Meant for a process that owns its allocator (the CPM, or a benchmark measuring it),
    called once at start. Returns False, changing nothing, where the C library has no
    ``mallopt`` or refuses a value.
    """
    if not (0 < mmap_threshold <= 2**31 - 1 and 0 < trim_threshold <= 2**31 - 1):
        raise ValueError("thresholds must be positive C ints")
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
