"""One round's exchange phase of the experiment: the pairing policy of a strategy (random,
heuristic, the CPM's LinUCB) and the dispatch from a strategy's name to what its clients
do (distillation, merges, the CPM over the protocol menu, the overlay step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from peerlm.app.experiment_agent import InProcessCpm, InProcessFederation
from peerlm.app.experiment_distill import central_kd, oracle_exchange, teacher_answers
from peerlm.app.experiment_merge import merge_exchange, semantic_dfl_exchange
from peerlm.app.experiment_overlay import OverlayView
from peerlm.app.experiment_plan import ExperimentPlan
from peerlm.app.experiment_strategies import (
    CPM_PROTOCOLS,
    MENU_STRATEGIES,
    MERGE_STRATEGIES,
    OVERLAY_STRATEGIES,
)
from peerlm.app.experiment_world import Client, World, round_config
from peerlm.protocols import DEFAULT_PROTOCOL, lookup

if TYPE_CHECKING:
    from peerlm.services.cpm import Pairing

__all__ = ["exchange", "pairing_policy"]


def pairing_policy(strategy: str, plan: ExperimentPlan, seed: int) -> Any:
    from peerlm.services.cpm import CpmSettings, HeteroGreedyMatchmaker, RandomMatchmaker

    if strategy == "random":
        return RandomMatchmaker(
            seed=seed,
            pairing=plan.pairing,
            teacher_capacity=plan.teacher_capacity,
            teachers_per_student=plan.lessons_per_student,
        )
    if strategy == "heuristic":
        return HeteroGreedyMatchmaker()
    if strategy in CPM_PROTOCOLS:
        s: CpmSettings = plan.cpm_settings(seed, CPM_PROTOCOLS[strategy])
        return s.new_matchmaker()
    return None


def exchange(
    world: World,
    strategy: str,
    policy: Any,
    clients: list[Client],
    profiles: Mapping[str, np.ndarray],
    seed: int,
    t: int,
    *,
    overlay: OverlayView | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    if strategy == "local":
        return [], None
    if strategy == "local_plus":  # its own-data steps are the round loop's
        return [], None
    if strategy == "central_kd":
        return central_kd(world, clients, seed, t), None
    if strategy == "oracle":
        return oracle_exchange(world, clients, seed, t)
    if strategy == "semantic_dfl":
        return semantic_dfl_exchange(world, clients), None
    if strategy in MERGE_STRATEGIES:
        return merge_exchange(world, strategy, clients, seed, t), None
    if strategy in OVERLAY_STRATEGIES:
        assert overlay is not None
        return _overlay_exchange(world, clients, overlay, seed, t), None
    directed = _directed_exchange(world, strategy, policy, clients, profiles, seed, t, overlay)
    if overlay is not None:
        directed += _overlay_exchange(world, clients, overlay, seed, t)
    return directed, None


def _directed_exchange(
    world: World,
    strategy: str,
    policy: Any,
    clients: list[Client],
    profiles: Mapping[str, np.ndarray],
    seed: int,
    t: int,
    overlay: OverlayView | None = None,
) -> list[dict[str, Any]]:
    """A pairing strategy's round: the policy's pairs, each executed as a directive by the
    agent's own protocol objects (:mod:`~peerlm.app.experiment_agent`), the student's Eq. 3
    reward (measured where the plan measures it, ``reward_examples``) fed back to the policy.

    Random-P2P, Heuristic-P2P and ``cpm`` pair for the default protocol (AKD by text).
    ``cpm_menu``: the CPM chooses a protocol of the whole menu per pair (the
    ``cpm_<protocol>`` strategies: of one protocol, forced for everyone), among those
    admissible for it (each client declares its parameter-space fingerprint and every
    protocol, as an agent does): AKD by text or top-k logits, or the teacher's adapter
    merged by PDFL (``pmix``) or OnePeFT's SVD + HKA (``svd_hka``). With ``overlay``
    (``cpm_menu_overlay``) every client reports the list of its last overlay step, and a
    merge protocol is admissible only from a sender on the student's list
    (:mod:`~peerlm.app.experiment_overlay`; no list before the first step)."""
    from peerlm.agent import host_parameter_space
    from peerlm.services.cpm import MENU, Capabilities

    plan = world.plan
    listed = overlay.listed if overlay is not None else {}
    menu = strategy in MENU_STRATEGIES
    pairings: list[Pairing]
    if menu:
        capabilities = {
            c.name: Capabilities(
                host_parameter_space(c.host),
                MENU,
                frozenset(listed[c.name]) if listed.get(c.name) else None,
            )
            for c in clients
        }
        pairings = policy.select(profiles, capabilities)
    else:
        pairings = policy.select(profiles)
    cpm_settings = plan.cpm_settings(seed, CPM_PROTOCOLS.get(strategy, (DEFAULT_PROTOCOL,)))
    federation = InProcessFederation(
        world, clients, seed, t, InProcessCpm(policy, cpm_settings.refusal_reward)
    )
    by_name = {c.name: c for c in clients}
    if plan.pairing == "per_student":
        # A client may teach and learn in one round: every teacher answers X_u once, with
        # its state at the start of the exchange phase, before any student step writes
        # (which matters under ``shared`` integration: the slot leaves the own adapter be).
        teaching = (p.sender for p in pairings if lookup(p.protocol).kind == "distillation")
        for name in dict.fromkeys(teaching):
            teacher_answers(world, by_name[name], t)
    records: list[dict[str, Any]] = []
    for pairing in pairings:
        prefix = f"cpm-{pairing.protocol}" if menu else strategy
        done = federation.execute(pairing, f"{prefix}-{t}-{pairing.sender}-{pairing.receiver}")
        student = by_name[pairing.receiver]
        entry = lookup(pairing.protocol)
        if done.stepped and (entry.kind == "distillation" or entry.needs_public_pairs):
            # AKD's steps, or HKA's optimiser steps on the public pairs.
            student.peer_steps += plan.integration_steps
        record = done.record
        if record is None:  # refused (the policy learnt it) or changed nothing: no exchange
            continue
        student.rewards.append(record["reward"])
        student.exchanges += 1
        if menu:
            record["protocol"] = pairing.protocol
        if overlay is not None:
            record["overlay_listed"] = list(listed.get(student.name, ()))
        records.append(record)
    return records


def _overlay_exchange(
    world: World, clients: list[Client], overlay: OverlayView, seed: int, t: int
) -> list[dict[str, Any]]:
    """Every client's overlay step, as the agent runs it after its directive
    (:func:`peerlm.agent.overlay_client.step.overlay_round_step`, in process): publish its
    signature, find its ``k`` nearest peers, pull their adapters and aggregate them by the
    agent's own pull (:func:`~peerlm.agent.merging.pull_aggregate.pull_and_aggregate`: the
    codec's checks and norm bounds, the PDFL step weighted by the similarities, the
    acceptance gate on its validation set at the agent's default margin) over the
    in-process transport (:mod:`~peerlm.app.experiment_agent`). The agents step at once,
    so each pulls what its neighbours held before anyone's step. One record per client:
    its neighbours (what it reports next), what it pulled and the outcome."""
    from peerlm.agent import AcceptanceGate, AgentSettings, Candidate, pull_settings

    plan = world.plan
    neighbours, similarities = overlay.step({c.name: c.host for c in clients})
    defaults = AgentSettings.model_fields
    settings = pull_settings(overlay.settings, defaults["round_timeout_s"].default)
    margin = defaults["acceptance_margin"].default
    # No directive's reward here: the policy is never asked.
    federation = InProcessFederation(world, clients, seed, t, InProcessCpm(None, 0.0))
    federation.peers.freeze()
    records: list[dict[str, Any]] = []
    for i, c in enumerate(clients):
        near = neighbours[c.name]
        record: dict[str, Any] = {
            "teacher": ",".join(near),
            "student": c.name,
            "mode": f"overlay_{settings.method}",
            "protocol": "overlay",
            "neighbours": list(near),
            "similarities": {n: round(v, 6) for n, v in similarities[c.name].items()},
            "kilobytes": 0.0,
        }
        if not near:
            records.append({**record, "outcome": "no_candidates"})
            continue
        gate = AcceptanceGate(c.val_examples, margin) if margin is not None else None
        config = round_config(plan, seed, i, integration=True).integrating()
        report = federation.pull(
            c,
            [Candidate(n, n, similarities[c.name][n]) for n in near],
            settings,
            gate,
            (world.public_pairs, config.train_settings(t)),
        )
        outcome = (
            "rolled_back" if report.rolled_back else "aggregated" if report.applied else "identity"
        )
        records.append(
            {**record, "kilobytes": round(report.bytes_received / 1024, 2), "outcome": outcome}
        )
    return records
