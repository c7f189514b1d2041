"""How much of the lacked slice teaching could reach: the skill holders' own scores.

A student learns a skill it lacks from a peer that holds it, and distillation rarely makes
a student better than its teacher. So the lacked slice has a ceiling that no pairing,
budget or protocol changes: how well the holders of each skill do on that skill's test
problems when they train alone. The gain targets of a run are read against it: a gain of
+10 points is out of reach where the holders themselves stand 8 points above the students.

Per lacked unit (client ``i``, test problem ``j``), the *holders* are the clients whose own
slice holds ``j`` (the world's layout: the clients that hold ``j``'s category); the unit's
ceiling is the mean of their LocalOnly+ scores on ``j`` in the same run seed: what a
student taught by a holder picked at random among them would score if it learnt all its
teacher knows. The mean over holders, not the best one: picking the best holder per
problem would choose on the test data, and a max of noisy scores is biased upwards. A unit
whose problem no client holds has no ceiling and is left out of every figure here (the
count is reported).

Reported (:func:`teaching_ceiling`), on the units that have a ceiling, with the paired
crossed bootstrap of :mod:`~peerlm.app.experiment_stats`: the ceiling's mean, the gap it
leaves over LocalOnly+ (``ceiling - local_plus``), every other strategy's difference
against LocalOnly+, and its share of that gap. Beside it, the **transfer table**
(:func:`transfer_table`): per strategy, student and holder, how often the holder taught
the student (exchanges per run) and the student's Pass@1 gain over LocalOnly+ on the
problems of the holder's skills, against the holder's own score: where a skill passes and
where it does not. These figures are ours; the papers report no such bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from peerlm.app.experiment_participant import unit_matrix
from peerlm.app.experiment_stats import paired_bootstrap, paired_share

__all__ = [
    "CEILING",
    "ceiling_matrices",
    "held_lacked_units",
    "render_ceiling",
    "teaching_ceiling",
    "transfer_table",
]

#: The pseudo-strategy name of the holders' scores.
CEILING: Final = "holders"
_BASELINE: Final = "local_plus"


def _holders(units: Mapping[str, Sequence[Sequence[int]]]) -> dict[int, list[int]]:
    """Per test problem, the clients that hold it (their own slice)."""
    out: dict[int, list[int]] = {}
    for i, j in units.get("own", []):
        out.setdefault(int(j), []).append(int(i))
    return out


def held_lacked_units(result: Mapping[str, Any]) -> tuple[list[tuple[int, int]], int]:
    """The lacked units whose problem some client holds (the units a ceiling exists for),
    and how many lacked units have no holder."""
    holders = _holders(result["units"])
    lacked = [(int(i), int(j)) for i, j in result["units"].get("lacked", [])]
    units = [u for u in lacked if holders.get(u[1])]
    return units, len(lacked) - len(units)


def ceiling_matrices(
    result: Mapping[str, Any],
    metric: str,
    strategies: Sequence[str],
    units: Sequence[tuple[int, int]] | None = None,
) -> dict[str, np.ndarray]:
    """``{name: [seeds, units]}`` of ``metric`` on the held lacked units (or ``units``):
    each of ``strategies`` and, under :data:`CEILING`, the holders' mean LocalOnly+ score
    of each unit (module docstring). ``strategies`` may name :data:`CEILING` itself; the
    result must hold a LocalOnly+ run."""
    if units is None:
        units = held_lacked_units(result)[0]
    names = [c["name"] for c in result["clients"]]
    holders = _holders(result["units"])
    values = {s: unit_matrix(result, s, metric, units) for s in strategies if s != CEILING}
    rows = []
    for seed in result["plan"]["seeds"]:
        alone = result["runs"][_BASELINE][str(seed)]["clients"]
        rows.append(
            [float(np.mean([alone[names[h]][metric][j] for h in holders[j]])) for _i, j in units]
        )
    values[CEILING] = np.asarray(rows, dtype=np.float64)
    return values


def teaching_ceiling(
    result: Mapping[str, Any], metrics: Sequence[str] = ("pass@1", "nll")
) -> dict[str, Any] | None:
    """The lacked slice's teaching ceiling of a run (module docstring), or ``None`` when
    LocalOnly+ did not run or no lacked problem is held by anyone.

    Returns ``{"units": n, "units_without_holder": m, "metrics": {metric: {"ceiling":
    {mean, ci95}, "local_plus": {mean, ci95}, "gap": {delta, ci95}, "strategies":
    {strategy: {"delta": ..., "ci95": ..., "share_of_gap": {mean, ci95} | None}}}}}``.
    """
    if _BASELINE not in result["plan"]["strategies"]:
        return None
    units, without = held_lacked_units(result)
    if not units:
        return None
    others = [s for s in result["plan"]["strategies"] if s != _BASELINE]
    out: dict[str, Any] = {
        "units": len(units),
        "units_without_holder": without,
        "metrics": {},
        "transfer": {s: transfer_table(result, s) for s in others},
    }
    for metric in metrics:
        values = ceiling_matrices(result, metric, result["plan"]["strategies"], units)
        pairs = [(CEILING, _BASELINE)] + [(s, _BASELINE) for s in others]
        means, diffs = paired_bootstrap(values, pairs)
        gap = diffs[(CEILING, _BASELINE)]
        # A share of the gap is defined only where the holders are better (NLL: lower).
        better = (gap.mean < 0) if metric == "nll" else (gap.mean > 0)
        strategies: dict[str, Any] = {}
        for s in others:
            est = diffs[(s, _BASELINE)]
            share = paired_share(values, s, _BASELINE, CEILING) if better else None
            strategies[s] = {
                "delta": est.mean,
                "ci95": [est.low, est.high],
                "share_of_gap": None if share is None else share.to_dict(),
            }
        out["metrics"][metric] = {
            "ceiling": means[CEILING].to_dict(),
            _BASELINE: means[_BASELINE].to_dict(),
            "gap": {"delta": gap.mean, "ci95": [gap.low, gap.high]},
            "strategies": strategies,
        }
    return out


def _taught(run: Mapping[str, Any], teacher: str, student: str) -> int:
    """Exchanges of ``run`` in which ``teacher`` taught ``student`` (an overlay pull names
    its senders comma-separated); not one that took no step (a package with nothing for
    the peer slot)."""
    return sum(
        1
        for r in run["rounds"]
        for x in r["exchanges"]
        if x.get("student") == student
        and teacher in str(x.get("teacher", "")).split(",")
        and x.get("steps", 1) != 0
    )


def transfer_table(
    result: Mapping[str, Any], strategy: str, metric: str = "pass@1"
) -> list[dict[str, Any]]:
    """Per (student, holder): the exchanges in which the holder taught the student (mean
    per run), the holder's LocalOnly+ score on the student's lacked problems of its skills,
    and ``strategy``'s difference against LocalOnly+ on those problems with its paired
    interval. One row per pair that has such problems, students in client order."""
    names = [c["name"] for c in result["clients"]]
    arch = {c["name"]: c.get("arch", "") for c in result["clients"]}
    holders = _holders(result["units"])
    seeds = [str(s) for s in result["plan"]["seeds"]]
    rows: list[dict[str, Any]] = []
    for i, student in enumerate(names):
        for h, holder in enumerate(names):
            units = [
                (int(a), int(j))
                for a, j in result["units"].get("lacked", [])
                if int(a) == i and h in holders.get(int(j), [])
            ]
            if not units:
                continue
            values = {s: unit_matrix(result, s, metric, units) for s in (strategy, _BASELINE)}
            _means, diffs = paired_bootstrap(values, [(strategy, _BASELINE)])
            est = diffs[(strategy, _BASELINE)]
            alone = [result["runs"][_BASELINE][k]["clients"][holder][metric] for k in seeds]
            rows.append(
                {
                    "student": student,
                    "student_arch": arch[student],
                    "holder": holder,
                    "holder_arch": arch[holder],
                    "problems": len(units),
                    "taught_per_run": float(
                        np.mean(
                            [_taught(result["runs"][strategy][k], holder, student) for k in seeds]
                        )
                    ),
                    "holder_alone": float(np.mean([[a[j] for _i, j in units] for a in alone])),
                    "delta": est.mean,
                    "ci95": [est.low, est.high],
                }
            )
    return rows


def render_ceiling(ceiling: Mapping[str, Any] | None, labels: Mapping[str, str]) -> str:
    """Markdown: the lacked slice's Pass@1 ceiling, its gap and each strategy's share."""
    if not ceiling or "pass@1" not in ceiling["metrics"]:
        return ""
    m = ceiling["metrics"]["pass@1"]
    c, gap = m["ceiling"], m["gap"]
    lines = [
        f"**Teaching ceiling** of the lacked slice ({ceiling['units']} units; "
        f"{ceiling['units_without_holder']} without a holder): the holders of each skill "
        f"score {100 * c['mean']:.2f} % [{100 * c['ci95'][0]:.2f}, {100 * c['ci95'][1]:.2f}] "
        f"alone, {100 * gap['delta']:+.2f} [{100 * gap['ci95'][0]:+.2f}, "
        f"{100 * gap['ci95'][1]:+.2f}] points above LocalOnly+.",
        "",
        "| Method | Δ lacked Pass@1 vs LocalOnly+ (pts) | share of the ceiling's gap |",
        "|---|---|---|",
    ]
    for s, d in m["strategies"].items():
        share = d["share_of_gap"]
        cell = (
            "-"
            if share is None
            else f"{100 * share['mean']:.0f} % [{100 * share['ci95'][0]:.0f}, "
            f"{100 * share['ci95'][1]:.0f}]"
        )
        lines.append(
            f"| {labels.get(s, s)} | {100 * d['delta']:+.2f} [{100 * d['ci95'][0]:+.2f}, "
            f"{100 * d['ci95'][1]:+.2f}] | {cell} |"
        )
    for s, rows in ceiling.get("transfer", {}).items():
        if not rows or not any(r["taught_per_run"] for r in rows):
            continue
        lines += [
            "",
            f"Transfer under {labels.get(s, s)}: per student and holder of a skill it lacks, "
            "the exchanges in which the holder taught it (per run), the holder's Pass@1 alone "
            "on those problems and the student's gain over LocalOnly+ (pts, paired interval):",
            "",
            "| student | holder | taught per run | holder alone (%) | student's gain (pts) |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['student']} ({r['student_arch']}) | {r['holder']} ({r['holder_arch']}) "
                f"| {r['taught_per_run']:.1f} | {100 * r['holder_alone']:.1f} | "
                f"{100 * r['delta']:+.2f} [{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}] |"
            )
    return "\n".join(lines) + "\n"
