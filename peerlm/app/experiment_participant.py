"""The whole participant: a net row and a per-client table against LocalOnly+.

A federation is worth joining only if no participant ends worse than it would have alone.
The slice tables say that on average; these figures say it per participant:

* **net**: every (client, test problem) unit of every slice at once, so own, lacked and
  public skills count as the test mix weights them (10 own, 30 lacked and 80 public
  problems a client in the default world);
* **per client** (KNEXA-FL's Table 10 layout): for each client and slice, a strategy's
  difference against the same client's LocalOnly+, with its paired interval over seeds and
  that client's problems;
* **seed-level intervals** beside the crossed bootstrap: the per-seed mean difference and a
  Student t interval over seeds, which does not lean on the problems being a sample of
  anything larger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_stats import paired_bootstrap

__all__ = ["NET", "participant_report", "seed_interval", "unit_matrix"]

#: The name of the whole-participant "slice".
NET = "net"
#: The baseline every participant is compared with.
BASELINE = "local_plus"


def _units(result: Mapping[str, Any], slice_name: str) -> list[tuple[int, int]]:
    if slice_name == NET:
        return [tuple(u) for s in SLICES for u in result["units"].get(s, [])]  # type: ignore[misc]
    return [tuple(u) for u in result["units"].get(slice_name, [])]  # type: ignore[misc]


def unit_matrix(
    result: Mapping[str, Any],
    strategy: str,
    metric: str,
    units: Sequence[tuple[int, int]],
) -> np.ndarray:
    """[seeds, units] of one metric of one strategy over ``units`` (client, problem)."""
    names = [c["name"] for c in result["clients"]]
    rows = []
    for seed in result["plan"]["seeds"]:
        clients = result["runs"][strategy][str(seed)]["clients"]
        rows.append([clients[names[i]][metric][j] for i, j in units])
    return np.asarray(rows, dtype=np.float64)


def seed_interval(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Mean of ``a - b`` per seed (rows), and a 95% Student t interval over the seeds
    (None with one seed)."""
    per_seed = np.nanmean(a - b, axis=1)
    mean = float(np.mean(per_seed))
    if len(per_seed) < 2:
        return {"delta": mean, "ci95": None, "per_seed": per_seed.tolist()}
    sem = float(np.std(per_seed, ddof=1) / np.sqrt(len(per_seed)))
    half = float(scipy_stats.t.ppf(0.975, len(per_seed) - 1)) * sem
    return {"delta": mean, "ci95": [mean - half, mean + half], "per_seed": per_seed.tolist()}


def participant_report(
    result: Mapping[str, Any], metrics: Sequence[str] = ("pass@1", "nll")
) -> dict[str, Any]:
    """Net row, per-client differences against LocalOnly+ and seed-level intervals.

    Returns ``{"net": {strategy: {metric: {mean, ci95}}}, "net_vs_local_plus": {strategy:
    {metric: {delta, ci95, seed_level}}}, "per_client": {client: {strategy: {slice:
    {metric: {delta, ci95}}}}}, "slice_vs_local_plus": {slice: {strategy: {metric:
    {delta, ci95, seed_level}}}}}``; empty parts when LocalOnly+ did not run.
    """
    strategies = list(result["plan"]["strategies"])
    out: dict[str, Any] = {"net": {}, "net_vs_local_plus": {}, "per_client": {}}
    out["slice_vs_local_plus"] = {}
    others = [s for s in strategies if s != BASELINE]
    units = _units(result, NET)
    if not units:
        return out
    for metric in metrics:
        values = {s: unit_matrix(result, s, metric, units) for s in strategies}
        pairs = [(s, BASELINE) for s in others] if BASELINE in strategies else []
        means, diffs = paired_bootstrap(values, pairs)
        for s in strategies:
            out["net"].setdefault(s, {})[metric] = means[s].to_dict()
        for (a, b), est in diffs.items():
            out["net_vs_local_plus"].setdefault(a, {})[metric] = {
                "delta": est.mean,
                "ci95": [est.low, est.high],
                "seed_level": seed_interval(values[a], values[b]),
            }
    if BASELINE not in strategies:
        return out
    for slice_name in SLICES:
        slice_units = _units(result, slice_name)
        if not slice_units:
            continue
        for metric in metrics:
            values = {s: unit_matrix(result, s, metric, slice_units) for s in strategies}
            _means, diffs = paired_bootstrap(values, [(s, BASELINE) for s in others])
            for (a, b), est in diffs.items():
                out["slice_vs_local_plus"].setdefault(slice_name, {}).setdefault(a, {})[metric] = {
                    "delta": est.mean,
                    "ci95": [est.low, est.high],
                    "seed_level": seed_interval(values[a], values[b]),
                }
    names = [c["name"] for c in result["clients"]]
    for ci, name in enumerate(names):
        for slice_name in SLICES:
            mine = [u for u in _units(result, slice_name) if u[0] == ci]
            if not mine:
                continue
            for metric in metrics:
                values = {s: unit_matrix(result, s, metric, mine) for s in strategies}
                _means, diffs = paired_bootstrap(values, [(s, BASELINE) for s in others])
                for (a, _b), est in diffs.items():
                    out["per_client"].setdefault(name, {}).setdefault(a, {}).setdefault(
                        slice_name, {}
                    )[metric] = {"delta": est.mean, "ci95": [est.low, est.high]}
    return out


def render_participant(report: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """Markdown: the net row per strategy and the per-client Pass@1 differences."""
    lines: list[str] = []
    net = report.get("net", {})
    if not net:
        return ""
    lines += [
        "**net** (every slice of every client, as the test mix weights them)",
        "",
        "| Method | Pass@1 (%) | NLL | Δ Pass@1 vs LocalOnly+ (pts; crossed / seed-level t) |",
        "|---|---|---|---|",
    ]
    vs = report.get("net_vs_local_plus", {})
    for s, m in net.items():
        p, n = m.get("pass@1"), m.get("nll")
        delta = vs.get(s, {}).get("pass@1")
        lines.append(
            f"| {labels.get(s, s)} | {_pct(p)} | {_num(n)} | {_delta(delta) if delta else '-'} |"
        )
    per = report.get("per_client", {})
    if per:
        lines += [
            "",
            "Per client, Δ Pass@1 against its own LocalOnly+ (pts, paired 95% interval):",
            "",
            "| client | method | " + " | ".join(SLICES) + " |",
            "|---|---|" + "---|" * len(SLICES),
        ]
        for client, by_strategy in per.items():
            for s, by_slice in by_strategy.items():
                cells = []
                for slice_name in SLICES:
                    d = by_slice.get(slice_name, {}).get("pass@1")
                    cells.append(
                        "-"
                        if d is None
                        else f"{100 * d['delta']:+.2f} [{100 * d['ci95'][0]:+.2f}, "
                        f"{100 * d['ci95'][1]:+.2f}]"
                    )
                lines.append(f"| {client} | {labels.get(s, s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(est: Mapping[str, Any] | None) -> str:
    if not est:
        return "-"
    return f"{100 * est['mean']:.2f} [{100 * est['ci95'][0]:.2f}, {100 * est['ci95'][1]:.2f}]"


def _num(est: Mapping[str, Any] | None) -> str:
    if not est:
        return "-"
    return f"{est['mean']:.4f} [{est['ci95'][0]:.4f}, {est['ci95'][1]:.4f}]"


def _delta(d: Mapping[str, Any]) -> str:
    crossed = f"{100 * d['delta']:+.2f} [{100 * d['ci95'][0]:+.2f}, {100 * d['ci95'][1]:+.2f}]"
    seed = d.get("seed_level") or {}
    ci = seed.get("ci95")
    level = "n/a (one seed)" if ci is None else f"[{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"
    return f"{crossed} / {level}"
