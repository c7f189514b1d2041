"""What one client-round of a plan costs, phase by phase (``peerlm bench experiment-round``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from peerlm.app.experiment_distill import integrate, teacher_answers, teacher_package
from peerlm.app.experiment_eval import final_eval, nll_on_test, validate
from peerlm.app.experiment_plan import Event, ExperimentPlan
from peerlm.app.experiment_run import own_data_steps, shares_track
from peerlm.app.experiment_strategies import COLLABORATIVE
from peerlm.app.experiment_world import (
    OwnMemo,
    build_clients,
    prepare_world,
    round_config,
    warm_up,
)

_R = TypeVar("_R")

#: A final evaluation that takes the own adapter's part from LocalOnly+'s record.
_REPLAYING = "final evaluation, replaying"

__all__ = ["round_costs"]


def round_costs(
    plan: ExperimentPlan, models: Path, data: Path, event: Event, rounds: int = 2
) -> dict[str, Any]:
    """What one client-round of ``plan`` costs, phase by phase (``peerlm bench
    experiment-round``): ``rounds`` rounds of every client, each phase timed on its own, in
    this process on one thread. Every client teaches its successor and learns from its
    predecessor each round, so the AKD and teaching phases count as a student's and a
    teacher's (a pairing strategy has every client a student under ``pairing:
    per_student``, half of them under ``disjoint``, and about half teach); the final
    evaluation is timed twice per client, as LocalOnly+'s (the own adapter alone) and as a
    run's that replays LocalOnly+'s track (:class:`OwnMemo`; only the peer slot's problems
    computed). Returns seconds per phase, per client-round (``per_client_round``: the mean
    over clients of the phases a client-round of a pairing strategy spends) and per client
    (``final``, averaged over the plan's strategies)."""
    from peerlm.agent import local_update

    world = prepare_world(plan, models, data, event)
    if plan.warmup_steps:
        world.warm = warm_up(world, event)
    clients = build_clients(world, plan.seeds[0])
    phases: dict[str, list[float]] = {}

    def timed(name: str, run: Callable[..., _R], *args: Any) -> _R:
        began = time.perf_counter()
        out = run(*args)
        phases.setdefault(name, []).append(time.perf_counter() - began)
        return out

    seed = plan.seeds[0]
    for t in range(1, rounds + 1):
        for i, c in enumerate(clients):
            timed(
                "local steps",
                local_update,
                c.host,
                c.train_examples,
                round_config(plan, seed, i),
                t,
            )
            timed("validation loss", c.host.eval_loss, c.val_examples)
            _pass1, c.competence = timed("validation generation", validate, world, c)
        timed("own-data steps", own_data_steps, world, clients, seed, t)
        for i, student in enumerate(clients):
            teacher = clients[i - 1]
            predictions = timed("teacher answers X_u", teacher_answers, world, teacher, t)
            package, kb = teacher_package(world, teacher, predictions, f"cost-{t}-{i}")
            timed("AKD integration", integrate, world, student, package, kb, seed, i, t)
        for c in clients:
            timed("test NLL curve", nll_on_test, world, c)
    for c in clients:
        # LocalOnly+'s evaluation (the own adapter alone, recorded), then a run's that
        # replays its track: the own adapter's part taken from the record, the slot's run.
        taught = c.slot.saved()
        c.slot.state, c.memo = None, OwnMemo(records=True)
        timed("final evaluation", final_eval, world, c, seed)
        c.slot.restore(taught)
        c.memo = c.memo.replay()
        timed(_REPLAYING, final_eval, world, c, seed)
    n = len(clients) * rounds
    per = {k: sum(v) / n for k, v in phases.items() if k not in ("final evaluation", _REPLAYING)}
    # Averaged over the plan's strategies: in a pairing strategy every client learns in a
    # round (per_student, teachers_per_student lessons each) or half of them (disjoint),
    # about half teach (a teacher answers once a round however many it teaches), LocalOnly+
    # does neither; the own-data steps are every strategy's, or LocalOnly+'s alone in the
    # earlier harness; the curve is measured every curve_every rounds.
    strategies = plan.strategies
    collaborative = sum(st in COLLABORATIVE for st in strategies) / len(strategies)
    # A student of several teachers (teachers_per_student) runs one integration each.
    students = float(plan.lessons_per_student) if plan.pairing == "per_student" else 0.5
    per["teacher answers X_u"] *= collaborative / 2
    per["AKD integration"] *= collaborative * students
    if not plan.own_steps_every_round:
        per["own-data steps"] *= strategies.count("local_plus") / len(strategies)
    # Runs that replay LocalOnly+'s own track train and validate nothing themselves.
    own = sum(not shares_track(plan, st) for st in strategies) / len(strategies)
    for phase in ("local steps", "validation loss", "validation generation", "own-data steps"):
        per[phase] *= own
    per["test NLL curve"] /= plan.curve_every
    per["validation generation"] /= plan.val_every
    total = sum(per.values())
    alone = sum(phases["final evaluation"]) / len(clients)
    replaying = sum(phases[_REPLAYING]) / len(clients)
    final = sum(replaying if shares_track(plan, st) else alone for st in strategies) / len(
        strategies
    )
    runs = len(plan.strategies) * len(plan.seeds)
    cpu = runs * plan.agents * (plan.rounds * total + final)
    return {
        "plan": {k: v for k, v in asdict(plan).items() if k not in ("strategies",)},
        "per_client_round": per,
        "seconds_per_client_round": total,
        "final_seconds_per_client": final,
        "final_alone_seconds_per_client": alone,
        "final_replaying_seconds_per_client": replaying,
        "replays_own_track": any(shares_track(plan, st) for st in strategies),
        "projected_cpu_seconds": cpu,
        "client_rounds": runs * plan.agents * plan.rounds,
    }
