"""The world a ``peerlm run-experiment`` run happens in: the data, models and warm start
(:class:`World`, built once per plan), and the clients of one run seed (:class:`Client`).

FFA-LoRA's start. The warm-up (:func:`warm_up`) trains A, and each client's A differs, so ffa_lora
cannot start from it. Its clients run their own warm-up, once per world: the same steps,
data and batch seeds, with the family's shared A frozen (every client loads its adapter
from the one seed, the world seed); its round 0 and round-1 local phase are measured on
that start. Re-initialising A under the warmed-up B would throw the warm-up away (B_i was
trained against A_i); the frozen-A warm-up is what an organisation joining an FFA-LoRA
federation does locally. The cost is one more warm-up per world when ffa_lora runs
(``docs/experiment.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from peerlm.app.experiment_plan import Event, ExperimentPlan
from peerlm.app.experiment_slices import ClientSlices, slices_of_world

if TYPE_CHECKING:
    from peerlm.agent import (
        Competence,
        Guardrail,
        InputRouter,
        ModelHost,
        PeerSlot,
        Problem,
        RoundConfig,
    )

__all__ = [
    "Client",
    "OwnMemo",
    "World",
    "build_clients",
    "prepare_world",
    "round_config",
    "warm_up",
]


_R = TypeVar("_R")


class _HasPrompt(Protocol):
    @property
    def prompt(self) -> str: ...


_P2 = TypeVar("_P2", bound=_HasPrompt)


def _new_slot() -> PeerSlot:
    from peerlm.agent import PeerSlot

    return PeerSlot()


@dataclass
class OwnMemo:
    """What a client's own adapter computed in LocalOnly+'s run of a seed, for the runs that
    replay its own track (:class:`~peerlm.app.experiment_run.OwnRound`).

    Their own adapter is LocalOnly+'s, bit for bit, and it answers every evaluated item
    (:meth:`Client.routed`, common random numbers), so what it computed there is what it
    would compute again: ``results`` holds each keyed computation's results under the key,
    the items' prompts and the own adapter's :func:`~peerlm.agent.state_digest` (a replay
    whose own adapter differs finds nothing and computes), and ``outcomes`` the sandbox's
    status of each program run under the experiment's limits.
    """

    results: dict[str, list[Any]] = field(default_factory=dict)
    outcomes: dict[str, Any] = field(default_factory=dict)
    records: bool = False
    #: Keyed computations a replay found here instead of running.
    reused: int = 0

    def replay(self) -> OwnMemo:
        """A copy a replaying run reads (and adds its own sandbox outcomes to)."""
        return OwnMemo(dict(self.results), dict(self.outcomes))


@dataclass
class Client:
    name: str
    arch: str
    host: ModelHost
    train: list[Problem]
    val: list[Problem]
    guardrail: Guardrail
    history: list[dict[str, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    exchanges: int = 0
    # Greedy validation pass counts per category of the last local phase (what the client
    # may teach: :mod:`peerlm.agent.exchange.teaching`); None before the first.
    competence: Competence | None = None
    # What peers sent, beside the own adapter, and which inputs it answers
    # (``plan.integration == "separate"``; :mod:`peerlm.agent.exchange.peer_knowledge`).
    slot: PeerSlot = field(default_factory=_new_slot)
    router: InputRouter | None = None
    # Optimiser steps spent on own data and on distillation or merging (per client, the
    # compute each strategy spends; part of the run's record).
    own_steps: int = 0
    peer_steps: int = 0
    # As teacher with ``teach_self_check``: answers run against their prompt's example,
    # and those that failed it (not sent).
    self_checked: int = 0
    self_check_failed: int = 0
    # What it answered of X_u as a teacher, and in which round: one generation a round,
    # however many students it teaches (:func:`~peerlm.app.experiment_distill.teacher_answers`).
    answered: tuple[int, tuple[list[int], list[str]]] | None = None
    #: LocalOnly+'s own computations: recorded by its run, read by the replaying ones.
    memo: OwnMemo | None = None

    def integrating(self, plan: ExperimentPlan, what: str = "integration") -> Any:
        """Where an integration writes: the peer slot (``separate``) or the one adapter."""
        if plan.integration == "separate":
            return self.slot.active(self.host, what)
        return contextlib.nullcontext()

    def integrate(
        self, plan: ExperimentPlan, what: str, fn: Callable[..., _R], /, *args: Any, **kw: Any
    ) -> _R:
        """The integration ``fn(*args, **kw)`` where it writes: through the daemon's slot
        runner under ``separate`` (:func:`~peerlm.agent.peer_integration.in_slot`, the slot's
        rehearsal included), on the one adapter otherwise."""
        from peerlm.agent import in_slot

        if plan.integration == "separate":
            return in_slot(self.slot, self.host, what, fn, *args, **kw)
        return fn(*args, **kw)

    def slot_learns(self, plan: ExperimentPlan) -> Callable[[Sequence[str]], Sequence[bool]] | None:
        """What the peer slot distils of a package (every item, or with ``slot_scope:
        routed`` the router's peer side); None without a slot (``integration: shared``)."""
        from peerlm.agent import slot_learns

        if plan.integration != "separate":
            return None
        return slot_learns(self.router, plan.slot_scope)

    def routed(
        self,
        problems: Sequence[_P2],
        run: Callable[[Sequence[_P2]], Sequence[_R]],
        key: str | None = None,
        choose: Callable[[Sequence[_P2], Sequence[_R], Sequence[_R]], Sequence[_R]] | None = None,
    ) -> list[_R]:
        """``run`` over ``problems``, each answered by the adapter the router picks. With
        ``key`` (naming the computation and every parameter of ``run``) and a
        :class:`OwnMemo`, the own adapter's results are recorded, or read instead of run.
        ``choose``: :func:`~peerlm.agent.exchange.peer_knowledge.route_map`'s."""
        from peerlm.agent import route_map, state_digest

        memo = self.memo if key is not None else None
        memo_key, own = "", None
        if memo is not None:
            prompts = hashlib.sha256("\0".join(p.prompt for p in problems).encode()).hexdigest()
            memo_key = f"{key}|{prompts}|{state_digest(self.host.adapter_state())}"
            own = memo.results.get(memo_key)
            memo.reused += own is not None
        # The own adapter answers every problem as LocalOnly+'s does (same batches, same
        # draws), so a problem it keeps is compared with common random numbers.
        out = route_map(
            self.host,
            self.slot,
            self.router,
            problems,
            lambda p: p.prompt,
            run,
            own_runs_all=True,
            own_results=own,
            choose=choose,
        )
        if memo is not None and memo.records and own is None and not self.slot.ready:
            memo.results[memo_key] = list(out)
        return out

    @property
    def train_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.train]

    @property
    def val_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.val]


@dataclass
class World:
    plan: ExperimentPlan
    models: Path
    clients_data: list[tuple[list[Problem], list[Problem]]]
    transfer: list[str]
    transfer_sha256: str
    test: list[Problem]
    probe: list[Problem]
    slices: list[ClientSlices]
    public: tuple[str, ...]
    # D_pub of OnePeFT's HKA: the public categories' transfer problems with references.
    public_pairs: list[tuple[str, str]] = field(default_factory=list)
    # Each client's adapter after the warm-up (by client name); empty without one.
    warm: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The same after ffa_lora's warm-up (shared A, frozen); empty unless ffa_lora runs.
    ffa_warm: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The category of each prompt of ``transfer`` (what a competent teacher selects by).
    transfer_categories: list[str] = field(default_factory=list)
    # Each client's guardrail and input router, by client index, once built in this
    # process: functions of the world's data alone and immutable, while every strategy and
    # seed builds the same clients again (28 of a micro --quick run's 94 CPU s were rebuilds).
    guardrails: dict[int, Guardrail] = field(default_factory=dict, repr=False, compare=False)
    routers: dict[int, InputRouter] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # What goes to a worker process: a guardrail holds a bound logger, which does not
        # pickle, so each worker builds its own (the routers travel).
        return {**self.__dict__, "guardrails": {}}

    def teachable(self, client: Client, t: int = 1) -> list[int]:
        """Indices of the X_u prompts ``client`` answers as a teacher in round ``t``
        (``teach_scope``; at most ``teach_limit`` of them, a window that moves on each
        round so that the rounds cover them all)."""
        from peerlm.agent import teachable_indices

        chosen = teachable_indices(
            self.transfer_categories,
            client.competence,
            scope=self.plan.teach_scope,
            min_pass=self.plan.teach_min_pass,
        )
        limit = self.plan.teach_limit
        if limit is None or len(chosen) <= limit:
            return chosen
        start = ((t - 1) * limit) % len(chosen)
        return sorted((chosen + chosen)[start : start + limit])

    @property
    def probe_examples(self) -> list[tuple[str, str]]:
        return [(p.prompt, p.reference) for p in self.probe]

    def units(self, slice_name: str) -> list[tuple[int, int]]:
        """(client index, test problem index) of ``slice_name``, in a fixed order."""
        return [
            (i, j)
            for i, sl in enumerate(self.slices)
            for j, p in enumerate(self.test)
            if sl.of(p.category) == slice_name
        ]


def prepare_world(plan: ExperimentPlan, models: Path, data: Path, event: Event) -> World:
    from peerlm.agent import (
        CATEGORIES,
        build_federation_data,
        build_models,
        probe_problems,
        read_jsonl,
        read_manifest,
        transfer_set_sha256,
    )

    archs = tuple(dict.fromkeys(plan.arch(i) for i in range(plan.agents)))

    def on_build(e: Any) -> None:
        if e.phase == "pretrain" or e.finished:
            event(
                "build",
                {"arch": e.arch, "phase": e.phase, "step": e.step, "total": e.total,
                 "finished": e.finished},
            )  # fmt: skip

    build_models(models, archs, size=plan.size, seed=plan.model_seed, progress=on_build)
    build_federation_data(
        data,
        plan.agents,
        alpha=plan.alpha,
        seed=plan.world_seed,
        world=plan.world_spec(),
        overwrite=True,
    )
    clients = [
        (
            read_jsonl(data / "clients" / str(i) / "train.jsonl"),
            read_jsonl(data / "clients" / str(i) / "val.jsonl"),
        )
        for i in range(plan.agents)
    ]
    transfer_problems = read_jsonl(data / "transfer.jsonl")
    transfer = [p.prompt for p in transfer_problems][: plan.transfer_limit]
    all_test = read_jsonl(data / "test.jsonl")
    test = all_test[: plan.test_limit]
    categories = list(dict.fromkeys([*CATEGORIES, *(p.category for p in all_test)]))
    world = read_manifest(data).world
    public = world.public_categories
    slices = [slices_of_world(world, i) for i in range(plan.agents)]
    taken = [*all_test, *transfer_problems, *(p for tr, va in clients for p in (*tr, *va))]
    probe = probe_problems(plan.probe_per_category, plan.world_seed, taken, categories)
    return World(
        plan,
        models,
        clients,
        transfer,
        transfer_set_sha256(transfer),
        test,
        probe,
        slices,
        public,
        [(p.prompt, p.reference) for p in transfer_problems if p.category in public],
        transfer_categories=[p.category for p in transfer_problems][: plan.transfer_limit],
    )


def build_clients(
    world: World,
    seed: int,
    *,
    ffa: bool = False,
    only: int | None = None,
    routers: bool = True,
) -> list[Client]:
    """The clients of run seed ``seed`` on their warm start. With ``ffa`` (FFA-LoRA) every
    client's adapter is initialised from ``seed`` itself, so a family shares one A, its A is
    frozen, and the warm start is ffa_lora's own (module docstring). ``only``: client
    ``only`` alone; ``routers`` False: no input routers (nothing will be routed)."""
    from peerlm.agent import Guardrail, LoraSettings, ModelHost

    plan = world.plan
    warm = world.ffa_warm if ffa else world.warm
    out = []
    for i, (train, val) in enumerate(world.clients_data):
        if only is not None and i != only:
            continue
        arch = plan.arch(i)
        host = ModelHost.load(
            world.models / arch,
            LoraSettings(r=plan.lora_rank),
            device="cpu",
            seed=seed if ffa else seed + i,
        )
        host.frozen_lora_a = ffa
        if i not in world.guardrails:
            world.guardrails[i] = Guardrail(
                [p.prompt + p.reference for p in train], public_texts=world.transfer
            )
        guard = world.guardrails[i]
        name = f"agent-{i}"
        if name in warm:
            host.load_adapter_state(warm[name])
        client = Client(name, arch, host, train, val, guard)
        client.slot.rehearsal, client.slot.seed = plan.slot_rehearsal, seed + i
        if plan.integration == "separate" and routers:
            if i not in world.routers:
                world.routers[i] = _router(world, train, val)
            client.router = world.routers[i]
            if plan.slot_banks == "category":
                client.slot.classify = client.router.unheld_category
        out.append(client)
    return out


def _router(world: World, train: Sequence[Problem], val: Sequence[Problem]) -> InputRouter:
    """A client's input router (:class:`~peerlm.agent.exchange.peer_knowledge.InputRouter`): its own
    training prompts and X_u's by category, calibrated on its own validation prompts."""
    from peerlm.agent import InputRouter

    return InputRouter.fit(
        [p.prompt for p in train],
        world.transfer,
        [p.prompt for p in val] or [p.prompt for p in train],
        own_categories=[p.category for p in train],
        other_categories=world.transfer_categories,
    )


def warm_up(
    world: World, event: Event, *, ffa: bool = False, jobs: int = 1
) -> dict[str, dict[str, Any]]:
    """Every client's adapter after ``warmup_steps`` on its own data, once per world.

    Seeded by the world seed, not the run seed: the warmed-up models are part of the world
    the federation starts from (as the built models are), so every run seed and strategy
    starts from the same experts and the seeds vary only what the federation does. With
    ``ffa``, ffa_lora's warm-up: the same steps and batches with the family's shared A
    frozen (module docstring).
    """
    plan = world.plan
    if plan.warmup_steps == 0:
        return {}
    out: dict[str, dict[str, Any]] = {}
    clients = range(plan.agents)
    if jobs > 1:
        # The clients warm up apart: one process each, the cores busy from the start.
        import multiprocessing
        import os
        from concurrent.futures import ProcessPoolExecutor

        import torch

        from peerlm.process import exit_with_parent

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(jobs, plan.agents),
            mp_context=ctx,
            initializer=exit_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            futures = [
                pool.submit(_warm_one, world, i, ffa, torch.get_num_threads()) for i in clients
            ]
            done = [f.result() for f in futures]
    else:
        done = [_warm_one(world, i, ffa) for i in clients]
    for name, state, loss in done:
        out[name] = state
        event("warmup", {"client": name, "steps": plan.warmup_steps, "loss": loss, "ffa": ffa})
    return out


def _warm_one(
    world: World, i: int, ffa: bool, threads: int | None = None
) -> tuple[str, dict[str, Any], float]:
    """Client ``i``'s warm-up (:func:`warm_up`): its name, adapter and mean loss."""
    from peerlm.agent import TrainSettings

    if threads is not None:  # in a worker process
        import torch

        torch.set_num_threads(threads)
    plan = world.plan
    [c] = build_clients(world, plan.world_seed, ffa=ffa, only=i, routers=False)
    settings = TrainSettings(
        learning_rate=plan.learning_rate,
        grad_accumulation=plan.grad_accumulation,
        seed=plan.world_seed * 1_009 + i,
    )
    stats = c.host.train_local(c.train_examples, settings, steps=plan.warmup_steps)
    return c.name, c.host.adapter_state(), stats.mean_loss


def round_config(
    plan: ExperimentPlan, seed: int, i: int, *, integration: bool = False
) -> RoundConfig:
    """Client ``i``'s round configuration; with ``integration`` its ``local_steps`` are the
    AKD integration's steps (``plan.integration_steps``). Under a peer slot it carries
    ``plan.slot_learning_rate``, which an integration applies itself
    (:meth:`~peerlm.agent.exchange.rounds.RoundConfig.integrating`, as the agent's
    protocols do with theirs)."""
    from peerlm.agent import RoundConfig, TrainSettings

    config = RoundConfig(
        total_rounds=plan.rounds,
        train=TrainSettings(
            learning_rate=plan.learning_rate,
            grad_accumulation=plan.grad_accumulation,
            seed=seed + i,
        ),
        local_steps=plan.integration_steps if integration else plan.local_steps,
        reward_delta=plan.reward_delta,
        max_new_tokens=plan.max_new_tokens,
        slot_learning_rate=plan.slot_learning_rate if plan.integration == "separate" else None,
    )
    if plan.integration == "separate" and plan.peer_alpha is not None:
        config = dataclasses.replace(
            config, alpha_kd_start=plan.peer_alpha, alpha_kd_end=plan.peer_alpha
        )
    return config
