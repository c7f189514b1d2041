"""``peerlm bench agent-start``: what starting N agents costs before they serve, each a new
interpreter importing the agent's libraries (torch, transformers, peft, scikit-learn) or
forked from one :class:`peerlm.forkserver.ForkServer` that imported them once (what
``peerlm up`` does).

Each started command imports :data:`peerlm.app.devfed.AGENT_PRELOAD` (already imported when
forked) and reports its own CPU seconds; the forked mode adds the server's import CPU. Wall
time runs from the first start (the server's included) to the last command's report.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render_report", "run_benchmark"]

MODES = ("interpreter", "forked")
PROBE = "peerlm.bench.agent_start"


def _start_all(
    agents: int, preload: Sequence[str], forked: bool, env: dict[str, str]
) -> dict[str, float]:
    from peerlm.forkserver import ForkServer

    argv = [sys.executable, "-m", PROBE, ",".join(preload)]
    started = time.monotonic()
    server = ForkServer(env, preload).start() if forked else None
    try:
        procs = [
            (server.spawn if server else subprocess.Popen)(
                argv, stdout=subprocess.PIPE, text=True, env=env
            )
            for _ in range(agents)
        ]
        cpu = 0.0
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"a started command exited {proc.returncode}")
            cpu += float(json.loads(out.splitlines()[-1])["cpu_s"])
        wall = time.monotonic() - started
        if server is not None:
            if server.forked != agents:
                raise RuntimeError(f"forked {server.forked} of {agents}: {server.last_refusal}")
            cpu += float(server.info["import_cpu_s"])
    finally:
        if server is not None:
            server.close()
    return {"wall_s": wall, "cpu_s": cpu}


def run_benchmark(
    agents: int,
    repeats: int,
    progress: Callable[[str, int, int], None],
    preload: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``repeats`` starts of ``agents`` commands in each mode; means and spreads."""
    from peerlm.app.devfed import AGENT_ENV, AGENT_PRELOAD

    modules = tuple(AGENT_PRELOAD if preload is None else preload)
    env = {**os.environ, **AGENT_ENV}
    total = repeats * len(MODES)
    rows: list[dict[str, Any]] = []
    for mode in MODES:
        samples: list[dict[str, float]] = []
        for _ in range(repeats):
            progress(f"{mode}: {agents} commands", len(rows) * repeats + len(samples), total)
            samples.append(_start_all(agents, modules, mode == "forked", env))
        walls = [s["wall_s"] for s in samples]
        cpus = [s["cpu_s"] for s in samples]
        rows.append(
            {
                "mode": mode,
                "agents": agents,
                "repeats": repeats,
                "wall_s": statistics.fmean(walls),
                "wall_sd": statistics.stdev(walls) if repeats > 1 else 0.0,
                "cpu_s": statistics.fmean(cpus),
                "cpu_sd": statistics.stdev(cpus) if repeats > 1 else 0.0,
                "cpu_per_agent_s": statistics.fmean(cpus) / agents,
            }
        )
    progress("done", total, total)
    return {"preload": list(modules), "cores": os.cpu_count(), "rows": rows}


def render_report(report: dict[str, Any], console: Console) -> None:
    """One row per mode: wall and CPU seconds (mean ± sd over the repeats)."""
    table = Table(title=f"Starting agents (imports: {', '.join(report['preload'])})")
    for column in ("mode", "agents", "wall s", "CPU s", "CPU s / agent"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in report["rows"]:
        table.add_row(
            row["mode"],
            str(row["agents"]),
            f"{row['wall_s']:.1f} ± {row['wall_sd']:.1f}",
            f"{row['cpu_s']:.1f} ± {row['cpu_sd']:.1f}",
            f"{row['cpu_per_agent_s']:.2f}",
        )
    console.print(table)


def _probe(preload: str) -> None:
    """A started command: import ``preload`` (a no-op where forked), report own CPU."""
    import importlib

    for name in (m for m in preload.split(",") if m):
        importlib.import_module(name)
    print(json.dumps({"cpu_s": time.process_time()}), flush=True)


if __name__ == "__main__":
    _probe(sys.argv[1] if len(sys.argv) > 1 else "")
