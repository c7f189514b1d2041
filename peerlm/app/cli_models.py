"""``peerlm models ...``: build and list the locally built tiny models (typer sub-app).

``peerlm models build`` trains a byte-level BPE tokenizer and pre-trains a small model for
each architecture (GPT-2, GPT-NeoX, BLOOM, Qwen2) on the Python standard library, saving
each as a ``from_pretrained`` directory (:mod:`peerlm.agent.models.tiny`). Progress goes to
stderr, a summary table (or one JSON object with ``--json``) to stdout. Cached directories
whose manifest matches the request are reused.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

if TYPE_CHECKING:
    from peerlm.agent import BuildEvent, ModelInfo

__all__ = [
    "MODELS_DIR_ENV",
    "app",
    "build_command",
    "list_command",
    "models_cache_dir",
    "quiet_transformers",
]

app = typer.Typer(help="Locally built tiny models.", no_args_is_help=True, add_completion=False)

DEFAULT_DIR = Path("state/models")
#: Overrides :data:`DEFAULT_DIR` for every command that builds or loads tiny models.
MODELS_DIR_ENV = "PEERLM_MODELS_DIR"


def models_cache_dir(size: str = "tiny") -> Path:
    """The one model cache ``peerlm up``, ``run-experiment`` and ``models build`` share.

    ``$PEERLM_MODELS_DIR`` or ``state/models`` for tiny models, the same with ``-micro``
    appended for micro ones (the two sizes never overwrite each other). Builds are keyed by
    a configuration hash, so sharing is safe: a directory built differently is rebuilt.
    """
    base = Path(os.environ.get(MODELS_DIR_ENV) or DEFAULT_DIR)
    return base if size == "tiny" else base.with_name(base.name + "-micro")


@app.callback()
def _models() -> None:
    """Build and inspect the tiny models agents load with from_pretrained."""


def quiet_transformers() -> None:
    # A CLI process owns its logging: the library's per-file tqdm bars and info notices
    # would interleave with the rich progress display. Not imported yet, transformers reads
    # both settings from the environment when it is (a cached build never imports it).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def _table(infos: list[ModelInfo], title: str) -> Table:
    table = Table(title=title)
    table.add_column("arch")
    for name in ("params", "vocab", "shape", "steps", "loss", "seconds"):
        table.add_column(name, justify="right")
    table.add_column("cached")
    for info in infos:
        table.add_row(
            info.arch,
            f"{info.parameters:,}",
            f"{info.vocab_size:,}",
            f"{info.hidden_size}x{info.layers}",
            str(info.steps),
            "-" if info.final_loss is None else f"{info.final_loss:.3f}",
            f"{info.build_seconds:.1f}",
            "yes" if info.cached else "no",
        )
    return table


def build_with_progress(
    directory: Path,
    archs: Sequence[str],
    size: Literal["tiny", "micro"],
    err: Console,
    *,
    steps: int | None = None,
    seed: int = 0,
    force: bool = False,
    jobs: int | None = None,
    threads: int | None = None,
    hidden: Sequence[str] | None = None,
) -> list[ModelInfo]:
    """:func:`build_models` with one progress bar per architecture on ``err``.

    Off a terminal (a pipe, a log file) it prints one line per phase and per tenth of the
    pre-training instead, so a long build is never silent.
    """
    from peerlm.agent import DEFAULT_HIDDEN, build_models

    quiet_transformers()
    with Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        disable=not err.is_terminal,
    ) as bar:
        tasks: dict[str, TaskID] = {
            a: bar.add_task(a, total=None, status="waiting") for a in dict.fromkeys(archs)
        }

        tenth: dict[str, int] = {}

        def log_line(event: BuildEvent) -> None:
            if event.phase == "pretrain":
                mark = 10 * event.step // max(1, event.total)
                if event.step and mark > tenth.get(event.arch, 0):
                    tenth[event.arch] = mark
                    loss = "" if event.loss is None else f" loss {event.loss:.3f}"
                    err.print(f"model {event.arch}: step {event.step}/{event.total}{loss}")
                return
            err.print(f"model {event.arch}: {event.phase}")

        def on_event(event: BuildEvent) -> None:
            if not err.is_terminal:
                log_line(event)
                return
            task = tasks[event.arch]
            if event.phase == "pretrain":
                loss = "" if event.loss is None else f"loss {event.loss:.3f}"
                bar.update(task, total=max(event.total, 1), completed=event.step, status=loss)
            elif event.finished:
                bar.update(
                    task,
                    total=max(event.total, 1),
                    completed=max(event.total, 1),
                    status=event.phase,
                )
            else:
                bar.update(task, status=event.phase)

        return build_models(
            directory,
            tuple(archs),
            size=size,
            pretrain_steps=steps,
            seed=seed,
            force=force,
            progress=on_event,
            jobs=jobs,
            threads=threads,
            hidden=DEFAULT_HIDDEN if hidden is None else hidden,
        )


@app.command("build")
def build_command(
    directory: Annotated[
        Path, typer.Option("--dir", help="Output folder; one sub-folder per architecture.")
    ] = DEFAULT_DIR,
    arch: Annotated[
        list[str] | None,
        typer.Option("--arch", help="Architecture (repeatable): gpt2, gpt_neox, bloom, qwen2."),
    ] = None,
    size: Annotated[
        str, typer.Option(help="tiny (1-2 M parameters) or micro (tests, < 100 k).")
    ] = "tiny",
    steps: Annotated[
        int | None, typer.Option(min=0, help="Pre-training steps (default: tiny 1000, micro 4).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of weights and batches.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if cached.")] = False,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="torch threads per build (default: cores / builds)."),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Builds side by side (default: one per core)."),
    ] = None,
    hidden: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated categories left out of pre-training (default: the default "
            "world's private ones; '' for none)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Build tokenizers and models (cached: an up-to-date directory is left alone)."""
    from peerlm.agent import ARCHITECTURES

    if size not in ("tiny", "micro"):
        raise typer.BadParameter("size must be tiny or micro", param_hint="--size")
    archs = tuple(arch) if arch else ARCHITECTURES
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown:
        raise typer.BadParameter(
            f"unknown architecture(s) {', '.join(unknown)}; choose from {', '.join(ARCHITECTURES)}",
            param_hint="--arch",
        )
    quiet_transformers()
    err = Console(stderr=True)
    started = time.perf_counter()
    chosen: Literal["tiny", "micro"] = "tiny" if size == "tiny" else "micro"
    hidden_list = None if hidden is None else tuple(c for c in hidden.split(",") if c)
    if hidden_list is not None:
        from peerlm.agent import CATEGORIES

        bad = [c for c in hidden_list if c not in CATEGORIES]
        if bad:
            raise typer.BadParameter(
                f"unknown categories {', '.join(bad)}; choose from {', '.join(CATEGORIES)}",
                param_hint="--hidden",
            )
    infos = build_with_progress(
        directory,
        archs,
        chosen,
        err,
        steps=steps,
        seed=seed,
        force=force,
        jobs=jobs,
        threads=threads,
        hidden=hidden_list,
    )
    seconds = time.perf_counter() - started
    if as_json:
        payload: dict[str, Any] = {
            "dir": str(directory),
            "size": size,
            "seconds": round(seconds, 3),
            "models": [info.to_dict() for info in infos],
        }
        typer.echo(json.dumps(payload))
    else:
        Console().print(_table(infos, f"{directory} ({size}, {seconds:.1f} s)"))


@app.command("list")
def list_command(
    directory: Annotated[Path, typer.Option("--dir", help="Models folder.")] = DEFAULT_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """List the built models under a folder (from their manifests)."""
    from peerlm.agent import read_models_manifest as read_manifest

    infos = []
    if directory.is_dir():
        for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
            info = read_manifest(sub)
            if info is not None:
                infos.append(info)
    if as_json:
        typer.echo(json.dumps({"dir": str(directory), "models": [i.to_dict() for i in infos]}))
    else:
        Console().print(_table(infos, str(directory)))


# FedProxy's compress and fuse live in their own module; they are `peerlm models` commands.
from peerlm.app.cli_proxy import compress_command, fuse_command  # noqa: E402

app.command("compress")(compress_command)
app.command("fuse")(fuse_command)
