"""The experiment's outputs: the Markdown table, ``results.json`` and the per-round plot."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from peerlm.app.experiment_answer_check import render_answer_check
from peerlm.app.experiment_ceiling import render_ceiling
from peerlm.app.experiment_participant import render_participant
from peerlm.app.experiment_strategies import LABELS

__all__ = ["render_table", "write_outputs"]


def _fmt(est: Mapping[str, Any], scale: float, digits: int) -> str:
    low, high = est["ci95"]
    center = est.get("mean", est.get("delta"))
    return f"{scale * center:.{digits}f} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def render_table(result: Mapping[str, Any]) -> str:
    """The table as Markdown: per strategy and slice, Pass@1 (%), structural match (%) and
    NLL (nats/byte) with 95% intervals; then the key differences."""
    summary = result["summary"]
    lines: list[str] = []
    for slice_name in summary["slices"]:
        lines += [
            f"**{slice_name}** slice ({len(result['units'][slice_name])} client-problem units "
            f"x {len(result['plan']['seeds'])} seeds)",
            "",
            "| Method | Pass@1 (%) | Struct match (%) | NLL (nats/byte) | exchanges | KB | "
            "mean reward |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in summary["strategies"].values():
            m = r["metrics"][slice_name]
            reward = "-" if r["mean_reward"] is None else f"{r['mean_reward']:.4f}"
            lines.append(
                f"| {r['label']} | {_fmt(m['pass@1'], 100, 2)} | {_fmt(m['struct'], 100, 2)} | "
                f"{_fmt(m['nll'], 1, 4)} | {r['exchanges']:.0f} | {r['kilobytes']:.0f} | "
                f"{reward} |"
            )
        lines.append("")
    if summary["comparisons"]:
        lines += [
            "Key differences (a - b, paired bootstrap 95% interval; NLL: lower is better):",
            "",
            "| Comparison | slice | ΔPass@1 (pts) | ΔStruct (pts) | ΔNLL |",
            "|---|---|---|---|---|",
        ]
        shown: set[tuple[str, str]] = set()
        for c in summary["comparisons"].values():
            # "best" may be a strategy that has its own row (the same difference twice).
            if (c["a"], c["b"]) in shown:
                continue
            shown.add((c["a"], c["b"]))
            lines.append(
                f"| {LABELS[c['a']]} - {LABELS[c['b']]} | {c['slice']} | "
                f"{_fmt(c['pass@1'], 100, 2)} | {_fmt(c['struct'], 100, 2)} | "
                f"{_fmt(c['nll'], 1, 4)} |"
            )
        lines.append("")
    shares = summary.get("cpm_share_of_oracle_gain_ci") or {}
    for metric, est in shares.items():
        low, high = est["ci95"]
        lines.append(
            f"KNEXA-FL reaches {100 * est['mean']:.0f}% [{100 * low:.0f}, {100 * high:.0f}] of "
            f"Oracle pairing's {metric} gain over LocalOnly+ on the lacked slice."
        )
    if shares:
        lines.append("")
    learning = summary["cpm_learning"]
    if learning:
        lines += [
            "CPM vs oracle pairing, per round (true probe gain of the chosen pairs):",
            "",
            "| round | CPM | oracle | random (mean pair) | agreement |",
            "|---|---|---|---|---|",
        ]
        for t, v in learning["mean_by_round"].items():
            lines.append(
                f"| {t} | {v['cpm_gain']:.4f} | {v['oracle_gain']:.4f} | "
                f"{v['random_gain']:.4f} | {100 * v['agreement']:.0f}% |"
            )
        lines.append("")
    participant = summary.get("participant")
    if participant:
        lines.append(render_participant(participant, LABELS))
    ceiling = render_ceiling(summary.get("teaching_ceiling"), LABELS)
    if ceiling:
        lines.append(ceiling)
    checked = render_answer_check(summary.get("answer_check"), LABELS)
    if checked:
        lines.append(checked)
    return "\n".join(lines)


def write_outputs(result: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.json``, ``table.md`` and (with matplotlib) the per-round plot under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "table.md"]
    written[0].write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    written[1].write_text(render_table(result))
    try:
        import matplotlib
    except ImportError:  # the plots need the bench extra; the numbers do not
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slices = result["summary"]["slices"]
    fig, axes = plt.subplots(1, len(slices), figsize=(5 * len(slices), 4.2), squeeze=False)
    seeds = [str(s) for s in result["plan"]["seeds"]]
    for ax, slice_name in zip(axes[0], slices, strict=True):
        for name in result["plan"]["strategies"]:
            curves = np.asarray(
                [result["runs"][name][s]["curve_nll"][slice_name] for s in seeds], dtype=float
            )
            first = result["runs"][name][seeds[0]]
            x = np.asarray(first.get("curve_rounds", range(curves.shape[1])))
            mean = curves.mean(axis=0)
            ax.plot(x, mean, marker="o", label=LABELS[name])
            # Band: the range over run seeds (3 seeds make a standard error meaningless).
            ax.fill_between(x, curves.min(axis=0), curves.max(axis=0), alpha=0.15)
        ax.set_xlabel("round")
        ax.set_ylabel("NLL of the test references (nats/byte)")
        ax.set_title(f"{slice_name} skills")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "nll_by_round.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
