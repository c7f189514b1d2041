"""``peerlm status`` (the federation at a glance, from the CPM) and ``peerlm health``.

``status`` calls the CPM's admin ``GetStats`` over mTLS with an ``admin`` certificate and
shows matchmaking, pairings in flight, the reward summary and one row per agent (last
profile round and time, exchanges, endpoint); with ``--overlay`` and ``--fedwave`` it asks
overlay nodes (``Describe``) and FedWave agents (``DescribeWorkflow``: the workflow's
stages and agents, the agent's stage and the rounds it holds) too. ``--json`` prints the
same as one object.

``health`` asks a process's gRPC health service whether it is ``SERVING``. Without
``--target`` it reads the process's own configuration (``--component`` and ``--config``,
plus the environment, exactly as the process does) and dials its listen port on this host
with the process's own certificate: the container HEALTHCHECK needs no extra settings.
Exit status 0 when serving, 1 when not (or unreachable), 2 for a usage error.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from peerlm.node import NodeContext
    from peerlm.security.credentials import TlsFiles

__all__ = [
    "description_to_dict",
    "health_command",
    "stats_to_dict",
    "status_command",
    "workflow_to_dict",
]

_USAGE_ERROR = 2
_UNHEALTHY = 1


def _fail(message: str, code: int = _USAGE_ERROR) -> NoReturn:
    # Plain, unwrapped: scripts and healthcheck logs read this line.
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


def _tls_files(
    pki_dir: Path | None, name: str, ca_cert: Path | None, cert: Path | None, key: Path | None
) -> TlsFiles:
    from peerlm.security.credentials import TlsFiles

    if pki_dir is not None:
        base = TlsFiles.from_directory(pki_dir, name)
        return TlsFiles(ca_cert or base.ca_cert, cert or base.cert, key or base.key)
    missing = [
        flag
        for flag, value in (("--ca-cert", ca_cert), ("--cert", cert), ("--key", key))
        if value is None
    ]
    if missing:
        _fail(
            f"give --pki-dir, or all of --ca-cert, --cert and --key (missing {', '.join(missing)})"
        )
    assert ca_cert is not None and cert is not None and key is not None
    return TlsFiles(ca_cert, cert, key)


def stats_to_dict(stats: Any, now: float) -> dict[str, Any]:
    """A ``CpmStats`` message as plain JSON-ready data (ages in seconds relative to ``now``)."""
    agents = []
    for a in stats.agents:
        seen = a.last_profile_at.ToDatetime(tzinfo=UTC) if a.HasField("last_profile_at") else None
        agents.append(
            {
                "name": a.name,
                "last_round": a.last_round,
                "last_profile_at": seen.isoformat() if seen else None,
                "last_profile_age_s": round(now - seen.timestamp(), 1) if seen else None,
                "exchanges": a.exchanges,
                "successes": a.successes,
                "peer_endpoint": a.peer_endpoint,
            }
        )
    return {
        "matchmaking_rounds": stats.matchmaking_rounds,
        "profiles_received": stats.profiles_received,
        "directives_issued": stats.directives_issued,
        "pairings_in_flight": stats.directives_open,
        "rewards_observed": stats.rewards_observed,
        "bandit_updates": stats.bandit_updates,
        "reward_mean": stats.reward_mean,
        "reward_std": stats.reward_std,
        "theta_norm": stats.theta_norm,
        "context_dim": stats.context_dim,
        "agents": agents,
    }


def _admin_context(tls: TlsFiles) -> NodeContext:
    """The CLI's node context for admin calls (errors are printed by the command)."""
    from peerlm.node import NodeContext
    from peerlm.pki.identity import Role

    return NodeContext.client(tls, role=Role.ADMIN)


async def _get_stats(target: str, tls: TlsFiles, timeout: float) -> Any:
    from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

    async with _admin_context(tls).dial(target) as peer:
        stub = cpm_pb2_grpc.MatchmakerStub(peer.channel)  # type: ignore[no-untyped-call]
        return await stub.GetStats(cpm_pb2.GetStatsRequest(), timeout=timeout)


def description_to_dict(desc: Any) -> dict[str, Any]:
    """An overlay ``NodeDescription`` as plain JSON-ready data."""
    return {
        "node_id": desc.node_id,
        "address": desc.address,
        "role": desc.role,
        "level": desc.level,
        "epoch": desc.epoch,
        "depth": desc.depth,
        "zone_id": desc.zone_id or None,
        "zone_size": desc.zone_size,
        "cluster_id": desc.cluster_id or None,
        "parent_id": desc.parent_id or None,
        "root_id": desc.root_id or None,
        "children": desc.children_count,
        "tau": desc.tau if desc.HasField("tau") else None,
        "has_signature": desc.has_signature,
        # Untyped facts travel as JSON in `details` (overlay.service.node_description).
        "network_p": _detail(desc, "network_p"),
        "ready": bool(_detail(desc, "ready")),
    }


def _detail(desc: Any, key: str) -> Any:
    try:
        return json.loads(desc.details[key]) if key in desc.details else None
    except ValueError:
        return None


async def _describe_overlay(
    targets: list[str], tls: TlsFiles, timeout: float
) -> list[dict[str, Any]]:
    """``Describe`` every overlay node; an unreachable one is a row with its error, so one
    node down does not hide the others."""
    import grpc

    from peerlm.security.authz import describe_rpc_error
    from peerlm.wire.v1 import overlay_pb2, overlay_pb2_grpc

    ctx = _admin_context(tls)

    async def one(target: str) -> dict[str, Any]:
        async with ctx.dial(target) as peer:
            stub = overlay_pb2_grpc.OverlayStub(peer.channel)  # type: ignore[no-untyped-call]
            try:
                desc = await stub.Describe(overlay_pb2.DescribeRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as err:
                return {"target": target, "error": describe_rpc_error(err)}
            return {"target": target, **description_to_dict(desc)}

    return list(await asyncio.gather(*(one(t) for t in targets)))


def _render_overlay(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="overlay")
    columns = ("node", "role", "level", "epoch", "depth", "zone", "zone size", "cluster",
               "parent", "children", "τ", "P")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for r in rows:
        if "error" in r:
            table.add_row(r["target"], f"[red]{r['error']}[/red]", *["-"] * (len(columns) - 2))
            continue
        table.add_row(
            r["node_id"],
            r["role"],
            str(r["level"]),
            str(r["epoch"]),
            str(r["depth"]),
            r["zone_id"] or "-",
            str(r["zone_size"]),
            r["cluster_id"] or "-",
            r["parent_id"] or "-",
            str(r["children"]),
            "-" if r["tau"] is None else f"{r['tau']:.3f}",
            "-" if r["network_p"] is None else str(r["network_p"]),
        )
    console.print(table)


def workflow_to_dict(desc: Any) -> dict[str, Any]:
    """A FedWave ``WorkflowDescription`` as plain JSON-ready data."""
    return {
        "agent": desc.agent,
        "stage": desc.stage,
        "rounds": list(desc.rounds),
        # None while a restarted agent loads its checkpoint (or from an older release).
        "concluded_round": desc.concluded_round if desc.HasField("concluded_round") else None,
        # None until it has decided the round to play (a restart waits for its workflow).
        "playing_round": desc.playing_round if desc.HasField("playing_round") else None,
        "stages": [{"name": s.name, "agents": list(s.agents)} for s in desc.stages],
    }


async def _describe_fedwave(
    targets: list[str], tls: TlsFiles, timeout: float
) -> list[dict[str, Any]]:
    """``DescribeWorkflow`` of every FedWave agent; an unreachable one is a row with its
    error."""
    import grpc

    from peerlm.security.authz import describe_rpc_error
    from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc

    ctx = _admin_context(tls)

    async def one(target: str) -> dict[str, Any]:
        async with ctx.dial(target) as peer:
            stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
            try:
                desc = await stub.DescribeWorkflow(
                    fedwave_pb2.DescribeWorkflowRequest(), timeout=timeout
                )
            except grpc.aio.AioRpcError as err:
                return {"target": target, "error": describe_rpc_error(err)}
            return {"target": target, **workflow_to_dict(desc)}

    return list(await asyncio.gather(*(one(t) for t in targets)))


def _render_fedwave(rows: list[dict[str, Any]], console: Console) -> None:
    """The workflow (as the first agent that answered sees it), then one row per agent."""
    answered = [r for r in rows if "error" not in r]
    if answered:
        workflow = Table(title="FedWave workflow")
        for column in ("#", "stage", "agents"):
            workflow.add_column(column)
        for index, stage in enumerate(answered[0]["stages"], start=1):
            workflow.add_row(str(index), stage["name"], ", ".join(stage["agents"]))
        console.print(workflow)
    agents = Table(title="FedWave agents")
    for column in ("target", "agent", "stage", "rounds held", "concluded", "playing"):
        agents.add_column(column)
    for r in rows:
        if "error" in r:
            agents.add_row(r["target"], f"[red]{r['error']}[/red]", "-", "-", "-", "-")
            continue
        held = ", ".join(str(x) for x in r["rounds"]) or "none yet"
        concluded, playing = r.get("concluded_round"), r.get("playing_round")
        agents.add_row(
            r["target"],
            r["agent"],
            r["stage"],
            held,
            # Unset: loading its checkpoint (or an agent of an older release).
            "not said" if concluded is None else str(concluded),
            "deciding" if playing is None else str(playing),
        )
    console.print(agents)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _render(target: str, data: dict[str, Any], console: Console) -> None:
    summary = Table(title=f"CPM {target}", show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row("agents known", str(len(data["agents"])))
    summary.add_row("matchmaking rounds", str(data["matchmaking_rounds"]))
    summary.add_row("profiles received", str(data["profiles_received"]))
    summary.add_row("pairings issued", str(data["directives_issued"]))
    summary.add_row("pairings in flight", str(data["pairings_in_flight"]))
    summary.add_row("rewards observed", str(data["rewards_observed"]))
    summary.add_row("reward mean ± std", f"{data['reward_mean']:.4f} ± {data['reward_std']:.4f}")
    summary.add_row("‖θ‖", f"{data['theta_norm']:.3f}")
    console.print(summary)
    agents = Table(title="agents")
    for column in ("agent", "last round", "last profile", "exchanges", "successes", "endpoint"):
        agents.add_column(column, justify="left" if column in ("agent", "endpoint") else "right")
    for a in data["agents"]:
        agents.add_row(
            a["name"],
            str(a["last_round"]),
            _age(a["last_profile_age_s"]),
            str(a["exchanges"]),
            str(a["successes"]),
            a["peer_endpoint"] or "-",
        )
    console.print(agents)


def status_command(
    cpm: Annotated[str | None, typer.Option("--cpm", help="CPM HOST:PORT.")] = None,
    overlay: Annotated[
        list[str] | None,
        typer.Option(
            "--overlay", help="An overlay node's or agent's HOST:PORT (repeatable): its role."
        ),
    ] = None,
    fedwave: Annotated[
        list[str] | None,
        typer.Option(
            "--fedwave",
            help="A FedWave agent's HOST:PORT (repeatable): its workflow, stage and rounds.",
        ),
    ] = None,
    pki_dir: Annotated[
        Path | None,
        typer.Option(help="Directory with ca.crt and <name>.crt/.key (a CA dir or a kit)."),
    ] = None,
    name: Annotated[str, typer.Option(help="Certificate name in --pki-dir.")] = "admin",
    ca_cert: Annotated[Path | None, typer.Option(help="Federation CA certificate.")] = None,
    cert: Annotated[Path | None, typer.Option(help="An admin certificate.")] = None,
    key: Annotated[Path | None, typer.Option(help="Its private key.")] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the federation at a glance (admin mTLS): from the CPM its agents, pairings in
    flight and rewards; from each ``--overlay`` node its role, zone, cluster and place in
    the tree; from each ``--fedwave`` agent its workflow, stage and the rounds it holds.
    Exit 1 when the CPM, every overlay node or every FedWave agent is unreachable."""
    import grpc

    from peerlm.config import parse_host_port
    from peerlm.security.authz import describe_rpc_error

    targets = list(overlay or [])
    workflow_targets = list(fedwave or [])
    if cpm is None and not targets and not workflow_targets:
        _fail("give --cpm HOST:PORT, --overlay HOST:PORT, --fedwave HOST:PORT, or several")
    flagged = (
        [("--overlay", t) for t in targets]
        + [("--fedwave", t) for t in workflow_targets]
        + ([("--cpm", cpm)] if cpm else [])
    )
    for flag, target in flagged:
        try:
            parse_host_port(target)
        except ValueError as err:
            _fail(f"{flag}: {err}")
    tls = _tls_files(pki_dir, name, ca_cert, cert, key)
    try:
        tls.load()
    except (OSError, ValueError) as err:
        _fail(str(err))
    out: dict[str, Any] = {}
    if cpm is not None:
        try:
            stats = asyncio.run(_get_stats(cpm, tls, timeout))
        except grpc.aio.AioRpcError as err:
            _fail(f"CPM {cpm}: {describe_rpc_error(err)}", code=1)
        out = {"cpm": cpm, **stats_to_dict(stats, time.time())}
    rows = asyncio.run(_describe_overlay(targets, tls, timeout)) if targets else []
    if targets:
        out["overlay"] = rows
    wave = (
        asyncio.run(_describe_fedwave(workflow_targets, tls, timeout)) if workflow_targets else []
    )
    if workflow_targets:
        out["fedwave"] = wave
    if as_json:
        typer.echo(json.dumps(out))
    else:
        console = Console()
        if cpm is not None:
            _render(cpm, out, console)
        if rows:
            _render_overlay(rows, console)
        if wave:
            _render_fedwave(wave, console)
    if (rows and all("error" in r for r in rows)) or (wave and all("error" in r for r in wave)):
        raise typer.Exit(code=_UNHEALTHY)


def _component_settings(component: str) -> type[Any]:
    """The settings class of a process by its component name (its ``PEERLM_<NAME>_`` prefix)."""
    from peerlm.agent import AgentSettings
    from peerlm.overlay import OverlaySettings
    from peerlm.services.cpm import CpmSettings

    known: dict[str, type[Any]] = {}
    classes: tuple[type[Any], ...] = (AgentSettings, CpmSettings, OverlaySettings)
    for settings_cls in classes:
        prefix = str(settings_cls.model_config.get("env_prefix") or "")
        known[prefix.removeprefix("PEERLM_").removesuffix("_").lower()] = settings_cls
    found = known.get(component)
    if found is None:
        _fail(f"unknown component {component!r}; choose from {', '.join(sorted(known))}")
    return found


def _local_target(listen: str) -> str:
    from peerlm.config import parse_host_port

    host, port = parse_host_port(listen)
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _ProbeLog:
    """The security decision's log for a health probe: warnings (insecure-dev, a certificate
    near expiry) go to stderr as one line; the mode itself is the process's to log, not
    every probe's."""

    def info(self, event: str, /, **kw: Any) -> None:
        return None

    def warning(self, event: str, /, **kw: Any) -> None:
        typer.echo(f"warning: {event} {kw.get('fix') or ''}".rstrip(), err=True)


class _Silent:
    """A logger for a decision already reported (or not worth reporting) by the CLI."""

    def info(self, event: str, /, **kw: Any) -> None:
        return None

    def warning(self, event: str, /, **kw: Any) -> None:
        return None


async def _check(
    target: str,
    tls: TlsFiles | None,
    service: str,
    timeout: float,
    *,
    component: str,
    federation: str,
) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from peerlm.config import GrpcLimits
    from peerlm.node import NodeContext
    from peerlm.pki.identity import Role
    from peerlm.security.authz import describe_rpc_error

    ctx = NodeContext.create(
        component=f"health {component}",
        role=Role(component),
        federation=federation,
        tls=tls,
        insecure_dev=tls is None,
        limits=GrpcLimits(),
        log=_Silent(),  # health_command has reported the security decision already
        dev_name="healthcheck",
    )
    async with ctx.dial(target) as peer:
        stub = health_pb2_grpc.HealthStub(peer.channel)  # type: ignore[no-untyped-call]
        try:
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                metadata=peer.metadata,
            )
        except grpc.aio.AioRpcError as err:
            return f"unreachable ({describe_rpc_error(err)})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def health_command(
    component: Annotated[
        str, typer.Option(help="Whose configuration to read: cpm, agent, overlay.")
    ] = "cpm",
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="That process's YAML configuration.")
    ] = None,
    target: Annotated[
        str | None, typer.Option(help="HOST:PORT to check (default: the configured listen).")
    ] = None,
    service: Annotated[str, typer.Option(help="Health service name; empty: the server.")] = "",
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait.")] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Exit 0 if a peerlm process answers SERVING on the gRPC health service, else 1."""
    from peerlm.config import ConfigError, load_settings
    from peerlm.security.credentials import tls_files_from_settings
    from peerlm.security.mode import SecurityConfigError, resolve_channel_security

    cls = _component_settings(component)
    if config is not None and not config.is_file():
        _fail(f"config file {config} not found")
    try:
        settings = load_settings(cls, config, {})
        tls = tls_files_from_settings(settings.tls)
        if tls is not None:
            tls.load()
    except (ConfigError, SecurityConfigError, OSError, ValueError) as err:
        _fail(str(err))
    if tls is None and not settings.insecure_dev:
        _fail(f"{component}: no TLS files configured and not --insecure-dev")
    where = target or _local_target(settings.listen)
    try:
        # The one security decision: plaintext (insecure-dev) only to a loopback target.
        resolve_channel_security(
            insecure_dev=settings.insecure_dev,
            target=where,
            tls=tls,
            component=f"health {component}",
            logger=_ProbeLog(),
        )
    except SecurityConfigError as err:
        _fail(str(err))
    started = time.monotonic()
    status = asyncio.run(
        _check(where, tls, service, timeout, component=component, federation=settings.federation)
    )
    ok = status == "SERVING"
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "target": where,
                    "service": service,
                    "status": status,
                    "serving": ok,
                    "seconds": round(time.monotonic() - started, 3),
                    "checked_at": datetime.now(UTC).isoformat(),
                }
            )
        )
    else:
        typer.echo(f"{component} {where}: {status}", err=not ok)
    if not ok:
        raise typer.Exit(code=_UNHEALTHY)
