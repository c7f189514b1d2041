"""``peerlm bench ...``: benchmarks (typer sub-app; mounted by :mod:`peerlm.app.cli`).

``peerlm bench cpm`` runs the CPM matchmaking benchmark on the synthetic federation
(:mod:`peerlm.bench.cpm`); ``peerlm bench overlay`` the semantic overlay in the
simulator (:mod:`peerlm.bench.overlay`); ``peerlm bench transfer`` adapter pulls beside a raw
TLS socket and plain gRPC streaming (:mod:`peerlm.bench.transfer`); ``peerlm bench lora-merge``
OnePeFT's SVD aggregation beside peft's merge (:mod:`peerlm.bench.lora_merge`); ``peerlm bench
fedproxy`` H-TIES against FedAvg of proxies on a tiny model (:mod:`peerlm.bench.fedproxy`);
``peerlm bench cpm-replay`` the CPM on an experiment's measured pair gains
(:mod:`peerlm.bench.cpm_replay`); ``peerlm bench agent-start`` N agents started as new
interpreters beside forks of one warm fork server (:mod:`peerlm.bench.agent_start`).
All: progress on stderr, rich tables (or one JSON object with ``--json``) on stdout, optional
PNG plots with ``--plots DIR`` (cpm, overlay).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = [
    "agent_start_command",
    "app",
    "cpm_ack_command",
    "cpm_command",
    "overlay_command",
    "parse_sizes",
    "require_extra",
    "transfer_command",
]

app = typer.Typer(help="Benchmarks.", no_args_is_help=True, add_completion=False)


@app.callback()
def _bench() -> None:
    """Benchmarks (tables on stdout, progress on stderr)."""


def require_extra(needs: dict[str, str], command: str) -> None:
    """Exit with status 2 before any work when a module of the ``bench`` extra that this run
    needs is missing (``needs``: module -> what it is for)."""
    missing = []
    for module, purpose in needs.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} ({purpose})")
    if missing:
        typer.echo(
            f"error: {command} needs the `bench` extra, missing: {', '.join(missing)}; "
            "install it with `pip install 'peerlm[bench]'`",
            err=True,
        )
        raise typer.Exit(code=2)


def _run_and_report(
    title: str,
    run: Callable[[Callable[[str, int, int], None]], dict[str, Any]],
    write_plots: Callable[[dict[str, Any], Path], list[Path]],
    render: Callable[[dict[str, Any], Console], None],
    plots: Path | None,
    as_json: bool,
    json_options: dict[str, Any],
) -> None:
    """Run a benchmark with a progress bar on stderr, then plots, then JSON or tables."""
    err = Console(stderr=True)
    with Progress(
        TextColumn(f"[bold]{title}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def on_progress(label: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=label)

        report = run(on_progress)
    if plots is not None:
        written = write_plots(report, plots)
        report["plots"] = [str(p) for p in written]
        err.print(f"wrote {len(written)} plot(s) to {plots}")
    if as_json:
        typer.echo(json.dumps(report, **json_options))
    else:
        render(report, Console())


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` -> ``(8, 16, 32)``; raises ``typer.BadParameter`` on bad input."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 2 for n in sizes):
        raise typer.BadParameter("every federation size must be >= 2")
    return sizes


@app.command("cpm")
def cpm_command(
    quick: Annotated[bool, typer.Option("--quick", help="Small settings (seconds).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    seeds: Annotated[int | None, typer.Option(min=1, help="Seeds per setting.")] = None,
    rounds: Annotated[int | None, typer.Option(min=2, help="Rounds per run.")] = None,
    sizes: Annotated[
        str | None, typer.Option(help="Federation sizes, comma-separated (e.g. 8,16,32,64).")
    ] = None,
    plots: Annotated[
        Path | None, typer.Option(help="Write PNG learning and regret curves to DIR.")
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Worker processes for the runs (default: up to 2 cores)."),
    ] = None,
    no_speed: Annotated[
        bool, typer.Option("--no-speed", help="Skip the select/observe speed section.")
    ] = False,
    speed_sizes: Annotated[
        str | None,
        typer.Option(help="N for the one-thread select() scaling figures (e.g. 1000,5000,10000)."),
    ] = None,
) -> None:
    """Matchmakers (LinUCB variants, Random, Hetero-Greedy, Oracle) on a synthetic federation."""
    if plots is not None:
        require_extra({"matplotlib": "--plots"}, "bench cpm")
    from peerlm.bench.cpm import (
        BenchParams,
        params_with,
        render_report,
        run_benchmark,
        write_plots,
    )

    params = BenchParams.quick() if quick else BenchParams()
    params = params_with(
        params,
        seeds=seeds,
        rounds=rounds,
        sizes=parse_sizes(sizes) if sizes is not None else None,
        jobs=jobs if jobs is not None else min(2, os.cpu_count() or 1),
        speed=False if no_speed else None,
        speed_scaling_sizes=parse_sizes(speed_sizes) if speed_sizes is not None else None,
    )
    _run_and_report(
        "bench cpm", lambda progress: run_benchmark(params, progress), write_plots,
        render_report, plots, as_json, {},
    )  # fmt: skip


@app.command("cpm-ack")
def cpm_ack_command(
    quick: Annotated[bool, typer.Option("--quick", help="Small settings (seconds).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    clients: Annotated[
        str, typer.Option(help="Concurrent clients per level, comma-separated.")
    ] = "1,10,50",
    rewards_per_client: Annotated[
        int, typer.Option(min=1, help="Rewards per client (at least --min-rewards per level).")
    ] = 40,
    min_rewards: Annotated[int, typer.Option(min=1, help="Rewards per level, at least.")] = 400,
    workdir: Annotated[
        Path | None, typer.Option(help="Where the databases go (default: the temp dir).")
    ] = None,
) -> None:
    """Durably acknowledged rewards/s against a real CPM, beside SQLite's group-commit rate."""
    from peerlm.bench.cpm_ack import AckParams, render_report, run_benchmark

    try:
        levels = tuple(int(part) for part in clients.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected integers, got {clients!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise typer.BadParameter("every client count must be >= 1", param_hint="--clients")
    params = (
        AckParams.quick()
        if quick
        else AckParams(levels, rewards_per_client, min_rewards, workdir=workdir)
    )
    _run_and_report(
        "bench cpm-ack", lambda progress: run_benchmark(params, progress),
        lambda _report, _dir: [], render_report, None, as_json, {},
    )  # fmt: skip


@app.command("overlay")
def overlay_command(
    peers: Annotated[
        str, typer.Option(help="Network sizes N, comma-separated (e.g. 100,400,1000).")
    ] = "1000",
    k: Annotated[str, typer.Option("--k", help="K: absolute (25) or a share of N (10%).")] = "10%",
    zone_cap: Annotated[
        str, typer.Option(help="S_Z: absolute (20) or a share of N (the paper's 5%).")
    ] = "5%",
    churn: Annotated[
        float, typer.Option(min=0.0, max=0.9, help="Share of peers replaced per round.")
    ] = 0.0,
    loss: Annotated[
        float, typer.Option(min=0.0, max=0.5, help="Probability that a message is lost.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of population, network and keys.")] = 0,
    rounds: Annotated[int, typer.Option(min=1, help="Query rounds per size.")] = 3,
    queries: Annotated[
        int | None, typer.Option(min=1, help="Queriers per round (default: every peer).")
    ] = None,
    no_hnsw: Annotated[
        bool, typer.Option("--no-hnsw", help="Skip the centralised HNSW reference.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    plots: Annotated[
        Path | None, typer.Option(help="Write PNG plots (recall, comparisons, build) to DIR.")
    ] = None,
) -> None:
    """Semantic overlay (SemanticDFL) in the simulator: Recall@K vs exact and HNSW, cost."""
    needs = {"usearch": "the HNSW reference; or pass --no-hnsw"} if not no_hnsw else {}
    if plots is not None:
        needs["matplotlib"] = "--plots"
    require_extra(needs, "bench overlay")
    from peerlm.bench.overlay import BenchConfig, parse_k, render_report, run_benchmark, write_plots
    from peerlm.overlay import LinkModel

    sizes = parse_sizes(peers)
    for value, hint in ((k, "--k"), (zone_cap, "--zone-cap")):
        try:
            parse_k(value)
        except ValueError as bad:
            raise typer.BadParameter(str(bad), param_hint=hint) from None
    cfg = BenchConfig(
        peers=sizes,
        k=k,
        zone_cap=zone_cap,
        churn=churn,
        seed=seed,
        rounds=rounds,
        queries=queries,
        hnsw=not no_hnsw,
        links=LinkModel(loss=loss),
    )
    _run_and_report(
        "bench overlay", lambda progress: run_benchmark(cfg, progress), write_plots,
        render_report, plots, as_json, {"default": str, "allow_nan": False},
    )  # fmt: skip


@app.command("transfer")
def transfer_command(
    sizes: Annotated[str, typer.Option(help="Payload sizes in MiB, comma-separated.")] = "16,64",
    repeats: Annotated[int, typer.Option(min=1, help="Pulls per size and method.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Adapter pulls (peer service, sender proof, checksum) beside raw TLS and plain gRPC."""
    from peerlm.bench.transfer import TransferConfig, render_report, run_benchmark

    try:
        mib = tuple(int(part) for part in sizes.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {sizes!r}") from None
    if not mib or any(n < 1 or n > 1024 for n in mib):
        raise typer.BadParameter("every size must be 1..1024 MiB", param_hint="--sizes")
    cfg = TransferConfig(sizes_mib=mib, repeats=repeats)
    _run_and_report(
        "bench transfer", lambda progress: run_benchmark(cfg, progress), lambda r, p: [],
        render_report, None, as_json, {},
    )  # fmt: skip


@app.command("lora-merge")
def lora_merge_command(
    modules: Annotated[int, typer.Option(min=1, help="Adapted layers.")] = 8,
    dim: Annotated[int, typer.Option(min=2, help="Each layer is dim x dim.")] = 1024,
    ranks: Annotated[str, typer.Option(help="Client LoRA ranks, comma-separated.")] = "8,8,16,4",
    target_rank: Annotated[int, typer.Option(min=1, help="Rank of the aggregate.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Timed merges per method.")] = 3,
    threads: Annotated[int, typer.Option(min=1, help="torch threads for both.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """OnePeFT's SVD aggregation beside peft's add_weighted_adapter(svd): ΔW and time."""
    from peerlm.bench.lora_merge import MergeBenchConfig, render_report, run_benchmark

    try:
        rs = tuple(int(part) for part in ranks.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {ranks!r}") from None
    if not rs or any(r < 1 for r in rs):
        raise typer.BadParameter("every rank must be a positive integer", param_hint="--ranks")
    # alpha = 2 r per client (the agent's default ratio); data sizes 100, 200, ... so the
    # weights are unequal.
    cfg = MergeBenchConfig(
        modules=modules, dim_in=dim, dim_out=dim, ranks=rs,
        alphas=tuple(2.0 * r for r in rs), examples=tuple(100 * (i + 1) for i in range(len(rs))),
        target_rank=target_rank, repeats=repeats, threads=threads,
    )  # fmt: skip
    _run_and_report(
        "bench lora-merge", lambda progress: run_benchmark(cfg, progress), lambda r, p: [],
        render_report, None, as_json, {},
    )  # fmt: skip


@app.command("fedproxy")
def fedproxy_command(
    arch: Annotated[str, typer.Option(help="Tiny model architecture.")] = "gpt2",
    ratio: Annotated[
        float, typer.Option(help="Compression ratio (share of blocks removed).")
    ] = 0.5,
    clients: Annotated[int, typer.Option(min=2, help="Cohort size.")] = 4,
    rounds: Annotated[int, typer.Option(min=1, help="Aggregation rounds.")] = 3,
    local_steps: Annotated[int, typer.Option(min=1, help="Client steps per round.")] = 12,
    lr: Annotated[float, typer.Option(help="Client learning rate (AdamW).")] = 1e-3,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0",
    methods: Annotated[
        str, typer.Option(help="Comma-separated: fedavg, ties, h_ties, h_ties_pcr.")
    ] = "fedavg,ties,h_ties,h_ties_pcr",
    threads: Annotated[int, typer.Option(min=1, help="torch threads.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """FedProxy on a tiny model: H-TIES against FedAvg of proxies (reference NLL)."""
    from peerlm.bench.fedproxy import METHODS, FedProxyBenchConfig, render_report, run_benchmark

    # The library's per-load progress bars would interleave with the benchmark's own.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    try:
        seed_list = tuple(int(part) for part in seeds.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {seeds!r}") from None
    chosen = tuple(m for m in methods.split(",") if m.strip())
    if "fedavg" not in chosen or any(m not in METHODS for m in chosen) or not seed_list:
        raise typer.BadParameter(
            f"methods must include fedavg and be among {', '.join(METHODS)}; seeds non-empty"
        )
    cfg = FedProxyBenchConfig(
        arch=arch, ratio=ratio, clients=clients, rounds=rounds, local_steps=local_steps,
        lr=lr, seeds=seed_list, methods=chosen, threads=threads,
    )  # fmt: skip
    _run_and_report(
        "bench fedproxy", lambda progress: run_benchmark(cfg, progress), lambda r, p: [],
        render_report, None, as_json, {},
    )  # fmt: skip


@app.command("cpm-replay")
def cpm_replay_command(
    results: Annotated[
        Path, typer.Argument(help="results.json of a run-experiment run with oracle in it.")
    ],
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--setting",
            help="COLUMNS/interaction|plain/BETA/greedy|blossom (repeatable); default: a grid.",
        ),
    ] = None,
    bandit_seeds: Annotated[int, typer.Option(min=1, help="Bandit seeds per setting.")] = 24,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """The CPM replayed on an experiment's measured pair gains (settings compared)."""
    from peerlm.bench.cpm_replay import ReplaySetting, default_settings, render_report, replay

    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{results}: {exc}") from None
    chosen = default_settings()
    if settings:
        chosen = []
        for text in settings:
            parts = text.split("/")
            if (
                len(parts) != 4
                or parts[1] not in ("interaction", "plain")
                or parts[3] not in ("greedy", "blossom")
            ):
                raise typer.BadParameter(f"--setting {text!r}: COLUMNS/KIND/BETA/MATCHING")
            try:
                beta = float(parts[2])
            except ValueError:
                raise typer.BadParameter(f"--setting {text!r}: beta is not a number") from None
            chosen.append(ReplaySetting(parts[0], parts[1] == "interaction", beta, parts[3]))  # type: ignore[arg-type]
    try:
        _run_and_report(
            "bench cpm-replay",
            lambda progress: replay(data, chosen, bandit_seeds=bandit_seeds, progress=progress),
            lambda r, p: [],
            render_report,
            None,
            as_json,
            {},
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command("cpm-group-arm")
def cpm_group_arm_command(
    seeds: Annotated[int, typer.Option(min=1, help="Bandit seeds per scoring.")] = 10,
    rounds: Annotated[int, typer.Option(min=2, help="Matchmaking rounds per run.")] = 60,
    merge_senders: Annotated[
        int, typer.Option(min=2, max=16, help="Senders per merge directive.")
    ] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Pair vs group co-sender scoring on a synthetic federation (seconds)."""
    from peerlm.bench.cpm_group_arm import compare, render_report

    _run_and_report(
        "bench cpm-group-arm",
        lambda progress: compare(
            seeds=seeds, rounds=rounds, progress=progress, merge_senders=merge_senders
        ),
        lambda r, p: [],
        render_report,
        None,
        as_json,
        {},
    )


@app.command("experiment-round")
def experiment_round_command(
    micro: Annotated[bool, typer.Option("--micro", help="Micro models (seconds).")] = False,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds timed per plan.")] = 2,
    cores: Annotated[int, typer.Option(min=1, help="Cores the projection assumes.")] = 2,
    models_dir: Annotated[
        Path | None, typer.Option(help="Model cache (default: run-experiment's).")
    ] = None,
    work_dir: Annotated[Path, typer.Option(help="Scratch folder for the worlds.")] = Path(
        "state/bench-experiment-round"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Seconds per client-round of run-experiment, before and after, phase by phase."""
    import torch
    from peerlm.bench.experiment_round import render_report, run_benchmark

    torch.set_num_threads(1)
    _run_and_report(
        "bench experiment-round",
        lambda progress: run_benchmark(
            models_dir, work_dir, micro=micro, rounds=rounds, cores=cores, progress=progress
        ),
        lambda r, p: [], render_report, None, as_json, {},
    )  # fmt: skip


@app.command("agent-start")
def agent_start_command(
    agents: Annotated[int, typer.Option(min=1, max=64, help="Agents started at once.")] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="Starts per mode.")] = 3,
    preload: Annotated[
        str | None,
        typer.Option(help="Modules each command imports, comma-separated (default: an agent's)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Starting N agents: new interpreters beside forks of one warm fork server."""
    from peerlm.bench.agent_start import render_report, run_benchmark

    modules = None if preload is None else tuple(m for m in preload.split(",") if m.strip())
    _run_and_report(
        "bench agent-start",
        lambda progress: run_benchmark(agents, repeats, progress, modules),
        lambda r, p: [], render_report, None, as_json, {},
    )  # fmt: skip
