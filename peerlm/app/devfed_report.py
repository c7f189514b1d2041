"""``peerlm up``'s final report: each agent's before → after on its own, lacked and
validation slices, its exchanges, rewards, pulls, peer slot, bytes and errors, as a table
on wide consoles and one block per agent elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_report"]


def _before_after(r: Mapping[str, Any], slice_name: str, metric: str, fmt: str) -> str:
    before = r.get("slices_before", {}).get(slice_name, {}).get(metric)
    after = r.get("slices_after", {}).get(slice_name, {}).get(metric)
    if before is None:
        return "-"
    return f"{before:{fmt}}→{after:{fmt}}" if after is not None else f"{before:{fmt}}→?"


def _peer_slot(r: Mapping[str, Any]) -> str:
    """Integrations the agent's peer slot holds and, per slice, the share of its problems
    the router sent there at the end (``integration: separate``) with the routed answers
    the own adapter kept (``answer_check``); "-" without a slot."""
    shares = [
        f"{name} {v['peer_share']:.2f}"
        + (f" [{int(v['own_answers'])} kept by own adapter]" if v.get("own_answers") else "")
        for name, v in r.get("slices_after", {}).items()
        if isinstance(v, Mapping) and "peer_share" in v
    ]
    n = r.get("peer_slot_integrations")
    if not n and not shares:
        return "-"
    return f"{n or 0}" + (f" (routed {', '.join(shares)})" if shares else "")


def _agent_rows(r: Mapping[str, Any]) -> list[tuple[str, str]]:
    """One agent's figures as (label, value): the table's columns, or the narrow layout's
    lines. KB include the overlay's adapter pulls (received) and serves (sent)."""
    rewards = r.get("rewards", [])
    received = int(r.get("bytes_received", 0)) + int(r.get("overlay_bytes_received", 0))
    sent = int(r.get("bytes_sent", 0)) + int(r.get("overlay_bytes_sent", 0))
    return [
        ("model", Path(str(r.get("model", "simulated"))).name),
        ("lacked pass@1", _before_after(r, "lacked", "pass1", ".2f")),
        ("lacked NLL", _before_after(r, "lacked", "nll", ".3f")),
        ("own pass@1", _before_after(r, "own", "pass1", ".2f")),
        ("own NLL", _before_after(r, "own", "nll", ".3f")),
        ("val pass@1", f"{r.get('pass_at_1_before', 0):.2f}→{r.get('pass_at_1_after', 0):.2f}"),
        ("exch s/t", f"{r.get('exchanges', r.get('as_student', 0))}/{r.get('as_teacher', 0)}"),
        ("rewards", f"{len(rewards)}, mean {sum(rewards) / len(rewards):.4f}" if rewards else "0"),
        ("pulled", str(r.get("adapters_pulled", 0))),
        ("peer slot", _peer_slot(r)),
        ("KB sent/recv", f"{sent / 1024:.0f}/{received / 1024:.0f}"),
        ("errors", "; ".join(r.get("errors", [])) or "-"),
    ]


#: Below this console width the final report is one block per agent instead of a table.
WIDE_TABLE_COLUMNS = 140


def _table(result: dict[str, Any]) -> Table:
    """The final table, one row per agent (wide consoles)."""
    table = Table(
        title=f"peerlm dev federation: {result['rounds']} rounds in {result['seconds']} s"
    )
    agents = result["agents"]
    labels = [label for label, _ in _agent_rows(agents[0] if agents else {})]
    table.add_column("agent")
    for label in labels:
        table.add_column(label, justify="left" if label in ("model", "errors") else "right")
    for r in agents:
        table.add_row(r.get("name", "?"), *(value for _, value in _agent_rows(r)))
    return table


def _vertical(result: dict[str, Any]) -> str:
    """The final report for narrow consoles, pipes and files: one block per agent."""
    lines = [f"peerlm dev federation: {result['rounds']} rounds in {result['seconds']} s"]
    for r in result["agents"]:
        lines.append(f"{r.get('name', '?')}:")
        lines += [f"  {label:<14} {value}" for label, value in _agent_rows(r)]
    return "\n".join(lines)


def print_report(console: Console, result: dict[str, Any]) -> None:
    if console.is_terminal and console.width >= WIDE_TABLE_COLUMNS:
        console.print(_table(result))
    else:
        console.print(_vertical(result), highlight=False, soft_wrap=True)
