"""A final report's rows, as a table on a wide terminal and as vertical blocks elsewhere.

``peerlm up --workflow`` (a row per stage) and ``peerlm up --fedproxy`` (a row per member)
end with the same kind of report: a rich table where it fits (a terminal of at least 120
columns), and one block per row, a line per column, in a pipe, a log file or a narrow
terminal, where a table would wrap into noise.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from rich.console import Console

__all__ = ["print_rows"]


def print_rows(
    console: Console,
    title: str,
    rows: Sequence[Mapping[str, str]],
    key: str,
    *,
    left: Collection[str] = (),
    label_width: int = 14,
) -> None:
    """Print ``rows`` (each a column label -> cell, in column order) under ``title``; ``key``
    is the column naming a row (the block's heading), ``left`` the columns aligned left
    besides it (the rest are numbers, aligned right)."""
    from rich.table import Table

    if console.is_terminal and console.width >= 120 and rows:
        table = Table(title=title)
        for label in rows[0]:
            table.add_column(label, justify="left" if label == key or label in left else "right")
        for row in rows:
            table.add_row(*row.values())
        console.print(table)
        return
    lines = [title]
    for row in rows:
        lines.append(f"{row[key]}:")
        lines += [f"  {k:<{label_width}} {v}" for k, v in row.items() if k != key]
    console.print("\n".join(lines), highlight=False, soft_wrap=True)
