"""``peerlm run-experiment``: the KNEXA-FL comparison (Table 4) with real tiny models.

Pairing strategies run the same rounds on the same world, models and seeds, in one process
over :class:`~peerlm.agent.modelhost.ModelHost` instances. Every model operation is the
agent daemon's own (:mod:`peerlm.agent.exchange.rounds`: local update, teacher predictions,
guardrailed packages encoded and decoded as on the wire, AKD per Eq. 2 with the Table 6
schedule, the reward); only the transport is missing. The strategies and what each does are
listed in :mod:`~peerlm.app.experiment_strategies`.

D_pub of HKA is the transfer problems of the *public* categories with their references
(public in this world, like Alpaca for the paper); the private categories' references are
never used.

Round t (Algorithm 3): every client trains locally, measures validation loss and pass@1
and forms its profile p_i (as the daemon does); the strategy pairs clients; each student
integrates its teacher's package and its reward goes back to the strategy; then every
client's per-problem NLL of the test references is recorded per slice (the per-round
curves). After the last round each client draws ``samples`` completions per test problem
at ``sample_temperature``: unbiased pass@1 (Chen et al. 2021), structural match and NLL per
problem, reported on three slices per client (:mod:`peerlm.app.experiment_slices`) with
paired bootstrap intervals over seeds and problems (:mod:`peerlm.app.experiment_stats`).

The reward. ``reward="val"`` is Eq. 3 as the paper defines it: L_pre and L_post on the
student's own validation data. ``reward="probe"`` (our choice beyond the paper) measures
L_pre and L_post on a small labelled public *probe set* covering every category, so a
teacher's gain on skills the student lacks shows in the reward; the KB penalty is the same.

Seeds. The *world seed* fixes the data (client split, transfer, test and probe sets), the
*model seed* the built models (0, as the shared model cache); each *run seed* fixes the
initial adapters (client i: ``seed + i``), the batches of round t, the random pairing and
the samples. Several run seeds reuse one world
and one set of models, so no model is rebuilt, and every strategy sees the same units
(client, test problem) under every seed: the bootstrap pairs over them.

Where the pieces live: the strategies (:mod:`~peerlm.app.experiment_strategies`), the plan
(:mod:`~peerlm.app.experiment_plan`), the world and its clients
(:mod:`~peerlm.app.experiment_world`), a round's exchange
(:mod:`~peerlm.app.experiment_exchange`, :mod:`~peerlm.app.experiment_distill`,
:mod:`~peerlm.app.experiment_merge`), a (strategy, seed) run
(:mod:`~peerlm.app.experiment_run`, :mod:`~peerlm.app.experiment_workers`), the evaluation
(:mod:`~peerlm.app.experiment_eval`), reused runs (:mod:`~peerlm.app.experiment_reuse`) and
the result (:mod:`~peerlm.app.experiment_summary`, :mod:`~peerlm.app.experiment_report`).
This module runs a plan and is the harness's public face.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from peerlm.app.experiment_costs import round_costs
from peerlm.app.experiment_distill import consensus_texts
from peerlm.app.experiment_eval import slice_means
from peerlm.app.experiment_plan import (
    WORKER_MEMORY_BYTES,
    Event,
    ExperimentPlan,
    ProbeScope,
    RewardMode,
    default_jobs,
    parse_strategies,
    quick_plan,
)
from peerlm.app.experiment_report import render_table, write_outputs
from peerlm.app.experiment_reuse import (
    ADAPTER_KILOBYTES,
    COLLABORATION_HARNESS,
    PROGRESS_FILE,
    reusable_runs,
    save_progress,
)
from peerlm.app.experiment_run import (
    Start,
    Track,
    cpu_seconds,
    run_strategy,
    shares_track,
    strategy_start,
)
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_strategies import (
    ARCHS,
    COLLABORATIVE,
    COMPARISONS,
    CPM_PROTOCOLS,
    DEFAULT_STRATEGIES,
    FEDPROXY_STRATEGIES,
    KNOWN_STRATEGIES,
    LABELS,
    MENU_STRATEGIES,
    MERGE_STRATEGIES,
    METRICS,
    OVERLAY_STRATEGIES,
    STRATEGIES,
)
from peerlm.app.experiment_summary import summarise
from peerlm.app.experiment_workers import records_track, run_parallel, schedule
from peerlm.app.experiment_world import prepare_world, warm_up

__all__ = [
    "ARCHS",
    "COLLABORATIVE",
    "COMPARISONS",
    "CPM_PROTOCOLS",
    "DEFAULT_STRATEGIES",
    "KNOWN_STRATEGIES",
    "LABELS",
    "MENU_STRATEGIES",
    "MERGE_STRATEGIES",
    "METRICS",
    "OVERLAY_STRATEGIES",
    "PROGRESS_FILE",
    "STRATEGIES",
    "WORKER_MEMORY_BYTES",
    "Event",
    "ExperimentPlan",
    "ProbeScope",
    "RewardMode",
    "consensus_texts",
    "default_jobs",
    "parse_strategies",
    "quick_plan",
    "render_table",
    "reusable_runs",
    "round_costs",
    "run_experiment",
    "summarise",
    "write_outputs",
]


def run_experiment(
    plan: ExperimentPlan,
    *,
    models: Path,
    work: Path,
    event: Event | None = None,
    jobs: int = 1,
    reuse: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Run every strategy of ``plan`` under every run seed; results as a JSON-ready dict
    with the bootstrap summary (:func:`summarise`) under ``"summary"``.

    ``jobs > 1`` runs (strategy, seed) pairs in that many worker processes; results are the
    same (every run is seeded on its own), only the wall time changes. ``reuse``: earlier
    results (``results.json``) whose runs of the same plan, world and models stand in for
    running them again (:func:`reusable_runs`); the result lists them under ``"reused"``.

    ``work`` is held for the whole run (:func:`~peerlm.app.work_lock.work_dir_lock`): a
    second run in the same directory raises ``WorkDirBusy`` at once rather than rebuild the
    first one's world under it.
    """
    from peerlm.app.work_lock import work_dir_lock

    with work_dir_lock(work):
        return _run_experiment(plan, models, work, event, jobs, reuse)


def _run_experiment(
    plan: ExperimentPlan,
    models: Path,
    work: Path,
    event: Event | None,
    jobs: int,
    reuse: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    emit = event or (lambda _kind, _data: None)
    started, cpu_started = time.perf_counter(), cpu_seconds()
    world = prepare_world(plan, models, work / "data", emit)
    # Round 0: the pre-trained models with fresh adapters (LoRA B = 0), or the warmed-up
    # ones: the same for every strategy and seed; measured once. Round 1's local phase once
    # per seed. ffa_lora starts from its own warm-up (frozen shared A). The FedProxy
    # strategies start from the owner's proxy (experiment_fedproxy) and need neither.
    adapters = [s for s in plan.strategies if s not in FEDPROXY_STRATEGIES]
    none = Start({}, {seed: {} for seed in plan.seeds})
    starts = dict.fromkeys(plan.strategies, none)
    common = none
    initial_nll: dict[str, float] = {}
    if adapters:
        world.warm = warm_up(world, emit, jobs=jobs)
        # With LocalOnly+'s track replayed, every run computes its own round 1 (in the
        # workers, not here in the main process alone).
        common = strategy_start(
            world, firsts=not any(shares_track(plan, s) for s in plan.strategies)
        )
        initial_nll = slice_means(world, dict(enumerate(common.initial.values())))
        emit("initial", initial_nll)
        starts.update(dict.fromkeys(adapters, common))
    ffa: Start | None = None
    if "ffa_lora" in plan.strategies:
        world.ffa_warm = warm_up(world, emit, ffa=True, jobs=jobs)
        ffa = starts["ffa_lora"] = strategy_start(world, ffa=True)
    runs = reusable_runs(plan, reuse, initial_nll)
    for strategy, seed in runs:
        emit("reused", {"strategy": strategy, "seed": seed})
    todo = [(s, seed) for seed in plan.seeds for s in plan.strategies if (s, seed) not in runs]

    def finished(key: tuple[str, int], run: dict[str, Any]) -> None:
        runs[key] = run
        save_progress(work, plan, initial_nll, runs)

    if jobs > 1 and len(todo) > 1:
        run_parallel(world, starts, todo, jobs, emit, finished)
    else:
        ready, waits = schedule(plan, todo)
        tracks: dict[tuple[str, int], Track] = {}
        for s, seed in [*ready, *waits]:
            record: Track | None = [] if records_track(plan, s) else None
            run = run_strategy(
                world,
                s,
                seed,
                starts[s].initial,
                starts[s].firsts[seed],
                emit,
                track=tracks.get(waits[(s, seed)]) if (s, seed) in waits else None,
                record=record,
            )
            if record is not None:
                tracks[(s, seed)] = record
            finished((s, seed), run)
    result: dict[str, Any] = {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "models": str(models),
        "clients": [
            {
                "name": f"agent-{i}",
                "arch": plan.arch(i),
                "train": len(train),
                "val": len(val),
                "slices": world.slices[i].to_dict(),
            }
            for i, (train, val) in enumerate(world.clients_data)
        ],
        "public_categories": list(world.public),
        "transfer_prompts": len(world.transfer),
        "probe_problems": len(world.probe),
        "probe_categories": [p.category for p in world.probe],
        "test_problems": len(world.test),
        "units": {name: [list(u) for u in world.units(name)] for name in SLICES},
        "initial_nll": initial_nll,
        **(
            {"initial_nll_ffa_lora": slice_means(world, dict(enumerate(ffa.initial.values())))}
            if ffa is not None
            else {}
        ),
        "runs": {s: {str(seed): runs[(s, seed)] for seed in plan.seeds} for s in plan.strategies},
        "reused": sorted(f"{s}:{seed}" for s, seed in runs if (s, seed) not in todo),
        "adapter_kilobytes": ADAPTER_KILOBYTES,
        "collaboration_harness": COLLABORATION_HARNESS,
        "seconds": round(time.perf_counter() - started, 1),
        # What this command computed (reused runs not included; the worker processes are
        # joined by now, so their time is among this process's children's): the budget on
        # idle cores is about cpu_seconds / cores when the runs keep every core busy.
        "cpu_seconds": round(cpu_seconds() - cpu_started, 1),
    }
    result["summary"] = summarise(result)
    return result
