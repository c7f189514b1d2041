"""``peerlm data``: build a federation's task data from the bundled bank, and inspect it.

Failures a person can cause (bad numbers, a directory built with other arguments, a
missing or malformed manifest) exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from peerlm.agent import DEFAULT_PRIVATE_CATEGORIES

if TYPE_CHECKING:
    from peerlm.agent import Manifest

__all__ = ["app"]

app = typer.Typer(
    help="Task data: the code-generation bank split over a federation's clients.",
    no_args_is_help=True,
    add_completion=False,
)

_USAGE_ERROR = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=_USAGE_ERROR)


@app.command("build")
def build_command(
    directory: Annotated[Path, typer.Option("--dir", help="Output directory.")],
    clients: Annotated[int, typer.Option("--clients", help="Number of clients.", min=1)],
    alpha: Annotated[
        float, typer.Option(help="Dirichlet concentration (the dirichlet layout only).")
    ] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed for the bank and every split.")] = 0,
    layout: Annotated[
        str, typer.Option(help="experts (a few holders per private skill) or dirichlet.")
    ] = "experts",
    private: Annotated[
        str,
        typer.Option(help="Comma-separated private categories (absent from pre-training)."),
    ] = ",".join(DEFAULT_PRIVATE_CATEGORIES),
    experts_per_skill: Annotated[
        int, typer.Option("--experts-per-skill", help="Clients holding each private skill.")
    ] = 1,
    unskilled: Annotated[
        int, typer.Option("--unskilled", help="Clients (the last ones) with no private skill.")
    ] = 0,
    per_private: Annotated[
        int, typer.Option("--per-private", help="Problems per private category.", min=1)
    ] = 200,
    per_public: Annotated[
        int, typer.Option("--per-public", help="Problems per public category.", min=1)
    ] = 60,
    test_per_category: Annotated[
        int, typer.Option("--test-per-category", help="Test problems per category.", min=0)
    ] = 20,
    transfer_per_private: Annotated[
        int, typer.Option("--transfer-per-private", help="Transfer prompts per private category.")
    ] = 24,
    transfer_per_public: Annotated[
        int, typer.Option("--transfer-per-public", help="Transfer prompts per public category.")
    ] = 4,
    val_fraction: Annotated[
        float, typer.Option("--val-fraction", help="Share of each client's data for validation.")
    ] = 0.2,
    min_per_client: Annotated[
        int, typer.Option("--min-per-client", help="Fewest problems any client gets.", min=0)
    ] = 8,
    force: Annotated[
        bool, typer.Option("--force", help="Replace data built with other arguments.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Generate the bank and write clients/<i>/{train,val}.jsonl, transfer, test, manifest."""
    from peerlm.agent import WorldSpec, build_federation_data

    try:
        spec = WorldSpec.from_dict(
            {
                "layout": layout,
                "private_categories": tuple(c for c in private.split(",") if c),
                "experts_per_skill": experts_per_skill,
                "unskilled_clients": unskilled,
                "per_private_category": per_private,
                "per_public_category": per_public,
                "test_per_category": test_per_category,
                "transfer_per_private": transfer_per_private,
                "transfer_per_public": transfer_per_public,
            }
        )
        manifest = build_federation_data(
            directory,
            n_clients=clients,
            alpha=alpha,
            seed=seed,
            world=spec,
            val_fraction=val_fraction,
            min_per_client=min_per_client,
            overwrite=force,
        )
    except (OSError, ValueError) as err:
        _fail(str(err))
    if as_json:
        typer.echo(json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
        return
    train = sum(t for t, _ in manifest.client_sizes)
    val = sum(v for _, v in manifest.client_sizes)
    typer.echo(
        f"wrote {directory}: {manifest.n_clients} clients ({train} train, {val} val), "
        f"{manifest.transfer_size} transfer, {manifest.test_size} test; "
        # In full: the agents' `transfer_sha256` setting must be exactly this.
        f"transfer sha256 {manifest.transfer_sha256}; private "
        f"{', '.join(manifest.world.private_categories)}; skills "
        + "; ".join(f"{i}: {', '.join(own) or '-'}" for i, own in enumerate(manifest.world.skills))
    )


@app.command("show")
def show_command(
    directory: Annotated[Path, typer.Option("--dir", help="A directory written by build.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Summarise a data directory: sizes, each client's dominant categories, file integrity."""
    from peerlm.agent import category_histogram, read_jsonl, read_manifest

    try:
        manifest = read_manifest(directory)
        histograms = [
            category_histogram(read_jsonl(directory / "clients" / str(i) / "train.jsonl"))
            for i in range(manifest.n_clients)
        ]
    except (OSError, ValueError) as err:
        _fail(str(err))
    integrity = _check_files(directory, manifest)
    clients: list[dict[str, Any]] = []
    for i, ((train, val), hist) in enumerate(zip(manifest.client_sizes, histograms, strict=True)):
        top = sorted(range(len(hist)), key=lambda j: (-hist[j], j))[:3]
        shares = {manifest.categories[j]: round(float(hist[j]), 3) for j in top if hist[j] > 0}
        clients.append(
            {
                "client": i,
                "train": train,
                "val": val,
                "top_categories": shares,
                "own": list(manifest.world.own(i)),
                "lacked": list(manifest.world.lacked(i)),
            }
        )
    if as_json:
        summary = {**manifest.to_dict(), "clients": clients, "integrity": integrity}
        typer.echo(json.dumps(summary, indent=2, sort_keys=True))
        if any(state != "ok" for state in integrity.values()):
            raise typer.Exit(code=1)
        return
    console = Console()
    console.print(
        f"[bold]{directory}[/]  seed={manifest.seed} alpha={manifest.alpha} "
        f"clients={manifest.n_clients} transfer={manifest.transfer_size} "
        f"test={manifest.test_size}\ntransfer sha256 {manifest.transfer_sha256}\n"
        f"private categories: {', '.join(manifest.world.private_categories)}",
        highlight=False,
    )
    table = Table()
    for column in ("client", "train", "val", "own skills", "top categories (share of train)"):
        table.add_column(column)
    for row in clients:
        top_text = ", ".join(f"{c} {s:.0%}" for c, s in row["top_categories"].items())
        own = ", ".join(row["own"]) or "-"
        table.add_row(str(row["client"]), str(row["train"]), str(row["val"]), own, top_text)
    console.print(table)
    bad = {path: state for path, state in integrity.items() if state != "ok"}
    if bad:
        for path, state in sorted(bad.items()):
            console.print(f"[red]{path}: {state}[/]", highlight=False)
        raise typer.Exit(code=1)
    console.print(f"all {len(integrity)} files match the manifest")


def _check_files(directory: Path, manifest: Manifest) -> dict[str, str]:
    states: dict[str, str] = {}
    for relative, digest in manifest.files:
        path = directory / relative
        if not path.is_file():
            states[relative] = "missing"
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            states[relative] = "modified"
        else:
            states[relative] = "ok"
    return states
