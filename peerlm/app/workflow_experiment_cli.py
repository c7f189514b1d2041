"""``peerlm run-workflow-experiment``: progress lines on stderr, a table or ``--json`` on stdout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

__all__ = ["run_workflow_experiment_command"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of integers: {text!r}") from None


def run_workflow_experiment_command(
    workflow: Annotated[
        str, typer.Option(help="The value-chain workflow; only 'code-chain' exists.")
    ] = "code-chain",
    strategies: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated, from: fedwave, fedavg, wo_dpo, wo_router, wo_vclayer, "
            "sft_only (the default: these six); the baselines fedprox, fedavgm, fedadam, "
            "fedyogi, scaffold and the centralised reference centralised are run only when "
            "named."
        ),
    ] = None,
    seeds: Annotated[str, typer.Option(help="Run seeds, comma-separated.")] = "0,1,2",
    quick: Annotated[bool, typer.Option(help="Smoke-test sizes (seconds per strategy).")] = False,
    rounds: Annotated[int | None, typer.Option(min=1, help="Federated rounds.")] = None,
    local_steps: Annotated[int | None, typer.Option(min=1, help="SFT steps a round.")] = None,
    dpo_steps: Annotated[
        int | None, typer.Option(min=0, help="DPO steps (SFT steps for the others).")
    ] = None,
    n_test: Annotated[int | None, typer.Option(min=1, help="Held-out test chains.")] = None,
    n_public: Annotated[int | None, typer.Option(min=1, help="Public prompts for DPO.")] = None,
    world_seed: Annotated[int, typer.Option(help="Seed of the data split.")] = 0,
    prox_mu: Annotated[
        float | None, typer.Option(min=0.0, help="FedProx's mu (default 0.01).")
    ] = None,
    server_lr: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="Server lr of fedavgm/fedadam/fedyogi (default 1.0 / 1e-2 / 1e-2)."
        ),
    ] = None,
    dpo_lr: Annotated[
        float | None, typer.Option(help="The DPO phase's AdamW lr (default 1e-4).")
    ] = None,
    router_lr: Annotated[
        float | None,
        typer.Option(help="The router's own AdamW lr (default 1e-2; the experts' is 2e-3)."),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads.")] = 1,
    out: Annotated[Path | None, typer.Option(help="Write results.json and table.md here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """FedWave vs FedAvg, the ablations and (when named) the other federated baselines and the
    centralised reference on a simulated value-chain workflow (docs/fedwave.md)."""
    if workflow != "code-chain":
        raise typer.BadParameter(f"unknown workflow {workflow!r}; only 'code-chain' exists")
    from peerlm.app.cli_models import quiet_transformers

    quiet_transformers()
    import torch

    from peerlm.agent import FedWaveSimulationConfig
    from peerlm.app.workflow_experiment import QUICK, render_table, run_workflow_experiment

    torch.set_num_threads(threads)
    given: dict[str, Any] = {
        "rounds": rounds,
        "local_steps": local_steps,
        "dpo_steps": dpo_steps,
        "n_test": n_test,
        "n_public": n_public,
        "world_seed": world_seed,
        "prox_mu": prox_mu,
        "server_lr": server_lr,
        "router_lr": router_lr,
        "dpo_lr": dpo_lr,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        base = QUICK if quick else FedWaveSimulationConfig()
        config = dataclasses.replace(base, **overrides)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    chosen = tuple(s.strip() for s in strategies.split(",") if s.strip()) if strategies else None
    err = Console(stderr=True)
    try:
        result = run_workflow_experiment(
            config,
            _ints(seeds),
            *(() if chosen is None else (chosen,)),
            progress=lambda msg: err.print(msg, markup=False, highlight=False),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    table = render_table(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "table.md").write_text(table + "\n")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(table)
