"""``peerlm bench experiment-round``: what one client-round of ``run-experiment`` costs.

Times every phase of a round (:func:`peerlm.app.experiment.round_costs`) under two plans:
``before``, the configuration the experiment ran until 2026-12-05 (4 clients x 4 rounds,
12 local and 48 AKD steps a round, validation generated every round, every teachable X_u
prompt answered every round, the test NLL curve every round, own-data steps for
LocalOnly+ only), and ``after``, today's default (:class:`ExperimentPlan`). Reports seconds
per client-round phase by phase, the final evaluation per client, and the whole plan's
projected CPU seconds and wall time on the given cores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from peerlm.app.experiment_plan import ExperimentPlan

__all__ = ["BEFORE", "compared_plans", "render_report", "run_benchmark"]

#: The final evaluation of a run that replays LocalOnly+'s track ("-" where none does).
_REPLAYING = "final_replaying_seconds_per_client"

#: The plan's fields that were the default before 2026-12-05.
BEFORE: Mapping[str, Any] = {
    "agents": 4,
    "rounds": 4,
    "local_steps": 12,
    "akd_steps": 48,
    "val_every": 1,
    "teach_limit": None,
    "curve_every": 1,
    "own_steps_every_round": False,
    "integration": "shared",
    "slot_banks": "one",
    "pairing": "disjoint",
    "teachers_per_student": 1,
    "probe_scope": "all",
}


def compared_plans(micro: bool) -> tuple[ExperimentPlan, ExperimentPlan]:
    """The plan before the round was made cheap (:data:`BEFORE`) and today's default."""
    from peerlm.app.experiment_plan import ExperimentPlan

    after = ExperimentPlan(size="micro" if micro else "tiny")
    return replace(after, **BEFORE), after


def run_benchmark(
    models: Path | None,
    work: Path,
    *,
    micro: bool,
    rounds: int,
    cores: int,
    progress: Callable[[str, int, int], None],
) -> dict[str, Any]:
    """Both plans' round costs (``rounds`` timed rounds each) and their projections;
    ``models`` None: run-experiment's model cache."""
    # The one benchmark that drives the application layer: what it times is the experiment
    # harness itself (.importlinter names the exception).
    from peerlm.app.cli_models import models_cache_dir, quiet_transformers
    from peerlm.app.experiment_costs import round_costs

    quiet_transformers()
    models = models or models_cache_dir("micro" if micro else "tiny")

    before, after = compared_plans(micro)
    out: dict[str, Any] = {"cores": cores, "timed_rounds": rounds, "size": after.size}
    for k, (name, plan) in enumerate((("before", before), ("after", after))):
        progress(f"{name}: timing {rounds} rounds", k, 2)
        cost = round_costs(plan, models, work / name, lambda kind, data: None, rounds=rounds)
        cost["projected_wall_seconds"] = cost["projected_cpu_seconds"] / cores
        out[name] = cost
    progress("done", 2, 2)
    return out


def render_report(report: Mapping[str, Any], console: Console) -> None:
    """Phase by phase, before and after."""
    before, after = report["before"], report["after"]
    table = Table(title=f"seconds per client-round ({report['size']} models, one thread)")
    table.add_column("phase")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for phase in before["per_client_round"]:
        table.add_row(
            phase,
            f"{before['per_client_round'][phase]:.2f}",
            f"{after['per_client_round'].get(phase, 0.0):.2f}",
        )
    table.add_row(
        "total",
        f"{before['seconds_per_client_round']:.2f}",
        f"{after['seconds_per_client_round']:.2f}",
    )
    for key, label in (
        ("final_alone_seconds_per_client", "final evaluation, own adapter alone (per client)"),
        ("final_replaying_seconds_per_client", "final evaluation, replaying LocalOnly+'s"),
        ("final_seconds_per_client", "final evaluation (per client, the plan's mean)"),
    ):
        cells = [
            f"{plan[key]:.2f}" if key != _REPLAYING or plan["replays_own_track"] else "-"
            for plan in (before, after)
        ]
        table.add_row(label, *cells)
    for key, label in (("client_rounds", "client-rounds in the plan"),):
        table.add_row(label, str(before[key]), str(after[key]))
    table.add_row(
        f"projected wall time on {report['cores']} cores (min)",
        f"{before['projected_wall_seconds'] / 60:.1f}",
        f"{after['projected_wall_seconds'] / 60:.1f}",
    )
    console.print(table)
