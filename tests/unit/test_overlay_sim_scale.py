"""The simulator's and benchmark's O(N)-memory paths equal the full-matrix computations."""

from __future__ import annotations

import numpy as np
import pytest
from peerlm.bench.overlay import exact_top_k, exact_top_k_of
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.population import ClusteredPopulation, PopulationSpec
from peerlm.overlay.signature import cosine_matrix, cosine_rows
from peerlm.overlay.sim import Simulator


def _reference_graph(pts: np.ndarray, d_max: int) -> list[set[int]]:
    """The neighbour graph as the simulator built it from the full distance matrix."""
    n = len(pts)
    dist = np.sqrt(((pts[:, None, :] - pts[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(dist, np.inf)
    k = max(1, min(n - 1, d_max // 2))
    adj: list[set[int]] = [set() for _ in range(n)]
    for a, row in enumerate(np.argsort(dist, axis=1, kind="stable")[:, :k]):
        for b in (int(x) for x in row):
            if len(adj[a]) < d_max and len(adj[b]) < d_max:
                adj[a].add(b)
                adj[b].add(a)
    while True:
        comp = [-1] * n
        count = 0
        for s in range(n):
            if comp[s] < 0:
                stack, comp[s] = [s], count
                while stack:
                    for y in adj[stack.pop()]:
                        if comp[y] < 0:
                            comp[y] = count
                            stack.append(y)
                count += 1
        if count == 1:
            return adj
        inside = np.asarray(comp) == 0
        sub = dist[np.ix_(inside, ~inside)]
        i, j = np.unravel_index(int(np.argmin(sub)), sub.shape)
        a, b = int(np.flatnonzero(inside)[i]), int(np.flatnonzero(~inside)[j])
        adj[a].add(b)
        adj[b].add(a)


@pytest.mark.parametrize(
    "layout",
    ["uniform", "grid", "two_islands"],
)
def test_build_graph_equals_the_full_matrix_construction(layout: str) -> None:
    rng = np.random.default_rng(11)
    if layout == "uniform":
        pts = rng.random((600, 2))
    elif layout == "grid":  # many exactly equal distances: ties go to the lower index
        pts = np.array([(x / 17, y / 17) for x in range(18) for y in range(18)])
    else:  # far-apart groups: the components must be joined by their closest pair
        pts = np.concatenate([rng.random((40, 2)) * 0.1, 0.9 + rng.random((30, 2)) * 0.1])
    params = OverlayParams(genesis_time=1000.0, max_neighbours=6)
    sim = Simulator(params, seed=0)
    ids = [f"n{i:04d}" for i in range(len(pts))]
    for nid, (x, y) in zip(ids, pts, strict=True):
        sim.create_node(nid, (float(x), float(y)))
    graph = sim.build_graph()
    expected = _reference_graph(np.array([sim.positions[i] for i in ids]), 6)
    assert graph == {ids[a]: [ids[b] for b in sorted(adj)] for a, adj in enumerate(expected)}


def test_cosine_rows_and_exact_top_k_of_equal_the_full_matrix() -> None:
    sigs = [m.signature for m in ClusteredPopulation(PopulationSpec(), seed=3).draw(300)]
    full = cosine_matrix(sigs)
    rows = [299, 0, 17, 17, 150]
    assert np.array_equal(cosine_rows(sigs, rows), full[rows])
    assert cosine_rows(sigs, []).shape == (0, 300)
    every = exact_top_k(sigs, 12)
    some = exact_top_k_of(sigs, 12, rows)
    assert sorted(some) == sorted(set(rows))
    assert all(some[i] == every[i] for i in some)
