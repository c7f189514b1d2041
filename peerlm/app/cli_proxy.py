"""``peerlm models compress`` and ``peerlm models fuse``: FedProxy's proxy and its fusion.

``compress`` measures Block Influence (FedProxy Eq. 4) of every transformer block of a
``from_pretrained`` model on public data and saves the proxy made of the most influential
blocks (:mod:`peerlm.agent.fedproxy.compress`, :mod:`peerlm.agent.fedproxy.proxy`). ``fuse``
writes a (trained) proxy back into the model it came from (Section 4.3). Both save a
``from_pretrained`` directory (model and tokenizer), written beside the target and renamed
into place, so a killed run leaves no half-written model. Progress goes to stderr, a table
(or one JSON object with ``--json``) to stdout; bad input exits with status 2 and one line.

The commands are registered on ``peerlm models`` by :mod:`peerlm.app.cli_models`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["compress_command", "fuse_command"]

_USAGE_ERROR = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=_USAGE_ERROR)


def _load(path: Path, what: str) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        _fail(f"{what} {path} is not a model directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        _fail(f"cannot load {what} {path}: {exc}")
    return model, tokenizer


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        _fail(f"--out {out} is not empty (use --force to replace it)")


def _save(model: PreTrainedModel, tokenizer: Any, out: Path) -> None:
    # Written into a sibling and renamed: a reader sees no model or a whole one.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _parameters(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def compress_command(
    model: Annotated[Path, typer.Option("--model", help="The full model (a directory).")],
    public_data: Annotated[
        Path,
        typer.Option(
            "--public-data",
            help="Public problems (JSONL, e.g. a federation's transfer.jsonl); each "
            "problem's prompt + reference is one text.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Where the proxy is saved.")],
    ratio: Annotated[
        float,
        typer.Option(
            "--ratio",
            help="Compression ratio κ: the share of blocks removed, in [0, 1) "
            "(floor(κ·L) removed; Table 8 default 0.5).",
        ),
    ] = 0.5,
    max_texts: Annotated[
        int, typer.Option("--max-texts", min=1, help="Texts read from the public data.")
    ] = 128,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens per text (truncated).")
    ] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Texts per pass.")] = 8,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Compress a model to a FedProxy proxy by Block Influence on public data (Eq. 4)."""
    from peerlm.agent import (
        ProxyError,
        block_influence,
        blocks_to_keep,
        build_proxy,
        kept_count,
        read_jsonl,
        token_batches,
    )
    from peerlm.app.cli_models import quiet_transformers

    quiet_transformers()
    started = time.perf_counter()
    _prepare_out(out, force)
    try:
        problems = read_jsonl(public_data)
    except (OSError, ValueError) as exc:
        _fail(f"cannot read --public-data: {exc}")
    texts = [p.prompt + p.reference for p in problems[:max_texts]]
    full, tokenizer = _load(model, "--model")
    try:
        kept_count(int(full.config.num_hidden_layers), ratio)  # refuse a bad ratio early
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = [tokenizer(t, truncation=True, max_length=max_tokens)["input_ids"] for t in texts]
        batches = token_batches(rows, batch_size=batch_size, pad_id=int(pad))
        if not batches:
            _fail(f"--public-data {public_data} holds no text")
        err = Console(stderr=True)
        with Progress(
            TextColumn("block influence"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            disable=not err.is_terminal,
        ) as bar:
            task = bar.add_task("bi", total=len(batches))
            tenth = [0]

            def progress(done: int) -> None:
                bar.update(task, completed=done)
                mark = 10 * done // len(batches)
                if not err.is_terminal and mark > tenth[0]:
                    tenth[0] = mark
                    err.print(f"block influence: batch {done}/{len(batches)}")

            influence = block_influence(full, batches, progress=progress)
        kept = blocks_to_keep(influence, ratio)
        proxy = build_proxy(full, kept, ratio=ratio, influence=influence)
    except ProxyError as exc:
        _fail(str(exc))
    _save(proxy, tokenizer, out)
    tokens = sum(int(mask.sum()) for _, mask in batches)
    payload: dict[str, Any] = {
        "model": str(model),
        "out": str(out),
        "ratio": ratio,
        "layers": len(influence),
        "kept_blocks": list(kept),
        "block_influence": [round(v, 6) for v in influence],
        "texts": len(rows),
        "tokens": tokens,
        "parameters": {"model": _parameters(full), "proxy": _parameters(proxy)},
        "seconds": round(time.perf_counter() - started, 3),
    }
    if as_json:
        typer.echo(json.dumps(payload))
        return
    table = Table(title=f"{out}: {len(kept)} of {len(influence)} blocks ({tokens:,} tokens)")
    table.add_column("block", justify="right")
    table.add_column("BI", justify="right")
    table.add_column("kept")
    for i, value in enumerate(influence):
        table.add_row(str(i), f"{value:.4f}", "yes" if i in kept else "")
    Console().print(table)
    Console().print(
        f"parameters {payload['parameters']['model']:,} -> {payload['parameters']['proxy']:,}"
    )


def fuse_command(
    base: Annotated[Path, typer.Option("--base", help="The full model the proxy came from.")],
    proxy: Annotated[Path, typer.Option("--proxy", help="The (trained) proxy.")],
    out: Annotated[Path, typer.Option("--out", help="Where the fused model is saved.")],
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Write a proxy's layers back into its full model (FedProxy Section 4.3)."""
    from peerlm.agent import ProxyError, fuse_into, proxy_info
    from peerlm.app.cli_models import quiet_transformers

    quiet_transformers()
    started = time.perf_counter()
    _prepare_out(out, force)
    full, tokenizer = _load(base, "--base")
    small, _ = _load(proxy, "--proxy")
    try:
        info = proxy_info(small)
        changed = fuse_into(full, small)
    except ProxyError as exc:
        _fail(str(exc))
    assert info is not None  # fuse_into refuses a model that is not a proxy
    _save(full, tokenizer, out)
    payload = {
        "base": str(base),
        "proxy": str(proxy),
        "out": str(out),
        "blocks_written": list(info.kept_blocks),
        "changed_tensors": list(changed),
        "seconds": round(time.perf_counter() - started, 3),
    }
    if as_json:
        typer.echo(json.dumps(payload))
        return
    Console().print(
        f"{out}: blocks {list(info.kept_blocks)} of {info.source_layers} written from the "
        f"proxy; {len(changed)} tensors changed"
    )
