"""The adapter-merge exchanges of the experiment: SemanticDFL's PDFL step within a family,
FedAvg-LoRA, FFA-LoRA and the OnePeFT variants (the agent's own aggregation code), each
client pulling its family's adapters and building the aggregate itself, as a peer would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from peerlm.app.experiment_world import Client, World, round_config

__all__ = ["merge_exchange", "semantic_dfl_exchange"]


def semantic_dfl_exchange(world: World, clients: list[Client]) -> list[dict[str, Any]]:
    """Within each model family, every client takes the PDFL step towards the others'
    adapters (equal similarities); the adapters travel whole, as an overlay pull does."""
    from peerlm.overlay import personalised_update

    states = {c.name: {k: v.clone() for k, v in c.host.adapter_state().items()} for c in clients}
    # What each adapter weighs on the wire (encoded), as the agents' pulls count it.
    sizes = {c.name: len(c.host.encoded_adapter().data) for c in clients}
    records: list[dict[str, Any]] = []
    for c in clients:
        peers = {o.name: states[o.name] for o in clients if o is not c and o.arch == c.arch}
        if not peers:
            continue
        with c.integrating(world.plan, "semantic_dfl"):
            base = c.host.adapter_state() if world.plan.integration == "separate" else None
            new, _report = personalised_update(
                base or states[c.name], peers, dict.fromkeys(peers, 1.0), self_id=c.name
            )
            c.host.load_adapter_state(new)
        c.exchanges += 1
        kb = sum(sizes[name] for name in peers) / 1024
        records.append({"teacher": ",".join(sorted(peers)), "student": c.name, "kilobytes": kb})
    return records


#: Merge strategies that aggregate every round (the others, OnePeFT's, once at the end).
_EVERY_ROUND: tuple[str, ...] = (
    "fedavg_lora",
    "ffa_lora",
    "onepeft_multi",
    "onepeft_multi_ce",
    "fedavg_lora_plus",
)


#: The OnePeFT variants and the parts of Eq. 3-6 each runs (Table 5's rows).
_SVD: tuple[str, ...] = ("onepeft", "onepeft_svd", "onepeft_multi", "onepeft_multi_ce")


_HKA: tuple[str, ...] = ("onepeft", "onepeft_hka", "onepeft_multi", "onepeft_multi_ce")


#: HKA's Eq. 6 alpha (the CE share): the paper's 0.5, or CE only for the control.
_HKA_ALPHA: Mapping[str, float] = {"onepeft_multi_ce": 1.0}


def _families(clients: list[Client]) -> list[list[Client]]:
    groups: dict[str, list[Client]] = {}
    for c in clients:
        groups.setdefault(c.arch, []).append(c)
    return [g for g in groups.values() if len(g) > 1]


def merge_exchange(
    world: World, strategy: str, clients: list[Client], seed: int, t: int
) -> list[dict[str, Any]]:
    """FedAvg-LoRA (with or without own steps after it), FFA-LoRA or multi-round OnePeFT
    every round, or a OnePeFT variant once in the last round, within each model family (a
    client alone in its family trains locally). Each client pulls the other members'
    adapters (counted in KB) and builds the aggregate itself, as a peer would."""
    from peerlm.agent import ClientAdapter

    plan = world.plan
    if strategy not in _EVERY_ROUND and t != plan.rounds:
        return []
    records: list[dict[str, Any]] = []
    for group in _families(clients):
        adapters = [
            ClientAdapter(
                c.host.adapter_state(),
                r=c.host.lora.r,
                alpha=c.host.lora.alpha,
                examples=len(c.train),
                name=c.name,
            )
            for c in group
        ]
        sizes = [len(c.host.encoded_adapter().data) for c in group]  # as on the wire
        for k, c in enumerate(group):
            # The family-merge baselines (FedAvg-LoRA, FFA-LoRA, OnePeFT) keep the papers'
            # one adapter: their point is the shared model (docs/experiment.md).
            _merge_one(world, strategy, c, adapters, seed, clients.index(c), t)
            c.exchanges += 1
            records.append(
                {
                    "teacher": ",".join(o.name for o in group if o is not c),
                    "student": c.name,
                    "kilobytes": round((sum(sizes) - sizes[k]) / 1024, 2),
                }
            )
    return records


def _merge_one(
    world: World, strategy: str, c: Client, adapters: Sequence[Any], seed: int, i: int, t: int
) -> None:
    """Client ``c``'s aggregate of its family's ``adapters`` under a merge strategy."""
    from peerlm.agent import aggregate_fedavg_factors, aggregate_ffa, one_shot

    plan = world.plan
    settings = round_config(plan, seed, i).train_settings(t)
    if strategy in ("fedavg_lora", "fedavg_lora_plus"):
        c.host.load_adapter_state(aggregate_fedavg_factors(adapters).state)
        if strategy == "fedavg_lora_plus":
            c.host.train_local(c.train_examples, settings, steps=plan.local_steps)
    elif strategy == "ffa_lora":
        # Refuses (AdapterError "frozen_a") if a client's A had moved.
        c.host.load_adapter_state(aggregate_ffa(adapters).state)
    else:
        one_shot(
            c.host,
            adapters,
            world.public_pairs,
            settings,
            svd=strategy in _SVD,
            hka=strategy in _HKA,
            alpha=_HKA_ALPHA.get(strategy, 0.5),
            steps=plan.local_steps,
        )
        c.peer_steps += plan.local_steps
