"""The ``peerlm`` command line (typer + rich)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from peerlm import __version__
from peerlm.agent import AgentSettings
from peerlm.config import ConfigError, load_settings
from peerlm.overlay import OverlaySettings

__all__ = ["app", "main"]

app = typer.Typer(
    name="peerlm",
    help="Federated fine-tuning of language models by orchestrated peer-to-peer exchange.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")

#: The processes whose settings ``config show`` prints. The CPM's settings class is imported
#: on use only: its package brings the matchmaking library (scikit-learn, SciPy, pandas),
#: seconds of start-up that every other ``peerlm`` process (agents, overlay nodes) would pay.
_COMPONENTS = ("cpm", "agent", "overlay")


def _settings_class(component: str) -> type[Any] | None:
    """The settings class of ``component`` (None if unknown)."""
    if component == "cpm":
        from peerlm.services.cpm import CpmSettings

        return CpmSettings
    return {"agent": AgentSettings, "overlay": OverlaySettings}.get(component)


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"peerlm {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """peerlm: CPM matchmaking, agents and the semantic overlay."""


ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML configuration file.", exists=True)
]


@app.command()
def cpm(
    config: ConfigOpt = None,
    listen: Annotated[str | None, typer.Option(help="HOST:PORT to listen on.")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="Federation CA certificate.")] = None,
    cert: Annotated[Path | None, typer.Option(help="This CPM's certificate.")] = None,
    key: Annotated[Path | None, typer.Option(help="This CPM's private key.")] = None,
    db: Annotated[Path | None, typer.Option(help="SQLite state file.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port.")] = None,
    federation: Annotated[str | None, typer.Option(help="Federation name.")] = None,
    insecure_dev: Annotated[
        bool | None,
        typer.Option(
            "--insecure-dev",
            help="Plaintext, loopback only, for development. Never in production.",
        ),
    ] = None,
    log_format: Annotated[str | None, typer.Option(help="auto, json or console.")] = None,
    port_file: Annotated[
        Path | None, typer.Option(help="Write the bound port here once serving (for --listen :0).")
    ] = None,
    init: Annotated[
        bool | None,
        typer.Option(
            "--init",
            help="Create a new federation database if --db holds none (refused otherwise).",
        ),
    ] = None,
    init_only: Annotated[
        bool,
        typer.Option("--init-only", help="With --init: create the database, then exit."),
    ] = False,
) -> None:
    """Run the Central Profiler/Matchmaker service."""
    # The bandit's matrices are small (d ~ 132): multi-threaded BLAS only adds contention
    # (select() at N=1000 measured 24 ms pinned vs 45-200 ms unpinned under load). Must be
    # set before numpy is first imported, which the imports below do.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from peerlm.security.mode import SecurityConfigError
    from peerlm.services.cpm import CpmSettings, run_cpm

    overrides = {
        "listen": listen,
        "tls.ca_cert": ca_cert,
        "tls.cert": cert,
        "tls.key": key,
        "db": db,
        "metrics_port": metrics_port,
        "federation": federation,
        "insecure_dev": insecure_dev,
        "log_format": log_format,
        "init": init,
    }
    try:
        settings = load_settings(CpmSettings, config, overrides)
        if init_only:
            from peerlm.services.cpm import open_database

            typer.echo(open_database(settings))
            return
        run_cpm(settings, port_file=port_file)
    except (ConfigError, SecurityConfigError, ValueError, OSError) as exc:
        raise _fail(str(exc)) from None


@app.command()
def agent(
    config: ConfigOpt = None,
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT of the peer-exchange server.")
    ] = None,
    cpm_target: Annotated[str | None, typer.Option("--cpm", help="CPM HOST:PORT.")] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="Federation CA certificate.")] = None,
    cert: Annotated[Path | None, typer.Option(help="This agent's certificate.")] = None,
    key: Annotated[Path | None, typer.Option(help="This agent's private key.")] = None,
    model: Annotated[str | None, typer.Option(help="Model path or name (from_pretrained).")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Checkpoints and state.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds to play (0: forever).")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port.")] = None,
    insecure_dev: Annotated[
        bool | None, typer.Option("--insecure-dev", help="Plaintext, loopback only.")
    ] = None,
    log_format: Annotated[str | None, typer.Option(help="auto, json or console.")] = None,
) -> None:
    """Run an agent: host a LoRA-tuned model, train, exchange knowledge with peers."""
    from peerlm.agent import run_agent
    from peerlm.security.mode import SecurityConfigError

    overrides = {
        "listen": listen,
        "cpm": cpm_target,
        "tls.ca_cert": ca_cert,
        "tls.cert": cert,
        "tls.key": key,
        "model": model,
        "state_dir": state_dir,
        "rounds": rounds,
        "metrics_port": metrics_port,
        "insecure_dev": insecure_dev,
        "log_format": log_format,
    }
    try:
        settings = load_settings(AgentSettings, config, overrides)
        code = run_agent(settings)
    except (ConfigError, SecurityConfigError, ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code=code)


@app.command("overlay-node")
def overlay_node(
    config: ConfigOpt = None,
    listen: Annotated[str | None, typer.Option(help="HOST:PORT to listen on.")] = None,
    advertise: Annotated[
        str | None, typer.Option(help="HOST:PORT other nodes dial (default: the bound one).")
    ] = None,
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(help="[NAME@]HOST:PORT of a node to enter through (repeatable)."),
    ] = None,
    ca_cert: Annotated[Path | None, typer.Option(help="Federation CA certificate.")] = None,
    cert: Annotated[Path | None, typer.Option(help="This node's certificate.")] = None,
    key: Annotated[Path | None, typer.Option(help="This node's private key.")] = None,
    vrf_key: Annotated[
        Path | None, typer.Option(help="VRF secret key (default: <cert stem>.vrf.key).")
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port.")] = None,
    federation: Annotated[str | None, typer.Option(help="Federation name.")] = None,
    insecure_dev: Annotated[
        bool | None, typer.Option("--insecure-dev", help="Plaintext, loopback only.")
    ] = None,
    log_format: Annotated[str | None, typer.Option(help="auto, json or console.")] = None,
    port_file: Annotated[
        Path | None, typer.Option(help="Write the bound port here once serving (for --listen :0).")
    ] = None,
) -> None:
    """Run a dedicated semantic-overlay node (a super-peer host without a model)."""
    from peerlm.overlay import run_overlay
    from peerlm.security.mode import SecurityConfigError

    overrides = {
        "listen": listen,
        "advertise": advertise,
        "bootstrap": tuple(bootstrap) if bootstrap else None,
        "tls.ca_cert": ca_cert,
        "tls.cert": cert,
        "tls.key": key,
        "vrf_key": vrf_key,
        "metrics_port": metrics_port,
        "federation": federation,
        "insecure_dev": insecure_dev,
        "log_format": log_format,
    }
    try:
        settings = load_settings(OverlaySettings, config, overrides)
        run_overlay(settings, port_file=port_file)
    except (ConfigError, SecurityConfigError, ValueError, OSError) as exc:
        raise _fail(str(exc)) from None


@config_app.command("show")
def config_show(
    component: Annotated[
        str, typer.Option(help="Which process: " + ", ".join(_COMPONENTS))
    ] = "cpm",
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the effective configuration (file < environment < defaults resolved)."""
    cls = _settings_class(component)
    if cls is None:
        raise _fail(f"unknown component {component!r}; choose from {', '.join(_COMPONENTS)}")
    try:
        settings = load_settings(cls, config, {})
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    data = settings.model_dump(mode="json")
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        import yaml

        typer.echo(yaml.safe_dump(data, sort_keys=False).rstrip())


def _mount_subapps() -> None:
    from peerlm.app.cli_ca import app as ca_app
    from peerlm.app.cli_data import app as data_app
    from peerlm.app.cli_models import app as models_app

    app.add_typer(ca_app, name="ca", help="Federation PKI: CA, certificates.")
    app.add_typer(data_app, name="data", help="Bundled task data: build, show.")
    app.add_typer(
        models_app, name="models", help="Models: build the tiny ones; FedProxy compress and fuse."
    )
    _mount_operations()
    try:
        from peerlm.bench.cli import app as bench_app
    except ImportError:  # pragma: no cover - the bench module is part of the package
        return
    app.add_typer(bench_app, name="bench", help="Benchmarks.")


def _mount_operations() -> None:
    from peerlm.app.cli_status import health_command, status_command
    from peerlm.app.compose import app as compose_app

    app.command("status")(status_command)
    app.command("health")(health_command)
    app.add_typer(compose_app, name="compose")


def _mount_dev() -> None:
    from peerlm.app.cli_up import up_command
    from peerlm.app.experiment_cli import run_experiment_command
    from peerlm.app.simulated import sim_agent_command
    from peerlm.app.workflow_experiment_cli import run_workflow_experiment_command

    app.command("up")(up_command)
    app.command("run-experiment")(run_experiment_command)
    app.command("run-workflow-experiment")(run_workflow_experiment_command)
    app.command("sim-agent", hidden=True)(sim_agent_command)


_mount_subapps()
_mount_dev()


def main() -> None:
    """Console-script entry point."""
    app()
