"""``peerlm bench cpm-replay``: the CPM replayed on an experiment's measured pair gains.

An Oracle-pairing run of ``peerlm run-experiment`` measures, every round, the true probe
gain of *every* ordered (teacher, student) pair and records the profiles each client sent.
That is a table of counterfactuals: what any matchmaker would have got, had it chosen
those pairs in that round. This benchmark replays the real :class:`Matchmaker` (under
several settings: context columns, interaction features, exploration beta, matching) on
those tables, many bandit seeds each, and reports the gain of its chosen pairs against the
oracle's (the greedy disjoint pairs of largest realised gain), the mean pair (what random
pairing gets in expectation) and the best *fixed* matching in hindsight. It costs seconds;
a real CPM run costs minutes a seed.

What it approximates (so read it as a ranking of settings, not as the experiment):

* the gains are those of the oracle's own trajectory: a CPM that chose other pairs would
  have moved its clients elsewhere and met other gains the next round;
* the profiles are the ones the oracle run's clients sent (their last-reward and exchange
  entries reflect the oracle's history);
* the bandit observes the pair's probe gain as its reward, Eq. 3 without the KB term
  (text packages of a few KB move it by ~0.003 per KB).

``share`` is ``(cpm - random) / (oracle - random)``: 0 is random pairing, 1 the oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from peerlm.services.cpm import Matchmaker, context_columns

__all__ = ["ReplaySetting", "default_settings", "render_report", "replay"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ReplaySetting:
    """One CPM configuration to replay."""

    columns: str = "all"
    interaction: bool = True
    beta: float = 1.0
    matching: Literal["greedy", "blossom"] = "greedy"

    def label(self) -> str:
        kind = "interaction" if self.interaction else "plain"
        return f"{self.columns} / {kind} / beta {self.beta:g} / {self.matching}"


def default_settings() -> list[ReplaySetting]:
    """The grid the command replays unless told otherwise (the service default first)."""
    grid = itertools.product(
        ("all", "dynamic", "performance", "static,performance"),
        (True, False),
        (1.0, 0.25),
        ("greedy", "blossom"),
    )
    return [ReplaySetting(c, i, b, m) for c, i, b, m in grid]  # type: ignore[arg-type]


def _oracle_tables(result: Mapping[str, Any]) -> list[list[Mapping[str, Any]]]:
    try:
        runs = result["runs"]["oracle"]
    except (KeyError, TypeError):
        raise ValueError(
            "the results hold no Oracle-pairing run (run-experiment --strategies oracle)"
        ) from None
    tables: list[list[Mapping[str, Any]]] = []
    for seed, run in sorted(runs.items()):
        rounds = run["rounds"]
        if not rounds or any("profiles" not in r or "oracle_gains" not in r for r in rounds):
            raise ValueError(
                f"the oracle run of seed {seed} lacks per-round profiles or gains "
                "(measured by an older peerlm: run it again)"
            )
        tables.append(rounds)
    return tables


def _matchings(names: Sequence[str], pairs: int) -> list[list[tuple[str, str]]]:
    """Every set of ``pairs`` disjoint ordered pairs (small federations only)."""
    ordered = [(a, b) for a in names for b in names if a != b]
    out = []
    for combo in itertools.combinations(ordered, pairs):
        ends = [x for p in combo for x in p]
        if len(set(ends)) == len(ends):
            out.append(list(combo))
    return out


def replay(
    result: Mapping[str, Any],
    settings: Sequence[ReplaySetting],
    *,
    bandit_seeds: int = 24,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Replay every setting on every oracle run of ``result`` (a ``results.json``).

    Raises ``ValueError`` if the results hold no oracle run with recorded profiles.
    """
    if bandit_seeds < 1:
        raise ValueError("bandit_seeds must be >= 1")
    tables = _oracle_tables(result)
    random_gain = oracle_gain = 0.0
    for rounds in tables:
        for r in rounds:
            gains = r["oracle_gains"]
            random_gain += float(np.mean(list(gains.values()))) * len(r["exchanges"])
            oracle_gain += sum(
                float(gains[f"{x['teacher']}>{x['student']}"]) for x in r["exchanges"]
            )
    fixed = 0.0
    for rounds in tables:
        names = sorted(rounds[0]["profiles"])
        per = len(rounds[0]["exchanges"])
        if len(names) <= 6:  # enumerating matchings is cheap only for a few clients
            fixed += max(
                sum(sum(r["oracle_gains"][f"{s}>{t}"] for s, t in m) for r in rounds)
                for m in _matchings(names, per)
            )
        else:
            fixed = float("nan")
    denom = oracle_gain - random_gain
    rows = []
    for k, setting in enumerate(settings):
        if progress is not None:
            progress(setting.label(), k, len(settings))
        totals = []
        for b in range(bandit_seeds):
            total = 0.0
            for rounds in tables:
                mm = Matchmaker(
                    seed=b,
                    beta=setting.beta,
                    interaction_features=setting.interaction,
                    matching=setting.matching,
                    context_columns=context_columns(setting.columns),
                )
                for r in rounds:
                    profiles = {
                        a: np.asarray(p, dtype=np.float64) for a, p in r["profiles"].items()
                    }
                    for pairing in mm.select(profiles)[: len(r["exchanges"])]:
                        gain = float(r["oracle_gains"][f"{pairing.sender}>{pairing.receiver}"])
                        total += gain
                        mm.observe(pairing, gain)
            totals.append(total)
        mean = float(np.mean(totals))
        rows.append(
            {
                **asdict(setting),
                "label": setting.label(),
                "cpm_gain": mean,
                "cpm_gain_sd": float(np.std(totals)),
                "share": (mean - random_gain) / denom if denom > 0 else None,
            }
        )
    if progress is not None:
        progress("done", len(settings), len(settings))
    rows.sort(key=lambda r: -r["cpm_gain"])
    return {
        "runs": len(tables),
        "rounds": sum(len(t) for t in tables),
        "bandit_seeds": bandit_seeds,
        "random_gain": random_gain,
        "oracle_gain": oracle_gain,
        "best_fixed_matching_gain": fixed,
        "best_fixed_matching_share": (fixed - random_gain) / denom if denom > 0 else None,
        "settings": rows,
    }


def render_report(report: Mapping[str, Any], console: Any) -> None:
    """The replay as a rich table, best setting first."""
    from rich.table import Table

    table = Table(
        title=(
            f"CPM replayed on {report['runs']} oracle run(s), {report['rounds']} rounds, "
            f"{report['bandit_seeds']} bandit seeds: random {report['random_gain']:.3f}, "
            f"oracle {report['oracle_gain']:.3f}, best fixed matching "
            f"{report['best_fixed_matching_gain']:.3f}"
        )
    )
    for col in ("setting", "gain", "sd", "share of oracle over random"):
        table.add_column(col)
    for r in report["settings"]:
        share = "-" if r["share"] is None else f"{r['share']:.2f}"
        table.add_row(r["label"], f"{r['cpm_gain']:.3f}", f"{r['cpm_gain_sd']:.3f}", share)
    console.print(table)
