"""The test suite. Importing it (pytest does, before any test module or conftest) gives every
test process, and the processes the tests start, one thread for torch (OpenMP), BLAS and
tokenizers.

Why: the suite runs four pytest workers beside agents, CPMs and experiment workers on two
cores, where a second OpenMP thread per process only spins waiting for a core. Measured on
tests/unit/test_modelhost.py beside two busy loops (2026-12-06): 33.8 CPU s with torch's
default two threads, 16.8 with one, for the same tests. A test about threads sets them
itself; a value the caller exported stays.
"""

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
