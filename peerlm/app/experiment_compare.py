"""One strategy's paired difference between two ``run-experiment`` results of one world.

Two runs of ``peerlm run-experiment`` that differ only in a setting no strategy name
carries (``--merge-senders K``, a CPM option) are two ``results.json`` files. When both were
measured on the same world and models (checked, as ``--reuse`` checks it, by the round-0
test NLL per slice, equal to the last bit) and with the same seeds and units, their
``[seeds, units]`` matrices pair cell by cell, and the difference gets the same crossed
paired bootstrap as a difference within one table
(:func:`~peerlm.app.experiment_stats.paired_bootstrap`).

``python -m peerlm.app.experiment_compare A/results.json B/results.json --strategy S``
prints ``A - B`` per slice and metric as a table, or ``--json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from peerlm.app.experiment_reuse import read_results
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_stats import paired_bootstrap
from peerlm.app.experiment_strategies import METRICS
from peerlm.app.experiment_summary import metric_matrix

__all__ = ["compare_results", "main"]


def compare_results(
    a: Mapping[str, Any], b: Mapping[str, Any], strategy: str, *, strategy_b: str | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """``a - b`` for ``strategy`` (in ``b``: ``strategy_b``, default the same) per slice and
    metric: ``{slice: {metric: {"a", "b", "delta", "ci95"}}}``. Raises ``ValueError`` when
    the two results are not of one world, models, seeds and units."""
    other = strategy_b or strategy
    if a["initial_nll"] != b["initial_nll"]:
        raise ValueError("the two results are not of one world and models (round-0 NLL differs)")
    if list(a["plan"]["seeds"]) != list(b["plan"]["seeds"]) or a["units"] != b["units"]:
        raise ValueError("the two results differ in seeds or units; nothing pairs")
    if [c["name"] for c in a["clients"]] != [c["name"] for c in b["clients"]]:
        raise ValueError("the two results have different clients")
    for result, name in ((a, strategy), (b, other)):
        if name not in result["runs"]:
            raise ValueError(f"strategy {name!r} is not in one of the results")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for slice_name in (s for s in SLICES if a["units"][s]):
        for metric in METRICS:
            values = {
                "a": metric_matrix(a, strategy, metric, slice_name),
                "b": metric_matrix(b, other, metric, slice_name),
            }
            means, diffs = paired_bootstrap(values, [("a", "b")])
            est = diffs[("a", "b")]
            out.setdefault(slice_name, {})[metric] = {
                "a": means["a"].mean,
                "b": means["b"].mean,
                "delta": est.mean,
                "ci95": [est.low, est.high],
            }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--strategy-b", default=None)
    parser.add_argument("--json", action="store_true", dest="as_json")
    args = parser.parse_args(argv)
    try:
        a, b = (read_results(p) for p in (args.a, args.b))
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read the results: {exc}")
    try:
        table = compare_results(a, b, args.strategy, strategy_b=args.strategy_b)
    except ValueError as exc:
        parser.error(str(exc))
    if args.as_json:
        print(json.dumps(table, indent=2, sort_keys=True))
        return 0
    print(f"{args.strategy}: {args.a} - {args.b}, paired over seeds and units (95% CI)")
    print(f"{'slice':8} {'metric':8} {'A':>9} {'B':>9} {'A - B':>9}  95% CI")
    for slice_name, metrics in table.items():
        for metric, row in metrics.items():
            low, high = row["ci95"]
            print(
                f"{slice_name:8} {metric:8} {row['a']:9.4f} {row['b']:9.4f} "
                f"{row['delta']:+9.4f}  [{low:+.4f}, {high:+.4f}]"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
