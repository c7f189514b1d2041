"""``peerlm run-experiment``: progress on stderr (rich), a table or ``--json`` on stdout."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from peerlm.app.experiment_plan import Event, ExperimentPlan

__all__ = ["run_experiment_command"]

_DEFAULTS_HELP = "default: the plan's (docs/experiment.md), or --quick's"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of integers: {text!r}") from None


#: The command's options (typer reads each from its parameter's annotation).
_AgentsOption = Annotated[int | None, typer.Option("--agents", "-n", min=2, help="Clients.")]
_RoundsOption = Annotated[int | None, typer.Option("--rounds", "-r", min=1, help="Rounds.")]
_StrategiesOption = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated (default: local_plus,random,cpm, the key comparisons); "
        "'table' is the paper's table: local, local_plus, random, heuristic, "
        "central_kd, cpm, oracle, semantic_dfl (--quick's); adapter merges (with --family): "
        "fedavg_lora, ffa_lora, onepeft, onepeft_svd, onepeft_hka, onepeft_fedavg, "
        "onepeft_multi, onepeft_multi_ce, fedavg_lora_plus; the CPM "
        "over the whole protocol menu (with --family): cpm_menu, or one protocol forced: "
        "cpm_akd_logits, cpm_pmix, cpm_svd_hka; FedProxy cohorts (with --family): "
        "fedproxy_hties, fedproxy_hties_nopcr, fedproxy_fedavg, fedproxy_ties, "
        "fedproxy_proxytuning (ProxyTuning instead of fusion), and the "
        "CentSFT reference fedproxy_centsft; the SemanticDFL overlay as an agent runs it "
        "(with --family): overlay_topk, and cpm_menu_overlay (the CPM's directive, then "
        "the overlay step; merges only from the student's overlay list)."
    ),
]
_SeedsOption = Annotated[
    str | None, typer.Option(help="Run seeds, comma-separated (default 0,1,2,3,4).")
]
_WorldSeedOption = Annotated[
    int, typer.Option(help="Seed of the data split, test/transfer/probe sets and models.")
]
_QuickOption = Annotated[bool, typer.Option(help="Smoke-test configuration (minutes).")]
_MicroOption = Annotated[bool, typer.Option(help="Micro models (seconds; for tests).")]
_RewardOption = Annotated[
    str | None, typer.Option(help="Where L_pre/L_post are measured: probe or val.")
]
_ProbeScopeOption = Annotated[
    str | None,
    typer.Option(
        help="With --reward probe: measure on the whole probe (all), on the student's "
        "lacked categories only (lacked), on the categories each AKD package answers "
        "(answered), or on those of them the student's router sends to its peer slot "
        "(routed)."
    ),
]
_ProbePerCategoryOption = Annotated[int | None, typer.Option(min=1, help=_DEFAULTS_HELP)]
_CpmFeaturesOption = Annotated[
    str | None, typer.Option(help="CPM context: interaction (default) or plain.")
]
_OutOption = Annotated[
    Path | None, typer.Option(help="Write results.json, table.md and a PNG plot here.")
]
_ModelsDirOption = Annotated[
    Path | None,
    typer.Option(
        help="Built models (cached); default the shared cache, $PEERLM_MODELS_DIR or "
        "state/models[-micro]."
    ),
]
_WorkDirOption = Annotated[
    Path, typer.Option(help="Federation data, rebuilt at start; one run at a time holds it.")
]
_LocalStepsOption = Annotated[int | None, typer.Option(min=1, help="Optimiser steps a round.")]
_AkdStepsOption = Annotated[
    int | None,
    typer.Option(min=1, help="Optimiser steps of one AKD integration (LocalOnly+ matches)."),
]
_WarmupStepsOption = Annotated[
    int | None,
    typer.Option(min=0, help="Steps each client trains on its own data before round 1."),
]
_TeachScopeOption = Annotated[
    str | None,
    typer.Option(
        help="What a teacher answers of X_u: competent (categories where its validation "
        "pass@1 shows skill; default) or all (the paper)."
    ),
]
_ValEveryOption = Annotated[
    int | None,
    typer.Option(
        min=1, help="Generate the validation problems every N rounds (competence, pass@1)."
    ),
]
_CurveEveryOption = Annotated[
    int | None,
    typer.Option(min=1, help="Measure the test NLL curve every N rounds (and the last)."),
]
_TeachLimitOption = Annotated[
    int | None,
    typer.Option(min=1, help="Most X_u prompts a teacher answers in one round."),
]
_IntegrationOption = Annotated[
    str | None,
    typer.Option(
        help="Where a client puts what peers send: separate (a peer adapter beside its "
        "own, routed per input; default) or shared (the papers' one adapter)."
    ),
]
_PeerAlphaOption = Annotated[
    float | None,
    typer.Option(min=0.01, max=1.0, help="Eq. 2's alpha_KD for the peer slot (default 1.0)."),
]
_SlotScopeOption = Annotated[
    str | None,
    typer.Option(
        help="What the peer slot distils of a package: all its items (default) or routed "
        "(only those whose prompt the router sends to the slot)."
    ),
]
_AnswerCheckOption = Annotated[
    str | None,
    typer.Option(
        help="Which adapter's answer a routed input keeps, judged by its prompt's example: "
        "own_first (default: the own adapter's unless it fails), peer_first (the slot's "
        "unless it fails and the own one passes) or off (the router alone)."
    ),
]
_SlotBanksOption = Annotated[
    str | None,
    typer.Option(
        help="The peer slot's adapters: category (default: a bank a lacked category, each "
        "lesson written to its category's, each input answered by its own) or one.",
    ),
]
_SlotRehearsalOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=256,
        help="Pairs of the peer slot's earlier text lessons distilled beside each new one, "
        "in the same steps (default 0: none).",
    ),
]
_SlotLrOption = Annotated[
    float | None,
    typer.Option(
        min=1e-6,
        max=1.0,
        help="The peer slot's learning rate, every integration's under --integration "
        "separate (default: --lr's).",
    ),
]
_PairingOption = Annotated[
    str | None,
    typer.Option(
        help="How Random-P2P, KNEXA-FL and the Oracle pair: per_student (default: every "
        "client a student each round) or disjoint (Algorithm 2: at most N/2 pairs a round).",
    ),
]
_TeacherCapacityOption = Annotated[
    int | None,
    typer.Option(
        min=1, help="With --pairing per_student: students one teacher serves a round (any)."
    ),
]
_TeachersPerStudentOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=16,
        help="With --pairing per_student: teachers each student learns from a round "
        "(default 2; 1 under --pairing disjoint); LocalOnly+ spends as many lessons' steps "
        "on its own data.",
    ),
]
_OwnStepsEveryRoundOption = Annotated[
    bool | None,
    typer.Option(
        "--own-steps-every-round/--students-only",
        help="Every collaborating client trains LocalOnly+'s extra own-data steps each "
        "round (default), or only students train in the exchange phase (the old harness).",
    ),
]
_TeachSelfCheckOption = Annotated[
    bool | None,
    typer.Option(
        "--teach-self-check/--no-teach-self-check",
        help="A teacher sends only the answers that pass their prompt's docstring example "
        "in its sandbox (default: off, the paper's Eq. 2 sends them all).",
    ),
]
_TeachMinPassOption = Annotated[
    float | None,
    typer.Option(
        min=0.0, max=1.0, help="Wilson lower bound of pass@1 a taught category needs (0.2)."
    ),
]
_LrOption = Annotated[
    float | None, typer.Option(min=1e-6, max=1.0, help="Local learning rate (default 5e-3).")
]
_GradAccumulationOption = Annotated[
    int | None, typer.Option(min=1, help="Micro-batches of 8 per step.")
]
_TransferLimitOption = Annotated[int | None, typer.Option(min=1, help="Prompts of X_u used.")]
_ExpertsPerSkillOption = Annotated[
    int | None, typer.Option(min=1, help="Clients sharing each private skill.")
]
_UnskilledOption = Annotated[
    int | None, typer.Option(min=0, help="Clients (the last ones) with no private skill.")
]
_TestLimitOption = Annotated[int | None, typer.Option(min=1, help="Global test problems.")]
_SamplesOption = Annotated[int | None, typer.Option(min=1, help="Samples per problem.")]
_TemperatureOption = Annotated[float | None, typer.Option(min=0.01, help="Sampling T.")]
_MaxNewTokensOption = Annotated[int | None, typer.Option(min=1)]
_FamilyOption = Annotated[
    str | None,
    typer.Option(help="One model family for every client (gpt2, gpt_neox, bloom, qwen2)."),
]
_ThreadsOption = Annotated[int, typer.Option(min=1, help="torch CPU threads per process.")]
_JobsOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="(strategy, seed) runs in this many processes at once (default: one per "
        "--threads usable CPU cores, at most one per run and per 1.5 GiB of available "
        "memory).",
    ),
]
_CpmColumnsOption = Annotated[
    str | None,
    typer.Option(
        help="Profile entries the CPM's context sees: all (default), or a comma list of "
        "groups (static, dynamic, distribution, performance) and indices."
    ),
]
_CpmBetaOption = Annotated[
    float | None, typer.Option(min=0.0, help="The CPM's exploration weight (default 1.0).")
]
_MergeSendersOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Most senders of one CPM merge directive (pmix, svd_hka): the CPM "
        "strategies' merges name up to this many senders (default 1).",
    ),
]
_CoSenderScoringOption = Annotated[
    str | None,
    typer.Option(
        help="How the CPM picks a merge directive's co-senders (with --merge-senders > "
        "1): pair (each by its own pair UCB, the reward learnt on the teacher's context; "
        "default) or group (the group scored as one arm; docs/matchmaker.md).",
    ),
]
_RewardNormaliserOption = Annotated[
    str | None,
    typer.Option(
        help="How the CPM normalises rewards before its bandit learns them: robust "
        "(median/MAD over the last 256 rewards, docs/security.md; default) or zscore "
        "(the paper's running z-score, winsorised).",
    ),
]
_ProxyTuningBetaOption = Annotated[
    float | None,
    typer.Option(
        help="fedproxy_proxytuning's offset weight: M's logits + beta × (trained proxy − "
        "proxy as compressed); 1 (default) is ProxyTuning's own sum, 0 is M untouched.",
    ),
]
_ReuseOption = Annotated[
    list[Path] | None,
    typer.Option(
        help="An earlier results.json whose (strategy, seed) runs of the same plan, "
        "world and models are taken instead of run again (repeatable); a stopped "
        "command's finished runs are in its --work-dir's runs-so-far.json."
    ),
]
_AsJsonOption = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]


#: Plan fields set from the option of the same meaning when it is given (field: option).
_PLAN_FIELDS: dict[str, str] = {
    "agents": "agents",
    "rounds": "rounds",
    "local_steps": "local_steps",
    "warmup_steps": "warmup_steps",
    "akd_steps": "akd_steps",
    "teach_scope": "teach_scope",
    "teach_min_pass": "teach_min_pass",
    "teach_self_check": "teach_self_check",
    "integration": "integration",
    "val_every": "val_every",
    "teach_limit": "teach_limit",
    "curve_every": "curve_every",
    "own_steps_every_round": "own_steps_every_round",
    "peer_alpha": "peer_alpha",
    "slot_scope": "slot_scope",
    "answer_check": "answer_check",
    "slot_rehearsal": "slot_rehearsal",
    "slot_banks": "slot_banks",
    "slot_learning_rate": "slot_lr",
    "pairing": "pairing",
    "teacher_capacity": "teacher_capacity",
    "teachers_per_student": "teachers_per_student",
    "learning_rate": "lr",
    "grad_accumulation": "grad_accumulation",
    "transfer_limit": "transfer_limit",
    "experts_per_skill": "experts_per_skill",
    "unskilled": "unskilled",
    "test_limit": "test_limit",
    "samples": "samples",
    "sample_temperature": "temperature",
    "max_new_tokens": "max_new_tokens",
    "reward": "reward",
    "probe_per_category": "probe_per_category",
    "probe_scope": "probe_scope",
    "family": "family",
}


def run_experiment_command(
    agents: _AgentsOption = None,
    rounds: _RoundsOption = None,
    strategies: _StrategiesOption = None,
    seeds: _SeedsOption = None,
    world_seed: _WorldSeedOption = 0,
    quick: _QuickOption = False,
    micro: _MicroOption = False,
    reward: _RewardOption = None,
    probe_scope: _ProbeScopeOption = None,
    probe_per_category: _ProbePerCategoryOption = None,
    cpm_features: _CpmFeaturesOption = None,
    out: _OutOption = None,
    models_dir: _ModelsDirOption = None,
    work_dir: _WorkDirOption = Path("state/experiment"),
    local_steps: _LocalStepsOption = None,
    akd_steps: _AkdStepsOption = None,
    warmup_steps: _WarmupStepsOption = None,
    teach_scope: _TeachScopeOption = None,
    val_every: _ValEveryOption = None,
    curve_every: _CurveEveryOption = None,
    teach_limit: _TeachLimitOption = None,
    integration: _IntegrationOption = None,
    peer_alpha: _PeerAlphaOption = None,
    slot_scope: _SlotScopeOption = None,
    answer_check: _AnswerCheckOption = None,
    slot_rehearsal: _SlotRehearsalOption = None,
    slot_banks: _SlotBanksOption = None,
    slot_lr: _SlotLrOption = None,
    pairing: _PairingOption = None,
    teacher_capacity: _TeacherCapacityOption = None,
    teachers_per_student: _TeachersPerStudentOption = None,
    own_steps_every_round: _OwnStepsEveryRoundOption = None,
    teach_min_pass: _TeachMinPassOption = None,
    teach_self_check: _TeachSelfCheckOption = None,
    lr: _LrOption = None,
    grad_accumulation: _GradAccumulationOption = None,
    transfer_limit: _TransferLimitOption = None,
    experts_per_skill: _ExpertsPerSkillOption = None,
    unskilled: _UnskilledOption = None,
    test_limit: _TestLimitOption = None,
    samples: _SamplesOption = None,
    temperature: _TemperatureOption = None,
    max_new_tokens: _MaxNewTokensOption = None,
    family: _FamilyOption = None,
    threads: _ThreadsOption = 1,
    jobs: _JobsOption = None,
    cpm_columns: _CpmColumnsOption = None,
    cpm_beta: _CpmBetaOption = None,
    merge_senders: _MergeSendersOption = None,
    co_sender_scoring: _CoSenderScoringOption = None,
    reward_normaliser: _RewardNormaliserOption = None,
    proxy_tuning_beta: _ProxyTuningBetaOption = None,
    reuse: _ReuseOption = None,
    as_json: _AsJsonOption = False,
) -> None:
    """Run the paper's comparison (Table 4) with real tiny models, with intervals."""
    options = dict(locals())  # every option by its parameter's name
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from peerlm.app.cli_models import models_cache_dir, quiet_transformers

    quiet_transformers()
    import torch

    from peerlm.logs import configure_logging

    # Warnings only, to stderr: stdout carries the table or the --json object.
    configure_logging("experiment", "local", level="warning")

    torch.set_num_threads(threads)
    plan = _plan(options)
    earlier = _earlier_results(reuse or [])
    if jobs is None:
        jobs = _default_jobs(plan, threads)
    models = models_dir or models_cache_dir("micro" if micro else "tiny")
    err = Console(stderr=True)
    result = _run_with_progress(plan, models, work_dir, jobs, earlier, err)
    _report(result, out, as_json, err)


def _plan(options: Mapping[str, Any]) -> ExperimentPlan:
    """The plan the options name (``--quick``'s, or the defaults, overridden by every option
    given); a plan the options cannot make is a ``BadParameter``."""
    from peerlm.app.experiment_plan import ExperimentPlan, parse_strategies, quick_plan
    from peerlm.services.cpm import context_columns

    given = {field: options[option] for field, option in _PLAN_FIELDS.items()}
    overrides = {k: v for k, v in given.items() if v is not None}
    overrides["world_seed"] = options["world_seed"]
    overrides["size"] = "micro" if options["micro"] else "tiny"
    if options["strategies"] is not None:
        try:
            overrides["strategies"] = parse_strategies(options["strategies"])
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    if options["seeds"] is not None:
        overrides["seeds"] = _ints(options["seeds"])
    cpm_features = options["cpm_features"]
    if cpm_features is not None:
        if cpm_features not in ("interaction", "plain"):
            raise typer.BadParameter("--cpm-features must be 'interaction' or 'plain'")
        overrides["cpm_interaction_features"] = cpm_features == "interaction"
    try:
        if options["cpm_columns"] is not None:
            overrides["cpm_context_columns"] = context_columns(options["cpm_columns"])
        overrides.update(_cpm_overrides(options))
        if options["proxy_tuning_beta"] is not None:
            overrides["proxy_tuning_beta"] = options["proxy_tuning_beta"]
        return quick_plan(**overrides) if options["quick"] else ExperimentPlan(**overrides)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _cpm_overrides(options: Mapping[str, Any]) -> dict[str, Any]:
    """The CPM's plan fields from ``--cpm-beta``, ``--merge-senders``,
    ``--co-sender-scoring`` and ``--reward-normaliser``, each checked."""
    overrides: dict[str, Any] = {}
    if options["cpm_beta"] is not None:
        overrides["cpm_beta"] = options["cpm_beta"]
    merge_senders = options["merge_senders"]
    if merge_senders is not None:
        overrides["cpm_merge_senders"] = merge_senders
    co_sender_scoring = options["co_sender_scoring"]
    if co_sender_scoring is not None:
        if co_sender_scoring not in ("pair", "group"):
            raise typer.BadParameter("--co-sender-scoring must be 'pair' or 'group'")
        if co_sender_scoring == "group" and (merge_senders or 1) == 1:
            raise typer.BadParameter("--co-sender-scoring group needs --merge-senders > 1")
        overrides["cpm_co_sender_scoring"] = co_sender_scoring
    reward_normaliser = options["reward_normaliser"]
    if reward_normaliser is not None:
        if reward_normaliser not in ("zscore", "robust"):
            raise typer.BadParameter("--reward-normaliser must be 'zscore' or 'robust'")
        overrides["cpm_reward_normaliser"] = reward_normaliser
    return overrides


def _earlier_results(paths: Sequence[Path]) -> list[Any]:
    """The ``--reuse`` files (JSON, or gzipped JSON), read; another is a ``BadParameter``."""
    from peerlm.app.experiment_reuse import read_results

    earlier: list[Any] = []
    for path in paths:
        try:
            earlier.append(read_results(path))
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"--reuse {path}: {exc}") from None
    return earlier


def _default_jobs(plan: ExperimentPlan, threads: int) -> int:
    """``--jobs`` when none is given (:func:`~peerlm.app.experiment_plan.default_jobs`)."""
    from peerlm.app.experiment_plan import default_jobs
    from peerlm.process import available_memory, usable_cores

    runs = len(plan.strategies) * len(plan.seeds)
    return default_jobs(runs, usable_cores(), available_memory(), threads)


def _run_with_progress(
    plan: ExperimentPlan,
    models: Path,
    work_dir: Path,
    jobs: int,
    earlier: list[Any],
    err: Console,
) -> dict[str, Any]:
    """The run, with bars on a terminal (one line per step on a pipe); a busy work
    directory or a reused result that does not match is a ``BadParameter``."""
    from peerlm.app.experiment import run_experiment
    from peerlm.app.work_lock import WorkDirBusy

    progress = Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=err,
        disable=not err.is_terminal,
    )
    with progress:
        on_event = _progress_events(plan, progress, err)
        try:
            return run_experiment(
                plan, models=models, work=work_dir, event=on_event, jobs=jobs, reuse=earlier
            )
        except WorkDirBusy as exc:
            raise typer.BadParameter(f"--work-dir: {exc}") from None
        except ValueError as exc:
            if "reused result" not in str(exc):
                raise
            raise typer.BadParameter(f"--reuse: {exc}") from None


def _progress_events(plan: ExperimentPlan, progress: Progress, err: Console) -> Event:
    """The run's events shown: model builds, warm-ups, round 0, each round and run."""
    total = len(plan.strategies) * len(plan.seeds) * (plan.rounds + 1)
    overall = progress.add_task("runs (strategy x seed)", total=total, status="")
    builds: dict[str, Any] = {}

    def on_event(kind: str, data: Any) -> None:
        if kind == "build":
            arch = data["arch"]
            if arch not in builds:
                builds[arch] = progress.add_task(f"build {arch}", total=None, status="")
            done = bool(data.get("finished"))
            size = max(int(data["total"]), 1)
            progress.update(
                builds[arch],
                total=size,
                completed=size if done else int(data["step"]),
                status=data["phase"],
            )
            if not err.is_terminal and done:
                err.print(f"model {arch}: {data['phase']}")
        elif kind == "warmup":
            what = "warm-up (ffa_lora, A frozen)" if data.get("ffa") else "warm-up"
            err.print(f"{what} {data['client']}: {data['steps']} steps, loss {data['loss']:.3f}")
        elif kind == "initial":
            err.print(f"round 0 test NLL per slice: {_slices(data)}")
        elif kind == "round":
            status = f"{data['strategy']} seed {data['seed']} round {data['round']}"
            progress.update(overall, advance=1, status=status)
            if not err.is_terminal:  # a pipe or log file: one line per step
                nll = data["nll"]
                err.print(f"{status}: test NLL per slice: {_slices(nll)}" if nll else status)
        elif kind == "reused":
            progress.update(overall, advance=plan.rounds + 1)
            err.print(f"{data['strategy']} seed {data['seed']}: reused")
        elif kind == "final":
            progress.update(overall, advance=1)
            if not err.is_terminal:
                err.print(f"{data['strategy']} seed {data['seed']}: done")

    return on_event


def _report(result: dict[str, Any], out: Path | None, as_json: bool, err: Console) -> None:
    """The files under ``--out``, then the table or the ``--json`` object on stdout."""
    from peerlm.app.experiment_report import render_table, write_outputs

    if out is not None:
        written = write_outputs(result, out)
        err.print("wrote " + ", ".join(str(p) for p in written))
    if as_json:
        typer.echo(json.dumps(_json_view(result)))
    else:
        Console().print(Markdown(render_table(result)))
        Console().print(f"{result['seconds']:.0f} s ({result['cpu_seconds']:.0f} CPU s)")


def _slices(data: Any) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in data.items())


def _json_view(result: Any) -> dict[str, Any]:
    """``--json``: per strategy the metrics per slice with intervals, the comparisons, the
    CPM's learning figures and the plan; the raw per-problem runs stay in results.json."""
    summary = result["summary"]
    return {
        "plan": result["plan"],
        "clients": result["clients"],
        "public_categories": result["public_categories"],
        "test_problems": result["test_problems"],
        "probe_problems": result["probe_problems"],
        "initial_nll": result["initial_nll"],
        **{k: result[k] for k in ("initial_nll_ffa_lora",) if k in result},
        "strategies": summary["strategies"],
        "comparisons": summary["comparisons"],
        "best_collaborative": summary["best_collaborative"],
        "cpm_share_of_oracle_gain": summary["cpm_share_of_oracle_gain"],
        "cpm_share_of_oracle_gain_ci": summary["cpm_share_of_oracle_gain_ci"],
        "cpm_learning": summary["cpm_learning"],
        "curves_nll": {
            name: {seed: run["curve_nll"] for seed, run in runs.items()}
            for name, runs in result["runs"].items()
        },
        "bootstrap": summary["bootstrap"],
        "reused": result["reused"],
        "seconds": result["seconds"],
        "cpu_seconds": result["cpu_seconds"],
    }
