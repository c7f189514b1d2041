"""Speed of the overlay's signature maths (SemanticDFL Sec. 3.2) on this machine.

    python bench/signature.py [--json] [--repeat N]

Signatures come from correlated random weight vectors (so supports overlap, as within a
cluster) of dimension M = 1,000,000. Each figure is the median over ``--repeat`` timed runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from peerlm.overlay import (
    Signature,
    cosine_matrix,
    cosine_to_many,
    make_signature,
    minimal_p,
    prototype,
    sparse_cosine,
)
from rich.console import Console
from rich.table import Table

M = 1_000_000


def _signatures(n: int, p: int, seed: int = 0) -> list[Signature]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=M).astype(np.float32)
    out = []
    for _ in range(n):
        w = base + rng.normal(scale=0.5, size=M).astype(np.float32)
        out.append(make_signature(w, np.abs(w), p, "bench"))
    return out


def _median_s(fn: Callable[[], object], repeat: int, inner: int = 1) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure")
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    rows: list[tuple[str, float, str]] = []
    with err.status("building signatures (M = 1e6)..."):
        sigs256 = _signatures(1000, 256)
        sigs512 = _signatures(1000, 512, seed=1)
        rng = np.random.default_rng(2)
        w = rng.normal(size=M)
        s = np.abs(w)
    a, b = sigs256[0], sigs256[1]
    raw = a.to_bytes()
    cases: list[tuple[str, Callable[[], object], int, float, str]] = [
        ("sparse_cosine, P=256", lambda: sparse_cosine(a, b), 2000, 1e6, "µs"),
        ("to_bytes, P=256", a.to_bytes, 2000, 1e6, "µs"),
        ("from_bytes, P=256", lambda: Signature.from_bytes(raw, max_p=256), 2000, 1e6, "µs"),
        ("cosine_to_many, 1000 x P=256", lambda: cosine_to_many(a, sigs256), 20, 1e3, "ms"),
        ("cosine_matrix, 100 x P=256", lambda: cosine_matrix(sigs256[:100]), 20, 1e3, "ms"),
        ("cosine_matrix, 1000 x P=512", lambda: cosine_matrix(sigs512), 3, 1e3, "ms"),
        ("prototype, 50 x P=256", lambda: prototype(sigs256[:50], 256), 50, 1e3, "ms"),
        ("make_signature, M=1e6, P=256", lambda: make_signature(w, s, 256, "b"), 3, 1e3, "ms"),
        ("minimal_p (Alg. 1), M=1e6", lambda: minimal_p(w, s, 0.8), 3, 1e3, "ms"),
    ]
    with err.status("timing...") as status:
        for label, fn, inner, scale, unit in cases:
            status.update(f"timing {label}...")
            rows.append((label, _median_s(fn, args.repeat, inner) * scale, unit))
    if args.json:
        print(json.dumps([{"case": c, "value": round(v, 3), "unit": u} for c, v, u in rows]))
        return 0
    table = Table(title="overlay signature maths (median)")
    table.add_column("case")
    table.add_column("time", justify="right")
    for label, value, unit in rows:
        table.add_row(label, f"{value:.1f} {unit}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
