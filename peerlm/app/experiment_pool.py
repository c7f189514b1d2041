"""Key differences pooled over worlds: several ``run-experiment`` results, one per world.

A result must hold on a second world seed. Per world, the table's paired
bootstrap answers it world by world; this command adds the pooled answer. Each results file
is one stratum (one world seed, its own run seeds and units; runs of one world are first
combined with ``run-experiment --reuse``), and
:func:`~peerlm.app.experiment_stats.stratified_bootstrap` resamples seeds and units within
each world and averages the worlds with equal weight.

``python -m peerlm.app.experiment_pool W0/results.json W1/results.json
--pair cpm:random --pair cpm:local_plus --share cpm:local_plus:oracle [--slice lacked]``
prints, per slice and metric, each world's difference and the pooled one, or ``--json``.

The teaching ceiling (:mod:`~peerlm.app.experiment_ceiling`) pools too: name it
``holders`` (``--pair holders:local_plus`` for the gap it leaves, ``--share
cpm:local_plus:holders`` for a strategy's share of that gap). It exists only on the lacked
units that some client holds, so every pair and share naming it is reported under a slice
of its own, ``lacked_held``, where the strategies are compared on those units too.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from peerlm.app.experiment_ceiling import CEILING, ceiling_matrices, held_lacked_units
from peerlm.app.experiment_reuse import read_results
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_stats import stratified_bootstrap
from peerlm.app.experiment_strategies import METRICS
from peerlm.app.experiment_summary import metric_matrix

__all__ = ["HELD_SLICE", "main", "pool_results"]

#: The slice of the lacked units some client holds: where the teaching ceiling is defined.
HELD_SLICE = "lacked_held"


def _names(text: str, parts: int, what: str) -> tuple[str, ...]:
    names = tuple(text.split(":"))
    if len(names) != parts or not all(names):
        raise ValueError(f"{what} must be {':'.join(['NAME'] * parts)}, got {text!r}")
    return names


def pool_results(
    results: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
    shares: Sequence[tuple[str, str, str]] = (),
    slices: Sequence[str] = SLICES,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{slice: {metric: {"worlds": [...], "pooled": {...}}}}``: each world's and the
    pooled estimates of every pair ``a - b`` (``"<a>_vs_<b>"``: ``delta``, ``ci95``) and
    every share (``"share_<a>_<base>_<top>"``, only where ``top - base`` is resolved).
    Raises ``ValueError`` when two results are of one world, or a strategy is missing
    from one of them."""
    if len(results) < 2:
        raise ValueError("pooling needs the results of at least two worlds")
    worlds = [r["plan"]["world_seed"] for r in results]
    if len(set(worlds)) != len(worlds):
        raise ValueError(
            f"two results are of one world (world seeds {worlds}); combine runs of one world "
            "with run-experiment --reuse first"
        )
    needed = sorted({n for p in pairs for n in p} | {n for s in shares for n in s})
    ceiling = CEILING in needed
    runs_needed = sorted(
        {n for n in needed if n != CEILING} | ({"local_plus"} if ceiling else set())
    )
    for r, w in zip(results, worlds, strict=True):
        missing = [n for n in runs_needed if n not in r["runs"]]
        if missing:
            raise ValueError(f"world {w} has no run of {missing}")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    plain_pairs = [p for p in pairs if CEILING not in p]
    plain_shares = [s for s in shares if CEILING not in s]
    for slice_name in slices:
        if not all(r["units"].get(slice_name) for r in results):
            continue
        if not plain_pairs and not plain_shares:
            break
        names = sorted({n for p in plain_pairs for n in p} | {n for s in plain_shares for n in s})
        for metric in METRICS:
            strata = [{n: metric_matrix(r, n, metric, slice_name) for n in names} for r in results]
            out.setdefault(slice_name, {})[metric] = _rows(
                worlds, strata, plain_pairs, plain_shares
            )
    if ceiling and all(held_lacked_units(r)[0] for r in results):
        for metric in METRICS:
            strata = [ceiling_matrices(r, metric, needed) for r in results]
            out.setdefault(HELD_SLICE, {})[metric] = _rows(worlds, strata, pairs, shares)
    return out


def _rows(
    worlds: Sequence[int],
    strata: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
    shares: Sequence[tuple[str, str, str]],
) -> dict[str, Any]:
    """Each world's estimates, the pooled ones and the world-level interval of ``strata``."""
    rows: dict[str, Any] = {"worlds": []}
    for w, stratum in zip(worlds, strata, strict=True):
        rows["worlds"].append({"world_seed": w, **_estimates([stratum], pairs, shares)})
    rows["pooled"] = _estimates(strata, pairs, shares)
    rows["world_level"] = _world_level(rows["worlds"], pairs)
    return rows


def _estimates(
    strata: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
    shares: Sequence[tuple[str, str, str]],
) -> dict[str, Any]:
    """Pairs and shares of ``strata``; a share only where ``top - base`` is resolved (its
    interval excludes 0), as the experiment's table reports one: the share of a gain that
    may be nothing is no figure."""
    tops = [(top, base) for _, base, top in shares]
    _, diffs, got = stratified_bootstrap(strata, [*pairs, *tops], shares=shares)
    kept = {
        t: e
        for t, e in got.items()
        if not diffs[(t[2], t[1])].low <= 0.0 <= diffs[(t[2], t[1])].high
    }
    return _flat({p: diffs[p] for p in pairs}, kept)


def _world_level(
    worlds: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """The world as a random effect: per pair, the mean of the worlds' differences and a
    Student t interval over the worlds (the between-world spread, which the pooled
    bootstrap, worlds as fixed strata, leaves out); None below three worlds."""
    out: dict[str, Any] = {}
    for a, b in pairs:
        key = f"{a}_vs_{b}"
        deltas = np.array([w[key]["delta"] for w in worlds], dtype=np.float64)
        mean = float(deltas.mean())
        if len(deltas) < 3:
            out[key] = {"delta": mean, "ci95": None, "worlds": len(deltas)}
            continue
        half = float(
            scipy_stats.t.ppf(0.975, len(deltas) - 1) * deltas.std(ddof=1) / np.sqrt(len(deltas))
        )
        out[key] = {"delta": mean, "ci95": [mean - half, mean + half], "worlds": len(deltas)}
    return out


def _flat(diffs: Mapping[Any, Any], shares: Mapping[Any, Any]) -> dict[str, Any]:
    flat = {
        f"{a}_vs_{b}": {"delta": e.mean, "ci95": [e.low, e.high]} for (a, b), e in diffs.items()
    }
    for (a, base, top), e in shares.items():
        flat[f"share_{a}_{base}_{top}"] = {"share": e.mean, "ci95": [e.low, e.high]}
    return flat


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--pair", action="append", default=[], help="A:B for A - B")
    parser.add_argument("--share", action="append", default=[], help="A:BASE:TOP")
    parser.add_argument("--slice", action="append", dest="slices", choices=SLICES)
    # (the lacked_held slice is reported whenever a pair or share names the ceiling)
    parser.add_argument("--json", action="store_true", dest="as_json")
    args = parser.parse_args(argv)
    try:
        pairs = [_names(p, 2, "--pair") for p in args.pair]
        shares = [_names(s, 3, "--share") for s in args.share]
        if not pairs and not shares:
            raise ValueError("name at least one --pair or --share")
        results = [read_results(p) for p in args.results]
        table = pool_results(results, pairs, shares, args.slices or SLICES)  # type: ignore[arg-type]
    except (ValueError, OSError, KeyError) as exc:
        parser.error(str(exc))
    if args.as_json:
        print(json.dumps(table, indent=2, sort_keys=True))
        return 0
    for slice_name, metrics in table.items():
        for metric, rows in metrics.items():
            keys = {k for w in (*rows["worlds"], rows["pooled"]) for k in w if k != "world_seed"}
            for key in sorted(keys):
                cells = []
                for w in rows["worlds"]:
                    cells.append(f"world {w['world_seed']} {_cell(w.get(key))}")
                cells.append(f"pooled {_cell(rows['pooled'].get(key))}")
                level = rows["world_level"].get(key)
                if level is not None and level["ci95"] is not None:
                    cells.append(f"worlds as a random effect {_cell(level)}")
                print(f"{slice_name:7} {metric:7} {key:32} " + " | ".join(cells))
    return 0


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "- (gain not resolved)"
    value = row.get("delta", row.get("share"))
    low, high = row["ci95"]
    return f"{value:+.4f} [{low:+.4f}, {high:+.4f}]"


if __name__ == "__main__":
    raise SystemExit(main())
