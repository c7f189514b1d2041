"""Maintenance under churn: takeover within the lease, join placement, graceful leave."""

from __future__ import annotations

from collections import Counter

import pytest
from peerlm.overlay.events import LeaseTakeover, Placed

from tests.overlay_harness import Federation, federation

K = 10


def _built(n: int = 80, seed: int = 5) -> Federation:
    fed = federation(n, seed=seed, zone_cap=10)
    fed.build()
    fed.query_all(K)  # the first round initialises tau
    return fed


def _answered_by_overlay(results: dict[str, object]) -> bool:
    return all(getattr(ev, "stats").visited > 0 for ev in results.values())  # noqa: B009


def _takeovers(fed: Federation, since: int) -> list[tuple[float, str, LeaseTakeover]]:
    return [(t, n, ev) for t, n, ev in fed.sim.events[since:] if isinstance(ev, LeaseTakeover)]


def test_killed_super_peer_is_replaced_within_the_lease_and_queries_recover() -> None:
    fed = _built()
    params = fed.params
    prim = fed.primaries()
    roles = {cid: fed.sim.nodes[nid].roles.roles[cid] for cid, nid in prim.items()}
    # An inner super-peer with a successor, so the takeover is observable.
    cid = next(
        c for c, r in sorted(roles.items()) if r.level >= 2 and len(r.descriptor.replicas) > 1
    )
    victim = prim[cid]
    successor = roles[cid].descriptor.replicas[1].node_id
    mark, t_kill = len(fed.sim.events), fed.sim.now
    fed.sim.kill(victim)
    fed.sim.run_until(t_kill + params.lease_duration + 2 * params.heartbeat_interval)
    taken = [(t, n, ev) for t, n, ev in _takeovers(fed, mark) if ev.cluster_id == cid]
    assert taken, "no replica took over"
    t, node, ev = taken[0]
    assert node == successor and ev.previous_primary == victim and ev.reason == "lease_expired"
    assert t - t_kill <= params.lease_duration + params.heartbeat_interval + 1e-9
    assert fed.primaries()[cid] == successor
    results = fed.query_all(K)
    assert len(results) == len(fed.sim.alive)
    assert _answered_by_overlay(results)
    assert all(victim not in {c.node_id for c in ev.results} for ev in results.values())
    assert fed.recall(results, K) >= 0.85


def test_queries_survive_the_root_primary_dying() -> None:
    fed = _built(seed=6)
    prim = fed.primaries()
    root = next(c for c, n in prim.items() if fed.sim.nodes[n].roles.roles[c].is_root)
    fed.sim.kill(prim[root])
    # At once (other root replicas serve), and again once the successor holds the lease.
    for _ in range(2):
        results = fed.query_all(K)
        assert len(results) == len(fed.sim.alive)
        assert _answered_by_overlay(results)
        assert fed.recall(results, K) >= 0.8
    assert fed.primaries()[root] != prim[root]


def test_join_places_a_newcomer_with_its_kind() -> None:
    fed = _built(seed=7)
    assert fed.population is not None
    cluster = 2
    newcomer = fed.population.member(cluster)
    fed.members["new"] = newcomer
    mark = len(fed.sim.events)
    fed.sim.add_node(
        "new", lambda node: node.set_signature(newcomer.signature, fed.sim.now, newcomer.p_min)
    )
    fed.sim.run_until(fed.sim.now + 3 * fed.params.join_retry)
    placed = [ev for _, n, ev in fed.sim.events[mark:] if n == "new" and isinstance(ev, Placed)]
    assert placed and placed[0].via == "join"
    leaf = fed.sim.nodes["new"].describe()["cluster"]
    primary = fed.primaries()[leaf]
    members = fed.sim.nodes[primary].roles.roles[leaf].members
    assert "new" in members
    kinds = Counter(fed.members[m].cluster for m in members if m != "new")
    assert kinds.most_common(1)[0][0] == cluster, "placed among the wrong kind of peers"
    # The newcomer can search, and its own kind finds it.
    same = sorted(n for n in fed.sim.alive if fed.members[n].cluster == cluster and n != "new")
    results = fed.query_all(K, who=["new", *same])
    assert fed.recall({"new": results["new"]}, K) >= 0.8
    truth = fed.truth(K)
    expected = [n for n in same if "new" in truth[n]]
    assert expected
    found = sum("new" in {c.node_id for c in results[n].results} for n in expected)
    assert found >= 0.8 * len(expected)


def test_graceful_leave_hands_over_and_disappears_from_results() -> None:
    fed = _built(seed=8)
    prim = fed.primaries()
    roles = {cid: fed.sim.nodes[nid].roles.roles[cid] for cid, nid in prim.items()}
    cid = next(
        c for c, r in sorted(roles.items()) if r.level == 1 and len(r.descriptor.replicas) > 1
    )
    leaver = prim[cid]
    mark, t_leave = len(fed.sim.events), fed.sim.now
    fed.sim.leave(leaver)
    fed.sim.run_until(t_leave + fed.params.heartbeat_interval)
    taken = [ev for _, _, ev in _takeovers(fed, mark) if ev.cluster_id == cid]
    assert taken and taken[0].reason == "resigned"
    new_primary = fed.primaries()[cid]
    assert leaver not in fed.sim.nodes[new_primary].roles.roles[cid].members
    results = fed.query_all(K)
    assert _answered_by_overlay(results)
    assert all(leaver not in {c.node_id for c in ev.results} for ev in results.values())
    assert fed.sim.nodes[leaver].describe()["role"] == "left"


@pytest.mark.slow
def test_churn_keeps_every_query_answered() -> None:
    fed = _built(n=100, seed=9)
    assert fed.population is not None
    sim = fed.sim
    start = sim.now
    alive = sorted(sim.alive)
    leaving = alive[::4]  # 25 %
    for i, nid in enumerate(leaving):
        at = start + 0.4 * i
        sim.schedule(at, (lambda n=nid: sim.kill(n)) if i % 2 else (lambda n=nid: sim.leave(n)))
    for i in range(len(leaving)):
        member = fed.population.member(i % 6)
        nid = f"j{i:03d}"
        fed.members[nid] = member
        sim.schedule(
            start + 0.4 * i + 0.2,
            lambda n=nid, m=member: sim.add_node(
                n, lambda node: node.set_signature(m.signature, sim.now, m.p_min)
            ),
        )
    sim.run_until(start + 0.4 * len(leaving) + 6.0)
    results = fed.query_all(K)
    assert len(results) == len(sim.alive)
    assert _answered_by_overlay(results)
    assert fed.recall(results, K) >= 0.85


@pytest.mark.slow
def test_next_epoch_rotates_initiators_and_replaces_the_tree() -> None:
    fed = federation(60, seed=2, zone_cap=8, epoch_period=40.0)
    fed.build()
    sim = fed.sim

    def initiators() -> set[str]:
        return {n for n in sim.alive if 1 in sim.nodes[n].describe()["initiator_levels"]}

    first = initiators()
    fed.query_all(6)
    sim.run_until(fed.params.epoch_start(1) + fed.params.max_levels * fed.params.level_duration)
    assert {sim.nodes[n].describe()["epoch"] for n in sim.alive} == {1}
    assert initiators() != first
    epochs = {r.descriptor.epoch for n in sim.alive for r in sim.nodes[n].roles.roles.values()}
    assert epochs == {1}, "the old tree's roles are dropped once the new one is announced"
    results = fed.query_all(6)
    assert len(results) == 60 and all(ev.stats.visited > 0 for ev in results.values())
    assert fed.recall(results, 6) >= 0.75
