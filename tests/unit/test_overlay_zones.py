"""Zone formation (Alg. 2-3): invariants on arbitrary connected graphs, VRF election."""

from __future__ import annotations

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peerlm.overlay.messages import NodeRef, VrfTicket, ZoneMember
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.sim import Simulator
from peerlm.overlay.zones import balanced_chunks, bfs_order, sample_order_stats


@st.composite
def connected_graphs(draw: st.DrawFn) -> nx.Graph:
    n = draw(st.integers(min_value=2, max_value=36))
    seed = draw(st.integers(min_value=0, max_value=10_000))
    extra = draw(st.floats(min_value=0.0, max_value=0.3))
    tree = nx.random_labeled_tree(n, seed=seed)
    graph = nx.gnp_random_graph(n, extra, seed=seed + 1)
    graph.add_edges_from(tree.edges)
    return graph


def _wire(graph: nx.Graph, params: OverlayParams, seed: int) -> Simulator:
    """Nodes named ``v000``... with exactly ``graph``'s edges as neighbours."""
    sim = Simulator(params, seed=seed)
    ids = {v: f"v{v:03d}" for v in graph.nodes}
    for v in graph.nodes:
        sim.create_node(ids[v])
    for v in graph.nodes:
        refs = [sim.nodes[ids[u]].ref for u in sorted(graph.neighbors(v))]
        sim.call(ids[v], lambda node, refs=refs: node.set_neighbours(refs, sim.now))
    return sim


def _simulate_zones(graph: nx.Graph, zone_cap: int, radius: int, seed: int) -> Simulator:
    params = OverlayParams(
        zone_cap=zone_cap, ttl_radius=radius, genesis_time=1.0, max_neighbours=64
    )
    sim = _wire(graph, params, seed)
    start = params.level_start(0, 1)
    sim.run_until(start + params.level_phases["sigprobe"] - 1e-6)
    return sim


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=connected_graphs(),
    zone_cap=st.integers(min_value=2, max_value=8),
    radius=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_zones_partition_every_node_within_the_cap(
    graph: nx.Graph, zone_cap: int, radius: int, seed: int
) -> None:
    sim = _simulate_zones(graph, zone_cap, radius, seed)
    zones: dict[str, set[str]] = {}
    assigned: dict[str, str] = {}
    for nid, node in sim.nodes.items():
        zl = node.zones.level_state(0, 1)
        assert zl is not None and zl.initiator is not None, f"{nid} not assigned"
        assigned[nid] = zl.initiator.node_id
        if zl.is_initiator:
            zones[nid] = set(zl.members)
    members = [m for zone in zones.values() for m in zone]
    assert sorted(members) == sorted(sim.nodes), "zones must cover every node exactly once"
    assert len(members) == len(set(members)), "zones must be disjoint"
    for initiator, zone in zones.items():
        assert len(zone) <= zone_cap
        assert initiator in zone
        for m in zone:
            assert assigned[m] == initiator, "a member's view of its initiator must agree"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=connected_graphs(),
    radius=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_elected_initiators_are_the_vrf_minimum_within_r_hops(
    graph: nx.Graph, radius: int, seed: int
) -> None:
    params = OverlayParams(zone_cap=64, ttl_radius=radius, genesis_time=1.0, max_neighbours=64)
    sim = _wire(graph, params, seed)
    ids = {v: f"v{v:03d}" for v in graph.nodes}
    # Stop right after the probe phase: only elected initiators exist yet.
    sim.run_until(params.level_start(0, 1) + params.level_phases["probe"] + 1e-6)
    key = {v: (sim.nodes[ids[v]].ctx.score(0), ids[v]) for v in graph.nodes}
    lengths = dict(nx.all_pairs_shortest_path_length(graph, cutoff=radius))
    expected = {ids[v] for v in graph.nodes if min(key[u] for u in lengths[v]) == key[v]}
    elected = {
        nid
        for nid, node in sim.nodes.items()
        if (zl := node.zones.level_state(0, 1)) is not None and zl.is_initiator
    }
    assert elected == expected


def _member(i: int, hops: int) -> ZoneMember:
    return ZoneMember(NodeRef(f"m{i}", f"a{i}"), VrfTicket(f"m{i}", b"k" * 32, b"p" * 80), hops)


def test_bfs_order_puts_the_initiator_first_then_hops_then_arrival() -> None:
    members = [_member(3, 2), _member(1, 1), _member(0, 0), _member(2, 1)]
    seq = {"m0": 0, "m2": 1, "m1": 2, "m3": 3}
    assert [m.ref.node_id for m in bfs_order(members, seq, "m0")] == ["m0", "m2", "m1", "m3"]


def test_balanced_chunks_respect_the_cap_and_keep_order() -> None:
    items = [_member(i, i) for i in range(11)]
    chunks = balanced_chunks(items, 4)
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert [m for c in chunks for m in c] == items
    assert balanced_chunks(items[:3], 4) == [items[:3]]


def test_p_min_samples_are_bounded_order_statistics() -> None:
    values = list(range(1000, 0, -1))
    sample = sample_order_stats(values, limit=10)
    assert len(sample) == 10 and sample[0] == 1 and sample[-1] == 1000
    assert list(sample) == sorted(sample)
    assert sample_order_stats([5, 3]) == (3, 5)
