"""Shared set-up for the overlay tests: a small simulated federation with planted clusters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from peerlm.overlay.events import QueryCompleted
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.population import ClusteredPopulation, Member, PopulationSpec
from peerlm.overlay.signature import cosine_matrix
from peerlm.overlay.sim import Simulator

SPEC = PopulationSpec(dim=256, clusters=6, groups=3)


@dataclass
class Federation:
    sim: Simulator
    params: OverlayParams
    members: dict[str, Member] = field(default_factory=dict)
    population: ClusteredPopulation | None = None

    def build(self) -> None:
        """Run past the epoch-0 build."""
        p = self.params
        self.sim.run_until(p.genesis_time + p.max_levels * p.level_duration)

    def truth(self, k: int) -> dict[str, set[str]]:
        live = sorted(self.sim.alive)
        sim = cosine_matrix([self.members[n].signature for n in live])
        np.fill_diagonal(sim, -np.inf)
        order = np.argsort(-sim, axis=1, kind="stable")[:, :k]
        return {live[i]: {live[j] for j in row} for i, row in enumerate(order)}

    def query_all(self, k: int, who: list[str] | None = None) -> dict[str, QueryCompleted]:
        """Every live node (or ``who``) queries; returns the completions by node."""
        start = len(self.sim.events)
        qids: dict[str, str] = {}
        for nid in who if who is not None else sorted(self.sim.alive):
            qid, sends = self.sim.nodes[nid].start_query(k, self.sim.now)
            qids[qid] = nid
            self.sim.deliver(nid, sends)
        self.sim.run_until(self.sim.now + self.params.query_timeout + 0.5)
        out = {}
        for _, nid, ev in self.sim.events[start:]:
            if isinstance(ev, QueryCompleted) and ev.qid in qids:
                out[nid] = ev
        return out

    def recall(self, results: dict[str, QueryCompleted], k: int) -> float:
        truth = self.truth(k)
        values = [
            len(truth[n] & {c.node_id for c in ev.results}) / k
            for n, ev in results.items()
            if n in truth
        ]
        return float(np.mean(values))

    def primaries(self) -> dict[str, str]:
        """cluster id -> node id of its live primary."""
        out = {}
        for nid in self.sim.alive:
            node = self.sim.nodes[nid]
            for role in node.roles.roles.values():
                if node.roles.is_primary(role):
                    out[role.cluster_id] = nid
        return out


def federation(
    n: int, seed: int = 0, *, zone_cap: int = 10, spec: PopulationSpec = SPEC, **overrides: object
) -> Federation:
    """``n`` nodes on a low-RTT graph, signatures set, nothing run yet."""
    settings: dict[str, object] = {"zone_cap": zone_cap, "genesis_time": 1.0, **overrides}
    params = OverlayParams(**settings)  # type: ignore[arg-type]
    sim = Simulator(params, seed=seed)
    population = ClusteredPopulation(spec, seed=seed)
    fed = Federation(sim, params, population=population)
    ids = [f"n{i:03d}" for i in range(n)]
    for nid, member in zip(ids, population.draw(n), strict=True):
        fed.members[nid] = member
        sim.create_node(nid)
    sim.build_graph()
    for nid in ids:
        m = fed.members[nid]
        sim.call(nid, lambda node, m=m: node.set_signature(m.signature, 0.0, m.p_min))
    return fed
