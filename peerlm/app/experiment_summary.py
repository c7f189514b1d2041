"""The statistics of a ``run-experiment`` result: means per strategy, metric and slice with
paired bootstrap intervals, the key differences and the CPM's learning figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from peerlm.app.experiment_answer_check import answer_check_ablation
from peerlm.app.experiment_ceiling import teaching_ceiling
from peerlm.app.experiment_participant import participant_report, unit_matrix
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_stats import paired_bootstrap, paired_share
from peerlm.app.experiment_strategies import COLLABORATIVE, COMPARISONS, LABELS, METRICS

__all__ = ["metric_matrix", "summarise"]


def metric_matrix(result: Mapping[str, Any], strategy: str, metric: str, slice_name: str) -> Any:
    """[seeds, units] of one metric of one strategy on one slice."""
    return unit_matrix(result, strategy, metric, result["units"][slice_name])


def _cpm_learning(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the CPM learnt, against the oracle's true probe gains of the same round/seed.

    Per round: the gain (under the oracle run's trial matrix of that round and seed) of the
    CPM's chosen pairs, of the oracle's pairs, and of the mean pair (what random pairing
    gets in expectation). The oracle's matrix is measured on the oracle run's adapters, not
    the CPM's, so this is an approximation: both runs share round 1's local phase and
    differ afterwards only by what their exchanges taught.
    """
    runs = result["runs"]
    if "cpm" not in runs or "oracle" not in runs:
        return None
    per_round: list[dict[str, Any]] = []
    for seed in result["plan"]["seeds"]:
        cpm_rounds = runs["cpm"][str(seed)]["rounds"]
        oracle_rounds = runs["oracle"][str(seed)]["rounds"]
        for cr, orr in zip(cpm_rounds, oracle_rounds, strict=True):
            gains: Mapping[str, float] = orr["oracle_gains"]
            chosen = [f"{x['teacher']}>{x['student']}" for x in cr["exchanges"]]
            best = [f"{x['teacher']}>{x['student']}" for x in orr["exchanges"]]
            per_round.append(
                {
                    "seed": seed,
                    "round": cr["round"],
                    "cpm_pairs": chosen,
                    "oracle_pairs": best,
                    "cpm_gain": float(sum(gains.get(p, 0.0) for p in chosen)),
                    "oracle_gain": float(sum(gains[p] for p in best)),
                    "random_gain": float(np.mean(list(gains.values())) * len(best))
                    if gains
                    else 0.0,
                    "agreement": len(set(chosen) & set(best)) / max(1, len(best)),
                }
            )
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in per_round:
        by_round.setdefault(r["round"], []).append(r)
    return {
        "per_round": per_round,
        "mean_by_round": {
            str(t): {
                key: float(np.mean([r[key] for r in rows]))
                for key in ("cpm_gain", "oracle_gain", "random_gain", "agreement")
            }
            for t, rows in sorted(by_round.items())
        },
    }


def summarise(result: Mapping[str, Any]) -> dict[str, Any]:
    """Means per strategy, metric and slice with 95% intervals (paired bootstrap over seeds
    and units, :func:`~peerlm.app.experiment_stats.paired_bootstrap`), the key differences
    as ``comparisons["<a>_vs_<b>"]`` and the CPM's learning figures."""
    strategies = list(result["plan"]["strategies"])
    slices = [s for s in SLICES if result["units"][s]]
    per: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in strategies}
    estimates: dict[tuple[str, str], Any] = {}
    for slice_name in slices:
        for metric in METRICS:
            values = {s: metric_matrix(result, s, metric, slice_name) for s in strategies}
            pairs = [(a, b) for a in strategies for b in strategies if a != b]
            means, diffs = paired_bootstrap(values, pairs)
            for s in strategies:
                per[s].setdefault(slice_name, {})[metric] = means[s].to_dict()
            for (a, b), est in diffs.items():
                estimates[(f"{slice_name}:{metric}", f"{a}_vs_{b}")] = est
    # "best": the collaborative strategy with the lowest NLL on the probe problems of the
    # clients' lacked categories (data other than the test set); runs without probe
    # figures (stored before they were recorded): the highest lacked-slice test pass@1.
    target = "lacked" if "lacked" in slices else (slices[0] if slices else None)
    collaborative = [s for s in strategies if s in COLLABORATIVE]
    best = None
    if target is not None and collaborative:
        probe = {s: _probe_lacked_nll(result, s) for s in collaborative}
        if all(v is not None for v in probe.values()):
            best = min(collaborative, key=lambda s: (probe[s], s))
        else:
            best = max(
                collaborative,
                key=lambda s: (per[s][target]["pass@1"]["mean"], -per[s][target]["nll"]["mean"]),
            )
    comparisons: dict[str, Any] = {}
    if target is not None:
        for a, b in COMPARISONS:
            name = best if a == "best" else a
            if name is None or name not in strategies or b not in strategies or name == b:
                continue
            entry: dict[str, Any] = {"a": name, "b": b, "slice": target}
            for metric in METRICS:
                est = estimates[(f"{target}:{metric}", f"{name}_vs_{b}")]
                entry[metric] = {"delta": est.mean, "ci95": [est.low, est.high]}
            entry["delta"] = entry["pass@1"]["delta"]
            entry["ci95"] = entry["pass@1"]["ci95"]
            comparisons[f"{a}_vs_{b}"] = entry
    oracle_share = None
    shares: dict[str, Any] = {}
    if {"oracle", "cpm", "local_plus"} <= set(strategies) and target is not None:
        # The share of Oracle pairing's gain over LocalOnly+ that KNEXA-FL reaches, per
        # metric where the oracle is the better one (NLL: lower), with its interval.
        for metric in METRICS:
            # Only a resolved gain has a share: the oracle's interval against LocalOnly+
            # must lie on the better side of zero (NLL: below).
            sign = -1.0 if metric == "nll" else 1.0
            gain = estimates[(f"{target}:{metric}", "oracle_vs_local_plus")]
            if not min(sign * gain.low, sign * gain.high) > 0:
                continue
            values = {
                s: metric_matrix(result, s, metric, target) for s in ("cpm", "local_plus", "oracle")
            }
            share = paired_share(values, "cpm", "local_plus", "oracle")
            if share is not None:
                shares[metric] = share.to_dict()
        if "pass@1" in shares:
            oracle_share = shares["pass@1"]["mean"]
    runs = result["runs"]
    seeds = [str(s) for s in result["plan"]["seeds"]]
    return {
        "slices": slices,
        "strategies": {
            s: {
                "label": LABELS[s],
                "metrics": per[s],
                "exchanges": float(np.mean([runs[s][k]["exchanges"] for k in seeds])),
                "kilobytes": float(np.mean([runs[s][k]["kilobytes"] for k in seeds])),
                "mean_reward": _mean_or_none([runs[s][k]["mean_reward"] for k in seeds]),
            }
            for s in strategies
        },
        "best_collaborative": best,
        "comparisons": comparisons,
        "cpm_share_of_oracle_gain": oracle_share,
        "cpm_share_of_oracle_gain_ci": shares,
        "cpm_learning": _cpm_learning(result),
        "participant": participant_report(result),
        "teaching_ceiling": teaching_ceiling(result),
        "steps_per_client": _steps_per_client(result),
        "answer_check": answer_check_ablation(result),
        "bootstrap": "paired two-level percentile bootstrap (numpy), 2000 replicates",
    }


def _steps_per_client(result: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per strategy and client, the mean own-data and distillation (or merge) optimiser
    steps a run spent, and the share of its test problems the peer slot answered."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    seeds = [str(s) for s in result["plan"]["seeds"]]
    for s in result["plan"]["strategies"]:
        for name in (c["name"] for c in result["clients"]):
            runs = [result["runs"][s][k]["clients"][name] for k in seeds]
            if not all("own_steps" in r for r in runs):
                continue
            out.setdefault(s, {})[name] = {
                "own_steps": float(np.mean([r["own_steps"] for r in runs])),
                "peer_steps": float(np.mean([r["peer_steps"] for r in runs])),
                "peer_routed_share": float(np.mean([np.mean(r["peer_routed"]) for r in runs])),
            }
    return out


def _probe_lacked_nll(result: Mapping[str, Any], strategy: str) -> float | None:
    """Mean probe-set NLL of ``strategy`` over seeds, clients and the probe problems of each
    client's lacked categories; None when a run has no probe figures."""
    probe_categories = result.get("probe_categories")
    if not probe_categories:
        return None
    values: list[float] = []
    for seed in result["plan"]["seeds"]:
        clients = result["runs"][strategy][str(seed)]["clients"]
        for c in result["clients"]:
            got = clients[c["name"]].get("probe_nll")
            if got is None:
                return None
            lacked = set(c["slices"]["lacked"])
            values += [v for v, cat in zip(got, probe_categories, strict=True) if cat in lacked]
    return float(np.mean(values)) if values else None


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None
