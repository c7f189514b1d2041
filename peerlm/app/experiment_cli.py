"""``peerlm run-experiment``: progress on stderr (rich), a table or ``--json`` on stdout."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["run_experiment_command"]


def run_experiment_command(
    agents: Annotated[int, typer.Option("--agents", "-n", min=2, help="Clients.")] = 4,
    rounds: Annotated[int, typer.Option("--rounds", "-r", min=1, help="Rounds.")] = 5,
    strategies: Annotated[
        str,
        typer.Option(help="Comma-separated: local, random, heuristic, central_kd, cpm."),
    ] = "local,random,heuristic,central_kd,cpm",
    seed: Annotated[int, typer.Option(help="Seed of data, adapters, batches, pairing.")] = 0,
    micro: Annotated[bool, typer.Option(help="Micro models (seconds; for tests).")] = False,
    out: Annotated[
        Path | None, typer.Option(help="Write results.json, table.md and PNG plots here.")
    ] = None,
    models_dir: Annotated[
        Path | None, typer.Option(help="Built models (cached); default state/models[-micro].")
    ] = None,
    work_dir: Annotated[Path, typer.Option(help="Federation data.")] = Path("state/experiment"),
    local_steps: Annotated[int, typer.Option(min=1, help="Optimiser steps per round.")] = 8,
    grad_accumulation: Annotated[
        int, typer.Option(min=1, help="Micro-batches of 8 per step (Table 6: 4).")
    ] = 4,
    transfer_limit: Annotated[int, typer.Option(min=1, help="Prompts of X_u used.")] = 32,
    test_limit: Annotated[int, typer.Option(min=1, help="Global test problems.")] = 48,
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem (pass@k).")] = 10,
    temperature: Annotated[float, typer.Option(min=0.01, help="Sampling temperature.")] = 0.8,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads per process.")] = 1,
    jobs: Annotated[
        int, typer.Option(min=1, help="Strategies run in this many processes at once.")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Run the paper's comparison (Table 4) in one process with real tiny models."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from peerlm.app.cli_models import quiet_transformers
    from peerlm.app.experiment import ExperimentPlan, render_table, run_experiment, write_outputs

    quiet_transformers()
    import torch

    torch.set_num_threads(threads)
    names = tuple(s.strip() for s in strategies.split(",") if s.strip())
    try:
        plan = ExperimentPlan(
            agents=agents,
            rounds=rounds,
            strategies=names,
            seed=seed,
            size="micro" if micro else "tiny",
            local_steps=local_steps,
            grad_accumulation=grad_accumulation,
            transfer_limit=transfer_limit,
            test_limit=test_limit,
            samples=samples,
            sample_temperature=temperature,
            max_new_tokens=max_new_tokens,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    models = models_dir or Path("state/models-micro" if micro else "state/models")
    err = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=err,
        disable=as_json and not err.is_terminal,
    )
    with progress:
        tasks = {s: progress.add_task(s, total=rounds + 1, status="") for s in names}
        builds: dict[str, Any] = {}

        def on_event(kind: str, data: Any) -> None:
            if kind == "build":
                arch = data["arch"]
                if arch not in builds:
                    builds[arch] = progress.add_task(f"build {arch}", total=None, status="")
                done = data["phase"] in ("done", "cached")
                total = max(int(data["total"]), 1)
                progress.update(
                    builds[arch],
                    total=total,
                    completed=total if done else int(data["step"]),
                    status=data["phase"],
                )
            elif kind == "initial":
                progress.console.print(
                    f"round 0 (pre-trained) test pass@1: {data['test_pass@1']:.3f}"
                )
            elif kind == "round":
                status = f"pass@1 {data['test_pass@1']:.3f}"
                progress.update(tasks[data["strategy"]], completed=data["round"], status=status)
                if not err.is_terminal:  # a log file gets one line per round instead of bars
                    err.print(f"{data['strategy']}: round {data['round']} test {status}")
            elif kind == "final":
                progress.update(tasks[data["strategy"]], completed=rounds + 1, status="done")
                if not err.is_terminal:
                    err.print(f"{data['strategy']}: done")

        result = run_experiment(plan, models=models, work=work_dir, event=on_event, jobs=jobs)
    if out is not None:
        written = write_outputs(result, out)
        err.print("wrote " + ", ".join(str(p) for p in written))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        Console().print(Markdown(render_table(result)))
        Console().print(f"{result['seconds']:.0f} s")
