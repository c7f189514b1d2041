"""The clustered (sub-quadratic) prefilter against the exact one it approximates."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from peerlm.services.cpm.matchmaker import Matchmaker
from peerlm.services.cpm.prefilter import (
    DEFAULT_SHORTLIST,
    CheapScore,
    PrefilterScratch,
    _top_columns,
    _top_k_exact,
    cheap_pair_scores,
    clustered_top_k,
    exact_top_k,
    prefilter_pairs,
    top_k_partners,
)

D_P = 12


def _population(n: int, seed: int) -> tuple[Matchmaker, np.ndarray, np.ndarray]:
    """A matchmaker that has learnt something, and ``n`` random (bounded) profiles."""
    rng = np.random.default_rng(seed)
    mm = Matchmaker(profile_dim=D_P, seed=seed)
    for _ in range(3):
        warm = {f"w{i}": rng.uniform(0, 1, D_P) for i in range(40)}
        for p in mm.select(warm):
            mm.observe(p, float(rng.normal()))
    prof = rng.uniform(0.0, 1.0, size=(n, D_P))
    prof[:, :4] = np.eye(4)[rng.integers(0, 4, size=n)]  # a one-hot block, as in profiles
    trust = rng.uniform(0.3, 0.7, size=n)
    return mm, mm.features.bound_profiles(prof), trust


def _args(mm: Matchmaker, prof: np.ndarray, trust: np.ndarray) -> CheapScore:
    return CheapScore(prof, trust, mm.features.layout, mm.theta, np.diagonal(mm._bandit.a_inv), 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clustered_top_k_recalls_the_exact_top_k(seed: int) -> None:
    mm, prof, trust = _population(1500, seed)
    args = _args(mm, prof, trust)
    k = 8
    exact = _top_k_exact(args.model(), len(prof), k, 1.0)
    approx = clustered_top_k(args, k, np.random.default_rng(seed), cell_size=16, shortlist=256)
    assert approx.shape == (len(prof), k)
    assert not np.any(approx == np.arange(len(prof))[:, None])  # never the agent itself
    assert all(len(set(row)) == k for row in approx.tolist())
    recall = np.mean([len(np.intersect1d(e, a)) / k for e, a in zip(exact, approx, strict=True)])
    assert recall >= 0.9, recall
    # And it is a real search, not luck: a random choice of k would recall ~k / N.
    rand = np.random.default_rng(seed).integers(0, len(prof), size=(len(prof), k))
    assert np.mean([len(np.intersect1d(e, r)) / k for e, r in zip(exact, rand, strict=True)]) < 0.05


def test_clustered_top_k_is_deterministic_under_a_seed() -> None:
    mm, prof, trust = _population(800, 5)
    args = _args(mm, prof, trust)
    a = clustered_top_k(args, 8, np.random.default_rng(7), cell_size=16, shortlist=128)
    b = clustered_top_k(args, 8, np.random.default_rng(7), cell_size=16, shortlist=128)
    assert np.array_equal(a, b)


def test_clustered_top_k_with_a_shortlist_wider_than_n_is_exact() -> None:
    mm, prof, trust = _population(120, 3)
    args = _args(mm, prof, trust)
    exact = np.sort(_top_k_exact(args.model(), len(prof), 5, 1.0), axis=1)
    approx = clustered_top_k(args, 5, np.random.default_rng(0), cell_size=8, shortlist=1000)
    assert np.array_equal(np.sort(approx, axis=1), exact)


def test_exact_prefilter_below_the_cluster_threshold_is_the_full_matrix_top_k() -> None:
    mm, prof, trust = _population(200, 4)
    args = _args(mm, prof, trust)
    k, r = 6, 2
    left, right = prefilter_pairs(args, k, r, np.random.default_rng(9), cluster_min_agents=201)
    # Reference: the full N x N matrix, top-k by sorting, then the same random draws.
    full = cheap_pair_scores(args)
    best = np.argsort(-full, axis=1, kind="stable")[:, :k]
    rng = np.random.default_rng(9)
    n = len(prof)
    rand = (np.arange(n)[:, None] + rng.integers(1, n, size=(n, r))) % n
    rows = np.repeat(np.arange(n), k + r)
    cols = np.hstack([best, rand]).ravel()
    keys = np.unique(np.minimum(rows, cols) * n + np.maximum(rows, cols))
    assert np.array_equal(left, keys // n) and np.array_equal(right, keys % n)


def test_matchmaker_clustered_path_is_deterministic_and_disjoint() -> None:
    rng = np.random.default_rng(11)
    profiles = {f"a{i:03d}": rng.uniform(0, 1, D_P) for i in range(300)}
    runs = []
    for _ in range(2):
        mm = Matchmaker(profile_dim=D_P, seed=3, prefilter_cluster_min_agents=64)
        runs.append(mm.select(profiles))
    assert runs[0] == runs[1]
    agents = [a for p in runs[0] for a in (p.sender, p.receiver)]
    assert len(agents) == len(set(agents))
    assert len(runs[0]) == 150  # refill passes still pair everybody


def test_small_federations_ignore_the_cluster_setting() -> None:
    rng = np.random.default_rng(12)
    profiles = {f"a{i:02d}": rng.uniform(0, 1, D_P) for i in range(50)}
    default = Matchmaker(profile_dim=D_P, seed=1).select(profiles)
    clustered = Matchmaker(profile_dim=D_P, seed=1, prefilter_cluster_min_agents=2).select(profiles)
    assert default == clustered  # N < prefilter_min_agents: all pairs scored exactly


def test_top_k_partners_dispatches_on_the_cluster_threshold() -> None:
    mm, prof, trust = _population(300, 6)
    args = _args(mm, prof, trust)
    exact = exact_top_k(args, 6)
    below = top_k_partners(args, 6, np.random.default_rng(0), cluster_min_agents=301)
    assert np.array_equal(np.sort(below, axis=1), np.sort(exact, axis=1))
    above = top_k_partners(
        args, 6, np.random.default_rng(0), cluster_min_agents=300, cell_size=16, shortlist=64
    )
    ref = clustered_top_k(args, 6, np.random.default_rng(0), cell_size=16, shortlist=64)
    assert np.array_equal(above, ref)
    assert top_k_partners(args, 0, np.random.default_rng(0)).shape == (300, 0)


@pytest.mark.parametrize(
    ("rows", "width", "k"), [(50, 64, 1), (40, 200, 8), (7, 9, 8), (3, 512, 30)]
)
def test_top_columns_is_the_argpartition_top_k_without_ties(rows: int, width: int, k: int) -> None:
    rng = np.random.default_rng(rows * width + k)
    block = rng.standard_normal((rows, width)).astype(np.float32)
    block[np.arange(rows) % width, np.arange(rows) % width] = -np.inf  # like the diagonal
    got = _top_columns(block, k)
    want = np.sort(np.argpartition(block, width - k, axis=1)[:, width - k :], axis=1)
    assert got.dtype == np.intp
    assert np.array_equal(got, want)


def test_top_columns_breaks_ties_to_the_lowest_columns_and_never_prefers_nan() -> None:
    block = np.array(
        [
            [1.0, 5.0, 3.0, 3.0, 3.0, 0.0],  # tie at the k-th value: lowest columns win
            [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],  # all tied
            [np.nan, 1.0, 4.0, 0.0, 2.0, 3.0],  # NaN is not a top value
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # an ordinary row beside the tied ones
        ],
        dtype=np.float32,
    )
    got = _top_columns(block, 3)
    assert got.tolist() == [[1, 2, 3], [0, 1, 2], [2, 4, 5], [3, 4, 5]]


def test_exact_top_k_keeps_the_same_partner_sets_as_argpartition() -> None:
    mm, prof, trust = _population(300, 5)
    scores = cheap_pair_scores(_args(mm, prof, trust))
    want = np.sort(np.argpartition(scores, 300 - 8, axis=1)[:, 300 - 8 :], axis=1)
    got = np.sort(exact_top_k(_args(mm, prof, trust), 8), axis=1)
    assert np.array_equal(got, want)


def test_exact_top_k_with_reused_scratch_equals_fresh_buffers() -> None:
    # One scratch serves calls of different sizes (a refill pass reuses the first pass's
    # larger buffers): scores written there must equal fresh ones bit for bit.
    scratch = PrefilterScratch()
    for n, seed in ((300, 5), (120, 6), (300, 7), (40, 8)):
        mm, prof, trust = _population(n, seed)
        args = _args(mm, prof, trust)
        model = args.model()
        assert np.array_equal(model.rows(0, n, 1.0, scratch), model.rows(0, n, 1.0))
        got = exact_top_k(args, 8, scratch=scratch)
        assert np.array_equal(got, exact_top_k(args, 8))
        assert np.array_equal(_top_k_exact(model, n, 8, 1.0, scratch), got)


def test_top_columns_in_a_work_buffer_leaves_the_block_alone() -> None:
    rng = np.random.default_rng(3)
    block = rng.standard_normal((20, 64)).astype(np.float32)
    before = block.copy()
    work = np.empty_like(block)
    assert np.array_equal(_top_columns(block, 5, work), _top_columns(block, 5))
    assert np.array_equal(block, before)


def test_refill_passes_keep_the_clustered_search_only_in_a_clustered_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import peerlm.services.cpm.matchmaker as matchmaker_module

    calls: list[tuple[int, int]] = []
    real = matchmaker_module.prefilter_pairs

    def recording(inputs: CheapScore, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(inputs.profiles), int(kwargs["cluster_min_agents"])))
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(matchmaker_module, "prefilter_pairs", recording)
    rng = np.random.default_rng(21)
    for n in (2000, 2100):
        calls.clear()
        mm = Matchmaker(profile_dim=D_P, seed=2)
        pairings = mm.select({f"a{i:04d}": rng.uniform(0, 1, D_P) for i in range(n)})
        assert len(pairings) == n // 2
        assert calls[0][0] == n and len(calls) >= 2  # the first pass strands some agents
        want = 2048 if n < 2048 else 2 * DEFAULT_SHORTLIST + 1
        assert all(cluster_min == want for _, cluster_min in calls)


def _cheap_reference(args: CheapScore) -> np.ndarray:
    """The cheap score from its definition (module docstring), pair by pair, in float64:
    the better direction's mean plus beta * sqrt of the direction-averaged diagonal
    variance approximation."""
    lay, th, v = args.layout, args.theta, args.a_inv_diag
    p, t = args.profiles, args.trust
    n = p.shape[0]

    def block(vec: np.ndarray, sl: slice | None) -> np.ndarray:
        return np.zeros(lay.profile_dim) if sl is None else vec[sl]

    def mean(i: int, j: int) -> float:
        x = th[lay.sender] @ p[i] + th[lay.receiver] @ p[j]
        x += block(th, lay.absdiff) @ (p[i] - p[j]) ** 2 + p[i] @ (block(th, lay.product) * p[j])
        if t is not None and lay.trust_sender is not None:
            x += th[lay.trust_sender] * t[i] + th[lay.trust_receiver] * t[j]
        return float(x + np.max(th[lay.onehot]) + th[lay.bias])

    def var(i: int, j: int) -> float:
        x = v[lay.sender] @ p[i] ** 2 + v[lay.receiver] @ p[j] ** 2
        x += block(v, lay.absdiff) @ (p[i] - p[j]) ** 2 + block(v, lay.product) @ (p[i] * p[j]) ** 2
        if t is not None and lay.trust_sender is not None:
            x += v[lay.trust_sender] * t[i] ** 2 + v[lay.trust_receiver] * t[j] ** 2
        return float(x + np.max(v[lay.onehot]) + v[lay.bias])

    out = np.full((n, n), -np.inf)
    for i in range(n):
        for j in range(n):
            if i != j:
                best = max(mean(i, j), mean(j, i))
                out[i, j] = best + args.beta * np.sqrt(0.5 * (var(i, j) + var(j, i)))
    return out


@pytest.mark.parametrize("beta", [1.0, 0.4])
def test_cheap_scores_equal_their_definition_pair_by_pair(beta: float) -> None:
    mm, prof, trust = _population(40, 11)
    args = CheapScore(
        prof, trust, mm.features.layout, mm.theta, np.diagonal(mm._bandit.a_inv), beta
    )
    got = cheap_pair_scores(args).astype(np.float64)
    want = _cheap_reference(args)
    off = ~np.eye(40, dtype=bool)
    assert np.allclose(got[off], want[off], rtol=1e-4, atol=1e-4)
    assert np.all(np.isneginf(np.diagonal(got)))
    # Symmetric, as the better direction and the averaged variance are.
    assert np.allclose(got[off], got.T[off], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "width", "k"), [(30, 400, 8), (9, 2000, 3), (60, 700, 20)])
def test_wide_rows_take_the_bounded_search_with_the_same_ties_and_nan_rules(
    rows: int, width: int, k: int
) -> None:
    # Wide enough for the bounded search (width >= 32 k): the rows below exercise rows
    # with many candidates above the bound, whole-row ties, NaN and infinities.
    rng = np.random.default_rng(width + k)
    block = np.round(rng.standard_normal((rows, width)), 1).astype(np.float32)
    block[0] = 2.0
    block[1, : width // 2] = np.nan
    block[2, ::5] = np.inf
    block[3] = -np.inf
    block[4, :] = np.nan
    block[4, 7 : 7 + k] = 1.0
    got = _top_columns(block, k)
    want = np.empty_like(got)
    for r in range(rows):
        order = np.argsort(-block[r].astype(np.float64), kind="stable")[:k]
        want[r] = np.sort(order)
    assert np.array_equal(got, want)
    assert got[0].tolist() == list(range(k))  # all tied: the lowest columns
    assert got[4].tolist() == list(range(7, 7 + k))  # NaN never preferred
