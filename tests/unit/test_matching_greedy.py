"""The vectorised greedy disjoint pass equals the plain greedy walk (Algorithm 2, l.8-12)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm.matching import greedy_disjoint, greedy_disjoint_sequential
from peerlm.services.cpm.matchmaker import _pair_best_mask


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 40),
    m=st.integers(0, 300),
    budget=st.integers(0, 25),
    seed=st.integers(0, 2**32 - 1),
)
def test_vectorised_greedy_equals_sequential_walk(n: int, m: int, budget: int, seed: int) -> None:
    """Random multigraphs with repeated pairs, both directions and self-pairs."""
    rng = np.random.default_rng(seed)
    senders = rng.integers(0, n, m).astype(np.intp)
    receivers = rng.integers(0, n, m).astype(np.intp)
    order = rng.permutation(m).astype(np.intp)
    expected = greedy_disjoint_sequential(senders, receivers, order, budget, n)
    assert greedy_disjoint(senders, receivers, order, budget, n) == expected


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 3000), budget=st.integers(0, 1500), reverse=st.booleans())
def test_vectorised_greedy_on_a_chain(n: int, budget: int, reverse: bool) -> None:
    """A path whose weights fall along it keeps one edge per round: the walk fallback."""
    senders = np.arange(n - 1, dtype=np.intp)
    receivers = senders + 1
    order = np.arange(n - 1, dtype=np.intp)
    if reverse:
        order = order[::-1].copy()
    expected = greedy_disjoint_sequential(senders, receivers, order, budget, n)
    assert greedy_disjoint(senders, receivers, order, budget, n) == expected


def test_vectorised_greedy_on_a_large_candidate_list() -> None:
    """The prefilter's regime: ~10 candidates per agent, budget N/2, early exit."""
    rng = np.random.default_rng(7)
    n, m = 5000, 100_000
    senders = rng.integers(0, n, m).astype(np.intp)
    receivers = rng.integers(0, n, m).astype(np.intp)
    order = rng.permutation(m).astype(np.intp)
    for budget in (n // 2, 100, 1):
        expected = greedy_disjoint_sequential(senders, receivers, order, budget, n)
        got = greedy_disjoint(senders, receivers, order, budget, n)
        assert got == expected
        assert len(got) == min(budget, len(expected))


def test_vectorised_greedy_keeps_nothing_without_budget_or_candidates() -> None:
    empty = np.empty(0, dtype=np.intp)
    assert greedy_disjoint(empty, empty, empty, 5, 10) == []
    one = np.array([0], dtype=np.intp)
    assert greedy_disjoint(one, one + 1, one * 0, 0, 10) == []
    assert greedy_disjoint(one, one, one * 0, 5, 10) == []  # a self-pair is never kept


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 30),
    n_pairs=st.integers(1, 120),
    combos=st.sampled_from([2, 4, 8]),
    budget=st.integers(1, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_walking_only_each_pairs_best_tuple_keeps_the_same(
    n: int, n_pairs: int, combos: int, budget: int, seed: int
) -> None:
    """What Matchmaker._select_pass does: the walk over each pair's best tuple (ties to the
    seeded permutation) keeps what the walk over all tuples in the full order keeps."""
    rng = np.random.default_rng(seed)
    left = rng.integers(0, n, n_pairs).astype(np.intp)
    right = ((left + rng.integers(1, n, n_pairs)) % n).astype(np.intp)
    # Coarse values, so exact ties (within and across pairs) are common.
    ucb2 = rng.integers(0, 4, size=(n_pairs, combos)).astype(np.float64)
    ucb = ucb2.ravel()
    fwd = np.arange(combos) < combos // 2
    senders = np.where(fwd, left[:, None], right[:, None]).ravel()
    receivers = np.where(fwd, right[:, None], left[:, None]).ravel()
    perm = rng.permutation(len(ucb))
    full = perm[np.argsort(-ucb[perm], kind="stable")]
    reduced = perm[_pair_best_mask(ucb2, perm)[perm]]
    reduced = reduced[np.argsort(-ucb[reduced], kind="stable")]
    assert len(reduced) == n_pairs
    assert greedy_disjoint(senders, receivers, reduced, budget, n) == greedy_disjoint_sequential(
        senders, receivers, full, budget, n
    )
