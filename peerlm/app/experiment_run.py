"""One (strategy, seed) run of the experiment: the rounds of Algorithm 3 (local phase, profile,
own-data steps, exchange, test NLL curve), the shared start of the strategies (round 0 and
round 1's local phase) and LocalOnly+'s own track, which the other strategies replay.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec

import numpy as np

from peerlm.app.experiment_eval import finish_run, nll_on_test, slice_means, validate
from peerlm.app.experiment_exchange import exchange, pairing_policy
from peerlm.app.experiment_fedproxy import run_fedproxy
from peerlm.app.experiment_overlay import OverlayView
from peerlm.app.experiment_plan import Event, ExperimentPlan
from peerlm.app.experiment_strategies import (
    FEDPROXY_STRATEGIES,
    MENU_STRATEGIES,
    MERGE_STRATEGIES,
    WITH_OVERLAY,
)
from peerlm.app.experiment_world import Client, OwnMemo, World, build_clients, round_config

if TYPE_CHECKING:
    from peerlm.agent import Competence

__all__ = [
    "LocalPhase",
    "OwnRound",
    "Start",
    "Track",
    "cpu_seconds",
    "local_phase",
    "own_data_steps",
    "run_strategy",
    "shares_track",
    "strategy_start",
]


def own_data_steps(world: World, clients: Sequence[Client], seed: int, t: int) -> None:
    """LocalOnly+'s extra own-data steps of round ``t``, on every client's own adapter."""
    plan = world.plan
    for i, c in enumerate(clients):
        config = round_config(plan, seed, i)
        c.host.train_local(
            c.train_examples, config.train_settings(t), steps=plan.exchange_own_steps
        )
        c.own_steps += plan.exchange_own_steps


@dataclass(frozen=True)
class LocalPhase:
    """One client's local phase of a round: adapter after it, and what it measured."""

    adapter: dict[str, Any]
    train_loss: float
    val_loss: float
    val_pass1: float
    competence: Competence


@dataclass(frozen=True)
class OwnRound:
    """One client's own track in one round: its local phase, and its own adapter after the
    round's own-data steps. Under ``integration="separate"`` with ``own_steps_every_round``
    nothing a peer sends touches the own adapter, so it is the same in every strategy of a
    seed (LocalOnly+'s): computed once, by LocalOnly+'s run, and replayed by the others."""

    phase: LocalPhase
    trained: dict[str, Any]
    #: What the own adapter computed in LocalOnly+'s run (its evaluations), filled to the
    #: end of that run: the replaying runs reuse it instead of computing it again.
    memo: OwnMemo | None = None


#: Per round (index t - 1), every client's :class:`OwnRound`.
Track = list[dict[str, OwnRound]]


def shares_track(plan: ExperimentPlan, strategy: str) -> bool:
    """Whether ``strategy`` replays LocalOnly+'s own track (:class:`OwnRound`) instead of
    training its clients' own adapters again."""
    return (
        plan.integration == "separate"
        and plan.own_steps_every_round
        and "local_plus" in plan.strategies
        and strategy not in ("local", "local_plus", *MERGE_STRATEGIES, *FEDPROXY_STRATEGIES)
    )


def local_phase(world: World, c: Client, seed: int, i: int, t: int) -> LocalPhase:
    from peerlm.agent import local_update

    plan = world.plan
    stats = local_update(c.host, c.train_examples, round_config(plan, seed, i), t)
    loss, _ = c.host.eval_loss(c.val_examples)
    if (t - 1) % plan.val_every and c.competence is not None:
        # Not a validation round: the competence stands, and the profile carries the last
        # measured pass@1 forward (round_profile's rule for a round without one).
        return LocalPhase(c.host.adapter_state(), stats.mean_loss, loss, math.nan, c.competence)
    pass1, competence = validate(world, c)
    return LocalPhase(c.host.adapter_state(), stats.mean_loss, loss, pass1, competence)


def _first_local_phase(world: World, seed: int, *, ffa: bool = False) -> dict[str, LocalPhase]:
    """Round 1's local phase, the same for every strategy of a seed (same adapters, data and
    batches): computed once and handed to each strategy (ffa_lora's, ``ffa``, on its own
    start)."""
    clients = build_clients(world, seed, ffa=ffa)
    return {c.name: local_phase(world, c, seed, i, 1) for i, c in enumerate(clients)}


@dataclass(frozen=True)
class Start:
    """What the strategies of one start share: round 0's test NLL per client and round 1's
    local phase per run seed. ffa_lora has its own (:mod:`peerlm.app.experiment_world`)."""

    initial: Mapping[str, Sequence[float]]
    firsts: Mapping[int, Mapping[str, LocalPhase]]


def strategy_start(world: World, *, ffa: bool = False, firsts: bool = True) -> Start:
    """Round 0's NLL, and (``firsts``) round 1's local phase per seed; without ``firsts``
    each run computes its own round 1 (LocalOnly+'s track then carries it to the others)."""
    plan = world.plan
    initial = {c.name: nll_on_test(world, c) for c in build_clients(world, plan.seeds[0], ffa=ffa)}
    phases = (
        {seed: _first_local_phase(world, seed, ffa=ffa) for seed in plan.seeds}
        if firsts
        else {seed: {} for seed in plan.seeds}
    )
    return Start(initial, phases)


_P = ParamSpec("_P")


def cpu_seconds() -> float:
    """This process's CPU time (all threads) and its waited-for children's."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _with_cpu_seconds(
    run: Callable[_P, dict[str, Any]],
) -> Callable[_P, dict[str, Any]]:
    """A run's result with the CPU seconds its process and its finished child processes
    (the sandbox runs of the tests) spent on it, every thread: on a loaded machine the wall
    time says little about the budget on idle cores, the CPU time does."""

    @functools.wraps(run)
    def timed(*args: _P.args, **kwargs: _P.kwargs) -> dict[str, Any]:
        cpu = cpu_seconds()
        out = run(*args, **kwargs)
        out["cpu_seconds"] = round(cpu_seconds() - cpu, 1)
        return out

    return timed


@_with_cpu_seconds
def run_strategy(
    world: World,
    strategy: str,
    seed: int,
    initial: Mapping[str, Sequence[float]],
    first: Mapping[str, LocalPhase],
    event: Event,
    track: Track | None = None,
    record: Track | None = None,
) -> dict[str, Any]:
    """One (strategy, seed) run. With ``track`` (LocalOnly+'s own track of this seed) the
    clients' own adapters replay it instead of training; with ``record`` the run appends
    its own track to it, round by round."""
    from peerlm.agent import ProfileInputs, category_counts, round_profile

    if strategy in FEDPROXY_STRATEGIES:
        return run_fedproxy(world, strategy, seed, event)
    plan = world.plan
    clients = build_clients(world, seed, ffa=strategy == "ffa_lora")
    for c in clients:
        if record is not None:
            c.memo = OwnMemo(records=True)
        elif track is not None and (recorded := track[-1][c.name].memo) is not None:
            c.memo = recorded.replay()
    policy = pairing_policy(strategy, plan, seed)
    overlay = OverlayView.defaults() if strategy in WITH_OVERLAY else None
    if overlay is not None:
        # An agent publishes its first signature when it joins, before its first round.
        overlay.join({c.name: c.host for c in clients})
    rounds: list[dict[str, Any]] = []
    start = slice_means(world, {i: initial[c.name] for i, c in enumerate(clients)})
    curve = {name: [value] for name, value in start.items()}
    curve_rounds = [0]
    started = time.perf_counter()
    for t in range(1, plan.rounds + 1):
        profiles: dict[str, np.ndarray] = {}
        trained: dict[str, float] = {}
        phases: dict[str, LocalPhase] = {}
        for i, c in enumerate(clients):
            if track is not None:
                phase = track[t - 1][c.name].phase
                c.host.load_adapter_state(phase.adapter)
            elif t == 1 and c.name in first:
                phase = first[c.name]
                c.host.load_adapter_state(phase.adapter)
            else:
                phase = local_phase(world, c, seed, i, t)
            phases[c.name] = phase
            trained[c.name] = phase.train_loss
            c.own_steps += plan.local_steps
            c.competence = phase.competence
            profile, pass1 = round_profile(
                c.host,
                ProfileInputs(
                    t=t,
                    total_rounds=plan.rounds,
                    val_loss=phase.val_loss,
                    pass_at_1=phase.val_pass1,
                    last_reward=c.rewards[-1] if c.rewards else 0.0,
                    exchanges=c.exchanges,
                ),
                c.history,
                category_counts(c.train),
                seed=seed + i,
            )
            c.history.append({"round": t, "loss": phase.val_loss, "pass1": pass1})
            profiles[c.name] = profile
        if strategy == "local_plus" or (plan.own_steps_every_round and strategy != "local"):
            # LocalOnly+: the compute a student spends on AKD, spent on the client's own
            # data instead. Every collaborating client spends the same steps on its own data
            # too (an agent keeps training whatever its role), before it teaches or learns.
            if track is not None:
                for c in clients:
                    c.host.load_adapter_state(track[t - 1][c.name].trained)
                    c.own_steps += plan.exchange_own_steps
            else:
                own_data_steps(world, clients, seed, t)
            if record is not None:
                record.append(
                    {
                        c.name: OwnRound(phases[c.name], c.host.adapter_state(), c.memo)
                        for c in clients
                    }
                )
        exchanges, gains = exchange(
            world, strategy, policy, clients, profiles, seed, t, overlay=overlay
        )
        nll: dict[str, float] | None = None
        if t % plan.curve_every == 0 or t == plan.rounds:
            nll = slice_means(world, {i: nll_on_test(world, c) for i, c in enumerate(clients)})
            curve_rounds.append(t)
            for name in curve:
                curve[name].append(nll[name])
        rounds.append(
            {
                "round": t,
                "train_loss": {k: round(v, 5) for k, v in trained.items()},
                "val_loss": {c.name: round(c.history[-1]["loss"], 5) for c in clients},
                "val_pass@1": {c.name: c.history[-1]["pass1"] for c in clients},
                # What a matchmaker saw (for analyses of what the CPM could learn).
                "profiles": {k: [round(float(x), 6) for x in v] for k, v in profiles.items()},
                "test_nll": nll,
                "exchanges": exchanges,
                **({"oracle_gains": gains} if gains is not None else {}),
                **(
                    {"protocols": _protocol_counts(exchanges)}
                    if strategy in MENU_STRATEGIES
                    else {}
                ),
            }
        )
        event(
            "round",
            {
                "strategy": strategy,
                "seed": seed,
                "round": t,
                "nll": nll,
                **(
                    {"protocols": _protocol_counts(exchanges)}
                    if strategy in MENU_STRATEGIES
                    else {}
                ),
            },
        )
    return finish_run(
        world, clients, strategy, seed, rounds, curve, started, event, curve_rounds=curve_rounds
    )


def _protocol_counts(exchanges: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many of a round's directives named each protocol (the CPM menu strategies)."""
    counts: dict[str, int] = {}
    for x in exchanges:
        counts[x["protocol"]] = counts.get(x["protocol"], 0) + 1
    return counts
