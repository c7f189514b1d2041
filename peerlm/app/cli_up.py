"""``peerlm up``'s command line: its options, their checks (every flag before anything of
the last run is touched) and the command's steps; the federation it runs is
:mod:`peerlm.app.devfed`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from peerlm.app.devfed import (
    AGENT_PRELOAD,
    ARCHS,
    OVERLAY_STARTUP_S,
    DevFederation,
    RealPlan,
    free_ports,
    prepare_real,
    run_federation,
    sim_argv,
)
from peerlm.app.devfed_report import print_report
from peerlm.app.private_state import make_private, tighten
from peerlm.protocols import (
    DEFAULT_OVERLAY_AGGREGATION,
    DEFAULT_PROTOCOL,
    check_names,
    lookup,
)
from peerlm.protocols import names as protocol_names

__all__ = ["up_command"]


def _refuse_with_fedproxy(**given: bool) -> None:
    """--fedproxy runs model-hosting cohort agents that play only the cohort's rounds: the
    options of the CPM-directed, overlay, FedWave and simulated federations mean nothing
    there, and --resume is not offered (each run starts a new cohort)."""
    wrong = [f"--{name.replace('_', '-')}" for name, set_ in given.items() if set_]
    if wrong:
        raise typer.BadParameter(
            f"--fedproxy runs a FedProxy cohort (an owner and its members, cohort rounds "
            f"only): leave out {', '.join(wrong)}"
        )


#: ``peerlm up``'s options (typer reads each from its parameter's annotation).
_AgentsOption = Annotated[
    int | None,
    typer.Option(
        "--agents",
        "-n",
        min=2,
        help="Number of agents (default 4; --workflow: one per stage; --fedproxy: the "
        "owner and its members, default 3).",
    ),
]
_RoundsOption = Annotated[int, typer.Option("--rounds", "-r", min=1, help="Rounds per agent.")]
_StateDirOption = Annotated[Path, typer.Option(help="Where CA, databases and logs live.")]
_SeedOption = Annotated[int, typer.Option(help="Seed of data partition, models and learning.")]
_SimulatedOption = Annotated[
    bool, typer.Option(help="Synthetic-learning agents instead of model-hosting ones.")
]
_MicroOption = Annotated[
    bool, typer.Option(help="Micro models (seconds to build; for smoke tests).")
]
_HeterogeneityOption = Annotated[str, typer.Option(help="--simulated only: high or low.")]
_ResumeOption = Annotated[
    bool,
    typer.Option(help="Keep the CPM database and agent checkpoints of the last run."),
]
_MetricsPortOption = Annotated[int | None, typer.Option(help="CPM /metrics port.")]
_OverlayOption = Annotated[
    bool,
    typer.Option(
        help="Agents are overlay nodes (bootstrap: agent-0) and pull and aggregate their "
        "K most similar peers' adapters each round (SemanticDFL)."
    ),
]
_OverlayStartupOption = Annotated[
    float | None,
    typer.Option(
        "--overlay-startup",
        help="With --overlay, seconds from writing the agents' configurations to the "
        f"overlay's first build (default {OVERLAY_STARTUP_S:g}): every agent must have "
        "loaded its model and joined by then, or it is placed only at the next epoch.",
    ),
]
_FamilyOption = Annotated[
    str | None,
    typer.Option(
        help=f"One model family for every agent ({', '.join(ARCHS)}); default round-robin. "
        "Adapters aggregate only within a family: with mixed families the overlay's "
        "pulls are refused (counted) by design."
    ),
]
_AggregationOption = Annotated[
    str,
    typer.Option(
        help="With --overlay, what the pulled adapters become: one of "
        + ", ".join(
            f"{e} ({lookup(e).paper}: {lookup(e).summary})"
            for e in protocol_names(overlay_aggregation=True)
        )
        + "."
    ),
]
_OneShotOption = Annotated[
    bool,
    typer.Option(
        "--one-shot",
        help="With --overlay, OnePeFT's one-shot mode: each agent pulls and aggregates its "
        "neighbours' adapters once after joining, then only trains locally and publishes "
        "its signature.",
    ),
]
_ProtocolsOption = Annotated[
    str,
    typer.Option(
        help=f"The CPM's protocol menu K_rec, comma-separated: {', '.join(protocol_names())} "
        f"(docs/matchmaker.md). {', '.join(protocol_names(admissibility='same_space'))} are "
        "recommended only between agents of one parameter space: combine with --family."
    ),
]
_RewardOption = Annotated[
    str,
    typer.Option(
        help="Where a student measures its Eq. 3 reward: val (its validation data, the "
        "paper), probe (a labelled public probe of every category) or lacked (the "
        "probe's problems of the categories it lacks); docs/experiment.md."
    ),
]
_MergeSendersOption = Annotated[
    int,
    typer.Option(
        min=1,
        max=16,
        help="Most senders one CPM merge directive "
        f"({', '.join(protocol_names(co_senders=True))}) "
        "names: the teacher and up to this many minus one co-senders (docs/matchmaker.md).",
    ),
]
_CoSenderScoringOption = Annotated[
    str,
    typer.Option(
        help="How the CPM picks a merge directive's co-senders (with --merge-senders > "
        "1): pair (each by its own pair UCB) or group (the group as one arm).",
    ),
]
_RewardNormaliserOption = Annotated[
    str,
    typer.Option(
        help="How the CPM normalises rewards before the bandit learns them: robust "
        "(median/MAD over the last 256 rewards; docs/security.md) or zscore (the paper's "
        "running z-score, winsorised).",
    ),
]
_PairingOption = Annotated[
    str,
    typer.Option(
        help="How the CPM pairs: disjoint (Algorithm 2, at most N/2 pairs a round) or "
        "per_student (every agent a student each round; docs/matchmaker.md).",
    ),
]
_TeachersPerStudentOption = Annotated[
    int,
    typer.Option(
        help="With --pairing per_student: teachers each agent learns from a round, its "
        'best ones by UCB (1 to 16; docs/matchmaker.md, "Several teachers a student").',
    ),
]
_WorkflowOption = Annotated[
    bool,
    typer.Option(
        "--workflow",
        help="A FedWave value chain instead: one expert agent per stage of the bundled "
        "code chain (specify, implement, test), exchanging routers and VCLayers over "
        "mTLS and aggregating the router each round (docs/fedwave.md).",
    ),
]
_FedproxyOption = Annotated[
    bool,
    typer.Option(
        "--fedproxy",
        help="A FedProxy cohort instead: agent 'owner' holds the full model (--family, "
        "default gpt2), compresses it to a proxy by Block Influence and runs --rounds "
        "cohort rounds with the other agents as its members (pull the proxy, train it "
        "with PCR, the owner merges by H-TIES) over mTLS (docs/fedproxy.md).",
    ),
]
_ProxyRatioOption = Annotated[
    float | None,
    typer.Option(
        "--proxy-ratio",
        help="With --fedproxy, the compression ratio κ: the share of the owner's blocks "
        "removed, in [0, 1) (default 0.5).",
    ),
]
_RoundDeadlineOption = Annotated[
    float | None,
    typer.Option(
        "--round-deadline",
        help="With --fedproxy, seconds the owner collects a round's updates before it "
        "merges what arrived (default 180; round 1 also waits for the members to start).",
    ),
]
_AsJsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


@dataclass(frozen=True)
class _UpOptions:
    """``peerlm up``'s options as given (:func:`up_command`)."""

    agents: int | None
    rounds: int
    state_dir: Path
    seed: int
    simulated: bool
    micro: bool
    heterogeneity: str
    resume: bool
    metrics_port: int | None
    overlay: bool
    overlay_startup: float | None
    family: str | None
    aggregation: str
    one_shot: bool
    protocols: str
    reward: str
    merge_senders: int
    co_sender_scoring: str
    reward_normaliser: str
    pairing: str
    teachers_per_student: int
    workflow: bool
    fedproxy: bool
    proxy_ratio: float | None
    round_deadline: float | None
    as_json: bool

    @property
    def size(self) -> Literal["tiny", "micro"]:
        return "micro" if self.micro else "tiny"


def up_command(
    agents: _AgentsOption = None,
    rounds: _RoundsOption = 5,
    state_dir: _StateDirOption = Path("state/dev-federation"),
    seed: _SeedOption = 0,
    simulated: _SimulatedOption = False,
    micro: _MicroOption = False,
    heterogeneity: _HeterogeneityOption = "high",
    resume: _ResumeOption = False,
    metrics_port: _MetricsPortOption = None,
    overlay: _OverlayOption = False,
    overlay_startup: _OverlayStartupOption = None,
    family: _FamilyOption = None,
    aggregation: _AggregationOption = DEFAULT_OVERLAY_AGGREGATION,
    one_shot: _OneShotOption = False,
    protocols: _ProtocolsOption = DEFAULT_PROTOCOL,
    reward: _RewardOption = RealPlan.reward,
    merge_senders: _MergeSendersOption = 1,
    co_sender_scoring: _CoSenderScoringOption = "pair",
    reward_normaliser: _RewardNormaliserOption = "robust",
    pairing: _PairingOption = "disjoint",
    teachers_per_student: _TeachersPerStudentOption = 1,
    workflow: _WorkflowOption = False,
    fedproxy: _FedproxyOption = False,
    proxy_ratio: _ProxyRatioOption = None,
    round_deadline: _RoundDeadlineOption = None,
    as_json: _AsJsonOption = False,
) -> None:
    """Start a local federation (dev CA, CPM, N agents) on loopback with real mTLS."""
    opts = _UpOptions(**locals())
    # Every flag is checked before anything is touched: a typo must not cost the last run's
    # database and checkpoints.
    menu = _checked_menu(opts)
    names = _agent_names(opts, menu)
    console = None if as_json else Console(stderr=True)
    fed = _fresh_state(opts, names, console)
    try:
        argv = _agent_argvs(opts, fed, names, menu, console)
        # What up wrote with an explicit mode (certificates are 0644 by design) too: the
        # whole state directory is owner-only before any process starts.
        tighten(state_dir)
        result = asyncio.run(
            run_federation(
                fed,
                names,
                rounds,
                argv,
                metrics_port,
                console,
                menu,
                round_of=_round_counter(opts, fed),
                merge_senders=merge_senders,
                co_sender_scoring=co_sender_scoring,
                reward_normaliser=reward_normaliser,
                pairing=pairing,
                teachers_per_student=teachers_per_student,
                # Simulated agents import no model libraries: nothing to share.
                preload=() if opts.simulated else AGENT_PRELOAD,
            )
        )
    except KeyboardInterrupt:
        if console:
            console.print("[yellow]interrupted; all processes stopped[/]")
        raise typer.Exit(code=130) from None
    except (RuntimeError, TimeoutError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    _add_summaries(opts, result)
    _print_result(opts, fed, result)
    failed = [r for r in result["agents"] if r.get("errors")]
    if failed or result["cpm_exit_code"] != 0:
        # Why the exit code is 1, on stderr even with --json (stdout holds the report).
        err = Console(stderr=True)
        for r in failed:
            err.print(
                f"[bold red]{escape(str(r.get('name', '?')))}:[/]", escape("; ".join(r["errors"]))
            )
        if result["cpm_exit_code"] != 0:
            err.print(f"[bold red]cpm:[/] exited with {result['cpm_exit_code']}")
        raise typer.Exit(code=1)


def _checked_menu(opts: _UpOptions) -> tuple[str, ...]:
    """The CPM's protocol menu (``--protocols``), after every option that does not depend
    on the kind of federation is checked; a wrong one is a ``BadParameter``."""
    family, simulated, overlay, reward = opts.family, opts.simulated, opts.overlay, opts.reward
    if family is not None and family not in ARCHS:
        raise typer.BadParameter(f"unknown family {family!r}; one of {', '.join(ARCHS)}")
    if simulated and (overlay or family):
        raise typer.BadParameter("--overlay and --family need model-hosting agents")
    overlay_merges = protocol_names(overlay_aggregation=True)
    if opts.aggregation not in overlay_merges:
        raise typer.BadParameter(
            f"unknown aggregation {opts.aggregation!r}; one of {', '.join(overlay_merges)}"
        )
    if reward not in ("val", "probe", "lacked"):
        raise typer.BadParameter(f"unknown reward {reward!r}; val, probe or lacked")
    if simulated and reward != RealPlan.reward:
        raise typer.BadParameter("simulated agents measure no reward: leave --reward out")
    if opts.aggregation != DEFAULT_OVERLAY_AGGREGATION and not overlay:
        raise typer.BadParameter("--aggregation applies to overlay pulls: add --overlay")
    if opts.one_shot and not overlay:
        raise typer.BadParameter("--one-shot applies to overlay pulls: add --overlay")
    if opts.overlay_startup is not None and not overlay:
        raise typer.BadParameter("--overlay-startup is the overlay's first build: add --overlay")
    if opts.overlay_startup is not None and not 0 < opts.overlay_startup <= 3600:
        raise typer.BadParameter(
            f"--overlay-startup {opts.overlay_startup}: must be in (0, 3600] seconds"
        )
    menu = tuple(p.strip() for p in opts.protocols.split(",") if p.strip())
    try:
        check_names(menu)
    except ValueError:
        menu = ()
    if not menu:
        raise typer.BadParameter(
            f"--protocols {opts.protocols!r}: name each of {', '.join(protocol_names())} at "
            "most once"
        )
    if simulated and menu != (DEFAULT_PROTOCOL,):
        raise typer.BadParameter(
            f"simulated agents execute {DEFAULT_PROTOCOL} only: leave --protocols out"
        )
    _check_cpm_options(opts, menu)
    _check_fedproxy_options(opts)
    return menu


def _check_cpm_options(opts: _UpOptions, menu: tuple[str, ...]) -> None:
    """``--merge-senders``, ``--co-sender-scoring``, ``--reward-normaliser``, ``--pairing``
    and ``--teachers-per-student``."""
    if opts.merge_senders != 1 and not any(lookup(p).co_senders for p in menu):
        merges = " or ".join(protocol_names(co_senders=True))
        raise typer.BadParameter(f"--merge-senders applies to merge protocols: add {merges}")
    if opts.co_sender_scoring not in ("pair", "group"):
        raise typer.BadParameter("--co-sender-scoring must be 'pair' or 'group'")
    if opts.co_sender_scoring != "pair" and opts.merge_senders == 1:
        raise typer.BadParameter("--co-sender-scoring group needs --merge-senders > 1")
    if opts.reward_normaliser not in ("zscore", "robust"):
        raise typer.BadParameter("--reward-normaliser must be 'zscore' or 'robust'")
    if opts.pairing not in ("disjoint", "per_student"):
        raise typer.BadParameter("--pairing must be 'disjoint' or 'per_student'")
    from peerlm.services.cpm import MAX_TEACHERS_PER_STUDENT

    k = opts.teachers_per_student
    if not 1 <= k <= MAX_TEACHERS_PER_STUDENT:
        raise typer.BadParameter(
            f"--teachers-per-student must be in [1, {MAX_TEACHERS_PER_STUDENT}], not {k}"
        )
    if k > 1 and opts.pairing != "per_student":
        raise typer.BadParameter("--teachers-per-student > 1 needs --pairing per_student")


def _check_fedproxy_options(opts: _UpOptions) -> None:
    """``--proxy-ratio`` and ``--round-deadline``: the FedProxy owner's, in range."""
    proxy_ratio, round_deadline = opts.proxy_ratio, opts.round_deadline
    if proxy_ratio is not None and not opts.fedproxy:
        raise typer.BadParameter("--proxy-ratio is the FedProxy owner's κ: add --fedproxy")
    if proxy_ratio is not None and not 0 <= proxy_ratio < 1:
        raise typer.BadParameter(f"--proxy-ratio {proxy_ratio}: κ must lie in [0, 1)")
    if round_deadline is not None and not opts.fedproxy:
        raise typer.BadParameter("--round-deadline is the FedProxy owner's: add --fedproxy")
    if round_deadline is not None and not round_deadline > 0:
        raise typer.BadParameter(f"--round-deadline {round_deadline}: must be positive seconds")


def _agent_names(opts: _UpOptions, menu: tuple[str, ...]) -> list[str]:
    """The agents of the federation the options name (a FedProxy cohort, a FedWave chain's
    stages, or ``agent-i``), after the options that kind refuses are checked."""
    agents = opts.agents
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import cohort_names

        _refuse_with_fedproxy(
            simulated=opts.simulated,
            overlay=opts.overlay,
            workflow=opts.workflow,
            resume=opts.resume,
            protocols=menu != (DEFAULT_PROTOCOL,),
            reward=opts.reward != RealPlan.reward,
            aggregation=opts.aggregation != DEFAULT_OVERLAY_AGGREGATION,
            merge_senders=opts.merge_senders != 1,
            heterogeneity=opts.heterogeneity != "high",
        )
        return cohort_names(agents if agents is not None else 3)
    if opts.workflow:
        from peerlm.app.devfed_workflow import WORKFLOW_AGENTS

        if (
            opts.simulated
            or opts.overlay
            or menu != (DEFAULT_PROTOCOL,)
            or opts.reward != RealPlan.reward
        ):
            raise typer.BadParameter(
                "--workflow runs model-hosting FedWave experts: leave out --simulated, "
                "--overlay, --protocols and --reward"
            )
        if agents is not None and agents != len(WORKFLOW_AGENTS):
            raise typer.BadParameter(
                f"--workflow runs one agent per stage of the code chain "
                f"({len(WORKFLOW_AGENTS)}): leave out --agents"
            )
        return list(WORKFLOW_AGENTS)
    return [f"agent-{i}" for i in range(agents if agents is not None else 4)]


def _fresh_state(opts: _UpOptions, names: list[str], console: Console | None) -> DevFederation:
    """The state directory, owner-only, without the last run's database and checkpoints
    (unless ``--resume``), with a certificate for every process."""
    state_dir = opts.state_dir
    # Private data, keys, the CPM database, checkpoints and logs: owner-only, for every file
    # this command and its children (which inherit the umask) write (private_state).
    tightened = make_private(state_dir)
    fed = DevFederation(state_dir)
    if not opts.resume:
        import shutil

        for suffix in ("", "-wal", "-shm"):
            (state_dir / f"cpm.db{suffix}").unlink(missing_ok=True)
        shutil.rmtree(state_dir / "agents", ignore_errors=True)
    fed.provision(names)
    if console:
        if tightened:
            console.print(f"made {tightened} files and folders of {state_dir} owner-only")
        console.print(
            f"[bold]peerlm up[/]: {len(names)} agents, {opts.rounds} rounds, state in {state_dir}"
            + (" (FedWave workflow: " + " → ".join(names) + ")" if opts.workflow else "")
            + (
                f" (FedProxy cohort: {names[0]} and {len(names) - 1} members)"
                if opts.fedproxy
                else ""
            )
        )
    return fed


def _agent_argvs(
    opts: _UpOptions,
    fed: DevFederation,
    names: list[str],
    menu: tuple[str, ...],
    console: Console | None,
) -> Any:
    """Each agent's command line, after what it needs is prepared (models, data, configs)."""
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import prepare_cohort

        return prepare_cohort(
            fed,
            names,
            opts.rounds,
            opts.seed,
            size=opts.size,
            family=opts.family or "gpt2",
            ratio=0.5 if opts.proxy_ratio is None else opts.proxy_ratio,
            round_deadline_s=opts.round_deadline,
            console=console,
            free_ports=free_ports,
            stop_grace_s=RealPlan.stop_grace_s,
        )
    if opts.workflow:
        from peerlm.app.devfed_workflow import prepare_workflow

        return prepare_workflow(
            fed,
            opts.rounds,
            opts.seed,
            size=opts.size,
            family=opts.family or "gpt2",
            console=console,
            free_ports=free_ports,
            stop_grace_s=RealPlan.stop_grace_s,
        )
    if opts.simulated:
        return sim_argv(
            fed, names, opts.rounds, opts.seed, opts.heterogeneity, opts.teachers_per_student
        )
    plan = RealPlan.of_size(
        opts.size,
        overlay=opts.overlay,
        family=opts.family,
        aggregation=opts.aggregation,
        one_shot=opts.one_shot,
        overlay_startup_s=(
            OVERLAY_STARTUP_S if opts.overlay_startup is None else opts.overlay_startup
        ),
        reward=opts.reward,
        extra_protocols=tuple(p for p in menu if not lookup(p).on_by_default),
    )
    return prepare_real(fed, names, opts.rounds, opts.seed, plan, console)


def _round_counter(opts: _UpOptions, fed: DevFederation) -> Any:
    """What counts a FedWave chain's or a FedProxy cohort's rounds (their agents report no
    rounds to a CPM): the agents' logs; None for a CPM-directed federation."""
    if not (opts.workflow or opts.fedproxy):
        return None
    from peerlm.app.devfed_workflow import LogRounds

    # The owner's rounds closed, the members' rounds trained; FedWave's rounds done.
    events = ("fedproxy_round_merged", "fedproxy_update_ready")
    return LogRounds(
        fed.logs,
        events if opts.fedproxy else "fedwave_round_done",
        # --resume appends to the last run's logs: count this run's rounds only.
        from_end=opts.resume,
    )


def _add_summaries(opts: _UpOptions, result: dict[str, Any]) -> None:
    """A FedWave chain's router agreement and stage scores, a FedProxy cohort's summary."""
    if opts.workflow:
        from peerlm.app.devfed_workflow import router_agreement, stage_scores

        agreed, played = router_agreement(result["agents"])
        result["fedwave"] = {
            "rounds_same_router": agreed,
            "rounds_played": played,
            "stages": stage_scores(result["agents"]),
        }
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import cohort_summary

        result["fedproxy"] = cohort_summary(result["agents"])


def _print_result(opts: _UpOptions, fed: DevFederation, result: dict[str, Any]) -> None:
    """The JSON object (``--json``), or the report of the federation's kind on stdout."""
    if opts.as_json:
        typer.echo(json.dumps(result))
    elif opts.fedproxy:
        from peerlm.app.devfed_fedproxy import print_cohort_report

        print_cohort_report(Console(), result, fed.logs)
    elif opts.workflow:
        from peerlm.app.devfed_workflow import print_workflow_report

        print_workflow_report(Console(), result, fed.logs)
    else:
        print_report(Console(), result)
        Console().print(
            f"CPM: {result['matchmaking_rounds']} matchmaking rounds, "
            f"{result['directives_issued']} directives, {result['rewards_observed']} rewards "
            f"committed, |theta| = {result['theta_norm']:.3f}; logs in {fed.logs}"
        )
        if opts.overlay:
            Console().print(
                f"overlay: {result['adapters_pulled']} neighbour adapters integrated"
                + ("" if opts.family else "; mixed families: cross-family pulls are refused")
            )
