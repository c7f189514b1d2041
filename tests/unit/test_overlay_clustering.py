"""Intra-zone clustering: affinity propagation, its fallback, the fan-out cap, replicas."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.overlay.clustering import (
    affinity_clusters,
    cap_group_size,
    choose_replicas,
    k_medoids,
)
from peerlm.overlay.hierarchy import form_inner_clusters, form_leaf_clusters, form_root
from peerlm.overlay.messages import MemberEntry, NodeRef
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.population import ClusteredPopulation, PopulationSpec
from peerlm.overlay.signature import cosine_matrix

PARAMS = OverlayParams()


def _blobs(n_per: int, centres: int, seed: int) -> tuple[np.ndarray, list[int]]:
    pop = ClusteredPopulation(
        PopulationSpec(dim=128, clusters=centres, groups=centres, member_noise=0.3), seed
    )
    members = pop.draw(n_per * centres)
    return cosine_matrix([m.signature for m in members]), [m.cluster for m in members]


def _is_partition(groups: tuple[tuple[int, ...], ...], n: int) -> bool:
    flat = [i for g in groups for i in g]
    return sorted(flat) == list(range(n))


def test_affinity_propagation_recovers_planted_clusters() -> None:
    sim, labels = _blobs(6, 4, seed=1)
    result = affinity_clusters(sim, PARAMS)
    assert result.method == "affinity_propagation" and result.converged
    assert _is_partition(result.groups, len(labels))
    for group, exemplar in zip(result.groups, result.exemplars, strict=True):
        assert exemplar in group
        assert len({labels[i] for i in group}) == 1, "a cluster mixes planted clusters"


def test_same_input_same_clustering() -> None:
    sim, _ = _blobs(5, 3, seed=2)
    assert affinity_clusters(sim, PARAMS) == affinity_clusters(sim, PARAMS)


def test_non_convergence_falls_back_to_k_medoids() -> None:
    sim, labels = _blobs(6, 3, seed=3)
    # One iteration can never satisfy convergence_iter, so every damping fails.
    stubborn = OverlayParams(ap_max_iter=1, ap_convergence_iter=1, ap_fallback_dampings=(0.9,))
    result = affinity_clusters(sim, stubborn)
    assert result.method.startswith("k_medoids")
    assert not result.converged
    assert _is_partition(result.groups, len(labels))
    assert all(e in g for g, e in zip(result.groups, result.exemplars, strict=True))


def test_degenerate_inputs() -> None:
    assert affinity_clusters(np.zeros((0, 0)), PARAMS).groups == ()
    assert affinity_clusters(np.ones((1, 1)), PARAMS).groups == ((0,),)
    uniform = affinity_clusters(np.full((4, 4), 0.5), PARAMS)
    assert uniform.groups == ((0, 1, 2, 3),) and uniform.method == "uniform"
    with pytest.raises(ValueError):
        affinity_clusters(np.zeros((2, 3)), PARAMS)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), cap=st.integers(2, 9), seed=st.integers(0, 10_000))
def test_cap_splits_every_group_to_at_most_f(n: int, cap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sim = x @ x.T
    one_group = k_medoids(sim, 1)
    groups, exemplars = cap_group_size(sim, one_group, cap)
    assert _is_partition(groups, n)
    assert all(len(g) <= cap for g in groups)
    assert all(e in g for g, e in zip(groups, exemplars, strict=True))


def test_replicas_are_the_closest_in_vrf_order() -> None:
    ids = ["a", "b", "c", "d"]
    closeness = [0.9, 0.1, 0.8, 0.7]
    scores = [30, 5, 10, 20]
    chosen = choose_replicas(ids, closeness, scores, 3)
    assert [ids[i] for i in chosen] == ["c", "d", "a"]
    assert choose_replicas(ids[:1], closeness[:1], scores[:1], 3) == [0]


def test_hierarchy_descriptors_are_consistent() -> None:
    pop = ClusteredPopulation(PopulationSpec(dim=128, clusters=3, groups=3), 4)
    members = [
        MemberEntry(NodeRef(f"m{i}", f"addr{i}"), m.signature, score=i * 7 % 11)
        for i, m in enumerate(pop.draw(18))
    ]
    leaves, _ = form_leaf_clusters(0, "0.1.m0", members, PARAMS)
    assert sum(f.descriptor.size for f in leaves) == 18
    for f in leaves:
        d = f.descriptor
        assert d.level == 1 and d.cluster_id.startswith("0.1.m0.")
        assert len(d.replicas) == min(PARAMS.replication, d.size) == len(d.scores)
        assert list(d.scores) == sorted(d.scores)
        assert {r.node_id for r in d.replicas} <= {m.ref.node_id for m in f.members}
    inner, _ = form_inner_clusters(
        0, 2, "0.2.m0", [f.descriptor for f in leaves], OverlayParams(max_children=2)
    )
    assert all(len(f.children) <= 2 for f in inner)
    assert sum(f.descriptor.size for f in inner) == 18
    root = form_root(0, 3, "0.3.m0", [f.descriptor for f in inner], PARAMS)
    assert root.descriptor.size == 18 and root.descriptor.cluster_id.endswith(".root")
    assert len(root.descriptor.replicas) <= PARAMS.root_replication


def test_population_from_real_vectors() -> None:
    from peerlm.overlay.population import population_from_vectors

    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(200) for _ in range(5)]
    members = population_from_vectors(vectors, p=20, space="adapter")
    assert [m.signature.p for m in members] == [20] * 5
    assert all(m.cluster == -1 and 1 <= m.p_min <= 200 for m in members)
    top = np.argsort(-np.abs(vectors[0]))[:20]
    assert sorted(members[0].signature.indices.tolist()) == sorted(top.tolist())
