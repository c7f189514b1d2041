"""The answer check's ablation from one run: every policy's Pass@1 from the same answers.

A collaborative run's final evaluation records, per client, the Pass@1 each
``answer_check`` policy would have scored (``answer_checks``; the plan's is ``pass@1``):
the routed problems' own and slot answers were both checked against their prompt's
example, so another policy is another choice among the same answers, paired with the
plan's problem by problem and draw by draw (:mod:`peerlm.agent.exchange.answer_check`).
:func:`answer_check_ablation` turns that into the plan's policy minus each other one per
slice, and each policy's worst per-client lower bound against LocalOnly+ (the issue's
no-regret test); :func:`with_answer_check` is the whole result under another policy.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from peerlm.app.experiment_participant import participant_report, unit_matrix
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_stats import paired_bootstrap

#: Strategies whose clients have no peer slot (their records hold the checks too, equal).
_ALONE = frozenset({"local", "local_plus"})

__all__ = [
    "answer_check_ablation",
    "checked_strategies",
    "render_answer_check",
    "with_answer_check",
]


def checked_strategies(result: Mapping[str, Any]) -> list[str]:
    """The strategies with a peer slot (SemanticDFL's pulls included) whose every client
    record holds ``answer_checks``."""
    seeds = [str(s) for s in result["plan"]["seeds"]]
    return [
        s
        for s in result["plan"]["strategies"]
        if s not in _ALONE
        and all(
            "answer_checks" in client
            for seed in seeds
            for client in result["runs"][s][seed]["clients"].values()
        )
    ]


def with_answer_check(result: Mapping[str, Any], policy: str) -> dict[str, Any]:
    """A copy of ``result`` whose checked strategies score Pass@1 under ``policy`` (the
    others, and every other metric, as they are). Raises :class:`ValueError` for a policy
    the runs did not record."""
    out = copy.deepcopy(dict(result))
    for strategy in checked_strategies(result):
        for run in out["runs"][strategy].values():
            for client in run["clients"].values():
                if policy not in client["answer_checks"]:
                    raise ValueError(f"no answer_check {policy!r} in the records")
                client["pass@1"] = list(client["answer_checks"][policy])
    return out


def answer_check_ablation(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"policy", "strategies": {strategy: {other: {slice: {delta, ci95}}}},
    "worst_client_low": {strategy: {policy: {slice: {client, delta, low}}}}}``: the plan's
    policy minus each other one, per slice (paired bootstrap over seeds and units), and
    under each policy the client whose Pass@1 difference against LocalOnly+ has the lowest
    interval bound on the own and public slices. None when no run recorded the checks."""
    strategies = checked_strategies(result)
    if not strategies:
        return None
    plan_policy = str(result["plan"].get("answer_check", "own_first"))
    first = result["runs"][strategies[0]][str(result["plan"]["seeds"][0])]["clients"]
    policies = list(next(iter(first.values()))["answer_checks"])
    out: dict[str, Any] = {"policy": plan_policy, "strategies": {}, "worst_client_low": {}}
    variants = {p: with_answer_check(result, p) for p in policies}
    for strategy in strategies:
        for slice_name in (s for s in SLICES if result["units"][s]):
            units = result["units"][slice_name]
            values = {p: unit_matrix(variants[p], strategy, "pass@1", units) for p in policies}
            pairs = [(plan_policy, p) for p in policies if p != plan_policy]
            _means, diffs = paired_bootstrap(values, pairs)
            for (_a, other), est in diffs.items():
                out["strategies"].setdefault(strategy, {}).setdefault(other, {})[slice_name] = {
                    "delta": est.mean,
                    "ci95": [est.low, est.high],
                }
    if "local_plus" in result["plan"]["strategies"]:
        for policy, variant in variants.items():
            per_client = participant_report(variant, metrics=("pass@1",))["per_client"]
            for strategy in strategies:
                for slice_name in ("own", "public"):
                    rows = [
                        (name, row[strategy][slice_name]["pass@1"])
                        for name, row in per_client.items()
                        if slice_name in row.get(strategy, {})
                    ]
                    if not rows:
                        continue
                    name, est = min(rows, key=lambda r: (r[1]["ci95"][0], r[0]))
                    worst = out["worst_client_low"].setdefault(strategy, {}).setdefault(policy, {})
                    worst[slice_name] = {
                        "client": name,
                        "delta": est["delta"],
                        "low": est["ci95"][0],
                    }
    return out


def render_answer_check(ablation: Mapping[str, Any] | None, labels: Mapping[str, str]) -> str:
    """:func:`answer_check_ablation` as Markdown ("" without one)."""
    if not ablation:
        return ""
    policy = ablation["policy"]
    lines = [
        f"Answer check (`{policy}`) against the other policies, from the same answers "
        "(Δ Pass@1, pts, paired 95% interval):",
        "",
        "| method | other policy | " + " | ".join(SLICES) + " |",
        "|---|---|" + "---|" * len(SLICES),
    ]
    for strategy, others in ablation["strategies"].items():
        for other, per_slice in others.items():
            cells = [
                f"{100 * e['delta']:+.2f} [{100 * e['ci95'][0]:+.2f}, {100 * e['ci95'][1]:+.2f}]"
                if (e := per_slice.get(s))
                else "-"
                for s in SLICES
            ]
            lines.append(f"| {labels[strategy]} | {other} | " + " | ".join(cells) + " |")
    worst = ablation["worst_client_low"]
    if worst:
        lines += [
            "",
            "Each policy's worst client against its own LocalOnly+ (Δ Pass@1 and the lower "
            "bound of its interval, pts):",
            "",
            "| method | policy | own | public |",
            "|---|---|---|---|",
        ]
        for strategy, policies in worst.items():
            for name, per_slice in policies.items():
                cells = [
                    f"{w['client']} {100 * w['delta']:+.2f} (low {100 * w['low']:+.2f})"
                    if (w := per_slice.get(s))
                    else "-"
                    for s in ("own", "public")
                ]
                lines.append(f"| {labels[strategy]} | {name} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, ""])
