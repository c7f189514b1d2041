"""Baselines: Random-P2P, Hetero-Greedy (Algorithm 4) and the reward oracle."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import (
    DISTRIBUTION_SLICE,
    PERFORMANCE_INDEX,
    HeteroGreedyMatchmaker,
    Matchmaker,
    OracleMatchmaker,
    Pairing,
    RandomMatchmaker,
    js_divergence,
    js_divergence_matrix,
)


def profile(hist: list[float], perf: float, rng: np.random.Generator | None = None) -> np.ndarray:
    p = np.zeros(32) if rng is None else rng.random(32)
    p[DISTRIBUTION_SLICE] = hist
    p[PERFORMANCE_INDEX] = perf
    return p


def onehot(k: int) -> list[float]:
    h = [0.0] * 12
    h[k] = 1.0
    return h


def check_disjoint(pairings: list[Pairing], agents: set[str], limit: int) -> None:
    members = [a for p in pairings for a in (p.sender, p.receiver)]
    assert len(members) == len(set(members)) and set(members) <= agents
    assert len(pairings) <= limit


# -- JS divergence -----------------------------------------------------------------------


def test_js_divergence_known_values() -> None:
    assert js_divergence(onehot(0), onehot(0)) == 0.0
    assert js_divergence(onehot(0), onehot(1)) == pytest.approx(1.0)
    # p = (1, 0), q = (1/2, 1/2): JS from its definition with base-2 KL divergences.
    p, q = np.array([1.0, 0.0]), np.array([0.5, 0.5])
    m = (p + q) / 2

    def kl(a: np.ndarray, b: np.ndarray) -> float:
        return float(sum(x * math.log2(x / y) for x, y in zip(a, b, strict=True) if x > 0))

    assert js_divergence(p, q) == pytest.approx(0.5 * kl(p, m) + 0.5 * kl(q, m))
    # Unnormalised, negative (DP-noised) and empty histograms are handled.
    assert js_divergence([2.0, 0.0], [5.0, 0.0]) == 0.0
    assert js_divergence([1.0, -0.1], [1.0, 0.0]) == 0.0
    assert js_divergence([0.0, 0.0], [0.5, 0.5]) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32 - 1))
def test_js_matrix_symmetric_bounded_matches_scipy(n: int, seed: int) -> None:
    scipy_distance = pytest.importorskip("scipy.spatial.distance")
    hist = np.random.default_rng(seed).random((n, 12))
    js = js_divergence_matrix(hist)
    assert np.allclose(js, js.T) and np.all(np.diag(js) == 0)
    assert np.all((js >= 0) & (js <= 1))
    for i, j in itertools.combinations(range(n), 2):
        # scipy returns the JS *distance* (the square root of the divergence).
        ref = scipy_distance.jensenshannon(hist[i], hist[j], base=2) ** 2
        assert js[i, j] == pytest.approx(ref, abs=1e-9)


# -- Hetero-Greedy (Algorithm 4) ---------------------------------------------------------


def test_hetero_greedy_picks_max_js_first_and_orients_by_performance() -> None:
    profiles = {
        "a": profile(onehot(0), perf=0.2),
        "b": profile(onehot(1), perf=0.9),  # disjoint from a: JS = 1, the maximum
        "c": profile([0.5, 0.5] + [0.0] * 10, perf=0.5),
        "d": profile([0.6, 0.4] + [0.0] * 10, perf=0.1),
    }
    pairs = HeteroGreedyMatchmaker().select(profiles)
    assert len(pairs) == 2
    first, second = pairs
    assert (first.sender, first.receiver) == ("b", "a")  # the higher pass@1 teaches
    assert first.ucb == first.mean == pytest.approx(1.0)
    assert (second.sender, second.receiver) == ("c", "d")
    assert second.ucb < first.ucb
    assert first.protocol == "akd" and first.role == "one_way"
    np.testing.assert_array_equal(first.context, np.r_[profiles["b"], profiles["a"]])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 16), st.one_of(st.none(), st.integers(0, 8)), st.integers(0, 2**16))
def test_hetero_greedy_is_greedy_by_js(n: int, budget: int | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    profiles = {f"a{k:02d}": profile(list(rng.random(12)), float(rng.random())) for k in range(n)}
    policy = HeteroGreedyMatchmaker(pair_budget=budget)
    pairs = policy.select(profiles)
    limit = n // 2 if budget is None else min(budget, n // 2)
    check_disjoint(pairs, set(profiles), limit)
    assert len(pairs) == limit
    assert [p.ucb for p in pairs] == sorted((p.ucb for p in pairs), reverse=True)
    if pairs:
        ids = sorted(profiles)
        js = js_divergence_matrix(np.stack([profiles[a][DISTRIBUTION_SLICE] for a in ids]))
        assert pairs[0].ucb == pytest.approx(js.max())
    for p in pairs:
        assert profiles[p.sender][PERFORMANCE_INDEX] >= profiles[p.receiver][PERFORMANCE_INDEX]
    assert policy.select(profiles) == pairs  # deterministic without a seed


def test_hetero_greedy_needs_the_full_layout() -> None:
    with pytest.raises(ValueError):
        HeteroGreedyMatchmaker(profile_dim=16)


# -- Random ------------------------------------------------------------------------------


def test_random_is_seeded_deterministic_and_valid() -> None:
    rng = np.random.default_rng(0)
    profiles = {f"a{k}": rng.random(32) for k in range(9)}
    a, b = RandomMatchmaker(seed=4), RandomMatchmaker(seed=4)
    rounds_a = [a.select(profiles) for _ in range(5)]
    rounds_b = [b.select(dict(reversed(list(profiles.items())))) for _ in range(5)]
    assert rounds_a == rounds_b
    assert rounds_a != [RandomMatchmaker(seed=5).select(profiles) for _ in range(5)]
    for pairs in rounds_a:
        check_disjoint(pairs, set(profiles), 4)
        assert len(pairs) == 4
    assert len(RandomMatchmaker(pair_budget=2).select(profiles)) == 2
    assert RandomMatchmaker().select({"x": np.zeros(32)}) == []


def test_random_direction_and_protocol_vary() -> None:
    profiles = {"a": np.zeros(32), "b": np.ones(32)}
    policy = RandomMatchmaker(protocols=("akd", "lora"), seed=1)
    seen = {(p.sender, p.protocol) for _ in range(40) for p in policy.select(profiles)}
    assert seen == {("a", "akd"), ("a", "lora"), ("b", "akd"), ("b", "lora")}


# -- Oracle ------------------------------------------------------------------------------


def _brute_force_best(ids: list[str], budget: int, w: dict[tuple[str, str], float]) -> float:
    best = -math.inf
    pairs = list(itertools.combinations(ids, 2))
    for chosen in itertools.combinations(pairs, budget):
        members = [a for p in chosen for a in p]
        if len(set(members)) == len(members):
            best = max(best, sum(w[p] for p in chosen))
    return best


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 7), st.integers(1, 3), st.integers(0, 2**16))
def test_oracle_finds_the_best_matching(n: int, budget: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = [f"a{k}" for k in range(n)]
    table = {(s, r, proto): float(rng.normal()) for s in ids for r in ids for proto in ("x", "y")}

    def fn(sender: str, receiver: str, protocol: str) -> float:
        return table[(sender, receiver, protocol)]

    oracle = OracleMatchmaker(fn, pair_budget=budget, protocols=("x", "y"))
    pairs = oracle.select({a: np.zeros(32) for a in ids})
    limit = min(budget, n // 2)
    check_disjoint(pairs, set(ids), limit)
    assert len(pairs) == limit
    for p in pairs:
        assert p.ucb == table[(p.sender, p.receiver, p.protocol)]
        assert p.ucb == max(
            table[(s, r, proto)]
            for s, r in ((p.sender, p.receiver), (p.receiver, p.sender))
            for proto in ("x", "y")
        )
    w = {
        (a, b): max(table[(s, r, q)] for s, r in ((a, b), (b, a)) for q in ("x", "y"))
        for a, b in itertools.combinations(ids, 2)
    }
    assert sum(p.ucb for p in pairs) == pytest.approx(_brute_force_best(ids, limit, w))


# -- the shared interface ----------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        RandomMatchmaker(seed=0),
        HeteroGreedyMatchmaker(),
        OracleMatchmaker(lambda s, r, p: 0.0),
        Matchmaker(32, seed=0),
    ],
    ids=["random", "hetero", "oracle", "linucb"],
)
def test_policies_share_select_and_observe(
    policy: RandomMatchmaker | HeteroGreedyMatchmaker | OracleMatchmaker | Matchmaker,
) -> None:
    rng = np.random.default_rng(0)
    profiles = {f"a{k}": profile(list(rng.random(12)), float(rng.random()), rng) for k in range(6)}
    pairs = policy.select(profiles)
    assert len(pairs) == 3 and all(isinstance(p, Pairing) for p in pairs)
    value = policy.observe(pairs[0], 0.25)
    assert isinstance(value, float)
    with pytest.raises(ValueError):
        policy.observe(pairs[0], math.nan)


def test_baselines_do_not_learn() -> None:
    policy = HeteroGreedyMatchmaker()
    rng = np.random.default_rng(1)
    profiles = {f"a{k}": profile(list(rng.random(12)), float(rng.random())) for k in range(6)}
    before = policy.select(profiles)
    for p in before:
        assert policy.observe(p, -5.0) == -5.0
    assert policy.select(profiles) == before
