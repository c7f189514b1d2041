"""The LinUCB matchmaker: Algorithm 2 invariants, feedback, persistence, learning, prefilter."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import (
    CheapScore,
    Matchmaker,
    MatchmakerState,
    Pairing,
    RandomMatchmaker,
    prefilter_pairs,
)

Profiles = dict[str, np.ndarray]


def random_profiles(rng: np.random.Generator, n: int, dim: int = 32) -> Profiles:
    return {f"agent-{k:03d}": rng.random(dim) for k in range(n)}


def aligned_profiles(rng: np.random.Generator, n: int) -> Profiles:
    """Profiles with a hidden unit vector z in [8:10]; the pair is compatible iff z_s . z_r > 0."""
    out = {}
    for k in range(n):
        p = rng.uniform(0.0, 0.2, 32)
        angle = rng.uniform(0.0, 2 * np.pi)
        p[8:10] = (np.cos(angle), np.sin(angle))
        out[f"agent-{k:03d}"] = p
    return out


def compat(profiles: Profiles, pairing: Pairing) -> float:
    return float(profiles[pairing.sender][8:10] @ profiles[pairing.receiver][8:10])


def train(
    m: Matchmaker | RandomMatchmaker,
    rounds: int,
    n: int,
    make: Callable[[np.random.Generator, int], Profiles],
    reward: Callable[[Profiles, Pairing], float],
    seed: int,
    noise: float = 0.3,
) -> list[tuple[Profiles, list[Pairing]]]:
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(rounds):
        profiles = make(rng, n)
        pairings = m.select(profiles)
        for p in pairings:
            m.observe(p, reward(profiles, p) + float(rng.normal(0.0, noise)))
        history.append((profiles, pairings))
    return history


def assert_valid_matching(pairings: list[Pairing], profiles: Profiles, budget: int) -> None:
    assert len(pairings) <= budget
    agents = [a for p in pairings for a in (p.sender, p.receiver)]
    assert len(agents) == len(set(agents)), "an agent appears twice"
    assert set(agents) <= set(profiles)
    assert all(p.sender != p.receiver for p in pairings)


# -- basics ------------------------------------------------------------------------------


def test_defaults_and_trivial_rounds() -> None:
    m = Matchmaker(profile_dim=32, seed=3)
    assert m.context_dim == 132
    assert m.n_updates == 0
    np.testing.assert_array_equal(m.theta, np.zeros(132))
    assert m.select({}) == []
    assert m.select({"solo": np.zeros(32)}) == []
    pairs = m.select({"a": np.zeros(32), "b": np.ones(32)})
    assert len(pairs) == 1 and {pairs[0].sender, pairs[0].receiver} == {"a", "b"}
    assert (pairs[0].protocol, pairs[0].role) == ("akd", "one_way")
    assert Matchmaker(32, interaction_features=False).context_dim == 68


def test_budget_defaults_to_half_and_is_respected() -> None:
    profiles = random_profiles(np.random.default_rng(0), 11)
    assert len(Matchmaker(32, seed=0).select(profiles)) == 5
    assert len(Matchmaker(32, pair_budget=2, seed=0).select(profiles)) == 2
    assert Matchmaker(32, pair_budget=0, seed=0).select(profiles) == []
    assert len(Matchmaker(32, pair_budget=99, seed=0).select(profiles)) == 5


@pytest.mark.parametrize(("precision", "tol"), [("float64", 1e-9), ("float32", 1e-5)])
def test_pairing_scores_match_context(precision: str, tol: float) -> None:
    m = Matchmaker(32, beta=0.7, seed=1, score_precision=precision)  # type: ignore[arg-type]
    train(m, 5, 10, random_profiles, lambda p, q: 1.0, seed=1)
    a_inv, theta = np.array(m.snapshot().a_inv), np.array(m.theta)
    for p in m.select(random_profiles(np.random.default_rng(9), 10)):
        x = p.context
        assert x.shape == (m.context_dim,) and not x.flags.writeable
        assert p.mean == pytest.approx(float(theta @ x), abs=tol)
        assert p.ucb == pytest.approx(float(theta @ x) + 0.7 * math.sqrt(x @ a_inv @ x), abs=tol)


def test_score_precision_is_validated() -> None:
    with pytest.raises(ValueError, match="score_precision"):
        Matchmaker(8, score_precision="float16")  # type: ignore[arg-type]


def test_pairings_come_in_descending_ucb() -> None:
    m = Matchmaker(32, seed=2)
    train(m, 5, 12, random_profiles, lambda p, q: float(np.sum(p[q.sender][:3])), seed=2)
    ucbs = [p.ucb for p in m.select(random_profiles(np.random.default_rng(1), 12))]
    assert ucbs == sorted(ucbs, reverse=True)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 14),
    budget=st.one_of(st.none(), st.integers(0, 9)),
    seed=st.integers(0, 2**16),
    n_obs=st.integers(0, 12),
    matching=st.sampled_from(["greedy", "blossom"]),
)
def test_selection_is_a_valid_matching(
    n: int, budget: int | None, seed: int, n_obs: int, matching: str
) -> None:
    rng = np.random.default_rng(seed)
    m = Matchmaker(8, pair_budget=budget, seed=seed, matching=matching)  # type: ignore[arg-type]
    warm = random_profiles(rng, 6, dim=8)
    for p in m.select(warm)[:n_obs]:
        m.observe(p, float(rng.normal()))
    profiles = random_profiles(rng, n, dim=8)
    pairings = m.select(profiles)
    limit = n // 2 if budget is None else min(budget, n // 2)
    assert_valid_matching(pairings, profiles, limit)
    # With every pair scored, both methods fill the budget exactly (Algorithm 2).
    assert len(pairings) == limit


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 12), budget=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_blossom_weight_at_least_greedy(n: int, budget: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    greedy = Matchmaker(6, pair_budget=budget, seed=seed, beta=0.5)
    blossom = Matchmaker(6, pair_budget=budget, seed=seed, beta=0.5, matching="blossom")
    for _ in range(3):
        profiles = random_profiles(rng, 8, dim=6)
        for p in greedy.select(profiles):
            r = float(rng.normal())
            greedy.observe(p, r)
            blossom.observe(p, r)
    profiles = random_profiles(rng, n, dim=6)
    g, b = greedy.select(profiles), blossom.select(profiles)
    assert_valid_matching(b, profiles, budget)
    assert len(b) == len(g) == min(budget, n // 2)
    assert sum(p.ucb for p in b) >= sum(p.ucb for p in g) - 1e-9


def test_deterministic_under_seed_and_independent_of_mapping_order() -> None:
    profiles = random_profiles(np.random.default_rng(4), 12)
    reordered = dict(reversed(list(profiles.items())))
    a = Matchmaker(32, seed=11).select(profiles)
    b = Matchmaker(32, seed=11).select(reordered)
    assert a == b


def test_ties_broken_by_seed_not_by_order() -> None:
    # Identical profiles and an untrained model: every candidate ties exactly.
    profiles = {f"a{k}": np.full(32, 0.5) for k in range(10)}

    def round_of(seed: int) -> list[tuple[str, str]]:
        return [(p.sender, p.receiver) for p in Matchmaker(32, seed=seed).select(profiles)]

    assert round_of(5) == round_of(5)
    outcomes = {tuple(round_of(seed)) for seed in range(8)}
    assert len(outcomes) > 1
    # Not simply sorted order: some pair is not (a0, a1), (a2, a3), ...
    assert any(o != (("a0", "a1"), ("a2", "a3"), ("a4", "a5"), ("a6", "a7"), ("a8", "a9"))
               for o in outcomes)  # fmt: skip


def test_consecutive_rounds_without_feedback_draw_fresh_ties() -> None:
    profiles = {f"a{k}": np.full(32, 0.5) for k in range(10)}
    m = Matchmaker(32, seed=0)
    rounds = {tuple((p.sender, p.receiver) for p in m.select(profiles)) for _ in range(6)}
    assert len(rounds) > 1


def test_select_rejects_bad_profiles() -> None:
    m = Matchmaker(32, seed=0)
    with pytest.raises(ValueError):
        m.select({"a": np.zeros(32), "b": np.zeros(31)})
    with pytest.raises(ValueError):
        m.select({"a": np.zeros(32), "b": np.full(32, np.nan)})
    with pytest.raises(ValueError):
        m.select({"a": np.zeros(32), "b": np.full(32, 1e7)})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beta": -1.0},
        {"beta": math.nan},
        {"pair_budget": -1},
        {"seed": -1},
        {"ridge": 0.0},
        {"protocols": ()},
        {"roles": ("one_way", "one_way")},
        {"matching": "hungarian"},
        {"prefilter_k": 0},
        {"prefilter_min_agents": 1},
    ],
)
def test_constructor_validates(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Matchmaker(32, **kwargs)  # type: ignore[arg-type]


# -- feedback ----------------------------------------------------------------------------


def test_observe_updates_with_exactly_the_pairing_context() -> None:
    m = Matchmaker(32, seed=0)
    profiles = random_profiles(np.random.default_rng(0), 6)
    pairings = m.select(profiles)
    a = np.eye(m.context_dim)
    b = np.zeros(m.context_dim)
    for k, p in enumerate(pairings):
        r_norm = m.observe(p, float(k) - 1.0)
        a += np.outer(p.context, p.context)
        b += r_norm * p.context
    assert m.n_updates == len(pairings)
    np.testing.assert_allclose(m.theta, np.linalg.solve(a, b), atol=1e-10)
    np.testing.assert_allclose(m.snapshot().a_inv, np.linalg.inv(a), atol=1e-12)


def test_observe_returns_z_scored_reward() -> None:
    m = Matchmaker(32, seed=0)
    p = m.select(random_profiles(np.random.default_rng(0), 2))[0]
    assert m.observe(p, 3.0) == 0.0
    assert m.observe(p, 5.0) == pytest.approx(1.0, abs=1e-5)


def test_trust_counts_the_sender_only() -> None:
    m = Matchmaker(32, seed=0)
    p = m.select(random_profiles(np.random.default_rng(0), 2))[0]
    m.observe(p, 0.5)
    m.observe(p, -0.5)
    m.observe(p, 0.1)
    trust = m.snapshot().trust
    assert trust == {p.sender: (3, 2)}
    assert m.trust(p.sender) == pytest.approx(3 / 5)
    assert m.trust(p.receiver) == 0.5


@pytest.mark.parametrize("bad_reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_leaves_state_unchanged(bad_reward: float) -> None:
    m = Matchmaker(32, seed=0)
    profiles = random_profiles(np.random.default_rng(0), 4)
    p = m.select(profiles)[0]
    m.observe(p, 1.0)
    before = m.snapshot()
    with pytest.raises(ValueError):
        m.observe(p, bad_reward)
    assert m.snapshot() == before


# NaN/Inf in the context trips numpy's invalid-value warning before the check rejects it.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("context", [np.zeros(10), np.full(132, np.nan), np.full(132, np.inf)])
def test_bad_context_leaves_state_unchanged(context: np.ndarray) -> None:
    m = Matchmaker(32, seed=0)
    p = m.select(random_profiles(np.random.default_rng(0), 4))[0]
    m.observe(p, 1.0)
    before = m.snapshot()
    forged = Pairing(p.sender, p.receiver, p.protocol, p.role, context, p.ucb, p.mean)
    with pytest.raises(ValueError):
        m.observe(forged, 1.0)
    assert m.snapshot() == before


def test_pairing_context_is_immutable_copy() -> None:
    x = np.ones(4)
    p = Pairing("a", "b", "akd", "one_way", x, 1.0, 0.5)
    x[0] = 9.0
    assert p.context[0] == 1.0
    with pytest.raises(ValueError):
        p.context[0] = 2.0
    assert p == Pairing("a", "b", "akd", "one_way", np.ones(4), 1.0, 0.5)
    assert hash(p) == hash(Pairing("a", "b", "akd", "one_way", np.ones(4), 1.0, 0.5))
    assert p != Pairing("a", "b", "akd", "one_way", np.zeros(4), 1.0, 0.5)


# -- persistence -------------------------------------------------------------------------


def test_snapshot_holds_plain_types_only() -> None:
    m = Matchmaker(32, seed=0)
    train(m, 3, 8, random_profiles, lambda p, q: 1.0, seed=0)
    s = m.snapshot()
    assert isinstance(s, MatchmakerState)
    assert s.a_inv.dtype == np.float64 and s.a_inv.shape == (132, 132)
    assert s.b.dtype == np.float64 and s.b.shape == (132,)
    assert all(isinstance(v, int) for v in (s.context_dim, s.n_updates, s.reward_count))
    assert all(isinstance(v, float) for v in (s.reward_mean, s.reward_m2))
    assert all(
        isinstance(k, str) and all(isinstance(c, int) for c in v) for k, v in s.trust.items()
    )
    # Raw float64 bytes are enough to rebuild it.
    a = np.frombuffer(s.a_inv.tobytes(), dtype=np.float64).reshape(132, 132)
    assert np.array_equal(a, s.a_inv)
    # The snapshot is a copy.
    s.b[0] = 123.0
    assert m.snapshot().b[0] != 123.0


def test_snapshot_restore_round_trip_selects_identically() -> None:
    m = Matchmaker(32, seed=21)
    train(m, 6, 10, random_profiles, lambda p, q: float(p[q.sender][0] - p[q.receiver][0]), 1)
    state = m.snapshot()
    fresh = Matchmaker(32, seed=21)
    fresh.restore(state)
    assert fresh.snapshot() == state
    assert fresh.n_updates == m.n_updates
    np.testing.assert_array_equal(fresh.theta, m.theta)
    rng = np.random.default_rng(99)
    for _ in range(3):
        profiles = random_profiles(rng, 12)
        assert fresh.select(profiles) == m.select(profiles)
    # Also after further identical feedback on both.
    p = m.select(random_profiles(rng, 4))[0]
    assert m.observe(p, 0.3) == fresh.observe(p, 0.3)
    assert fresh.snapshot() == m.snapshot()


def test_restore_rejects_mismatched_or_corrupt_state_atomically() -> None:
    m = Matchmaker(32, seed=0)
    train(m, 2, 6, random_profiles, lambda p, q: 1.0, seed=0)
    before = m.snapshot()
    with pytest.raises(ValueError):
        m.restore(Matchmaker(16).snapshot())
    bad = m.snapshot()
    bad.a_inv[0, 1] += 1.0  # asymmetric
    with pytest.raises(ValueError):
        m.restore(bad)
    bad = m.snapshot()
    bad.trust = {"x": (1, 5)}
    with pytest.raises(ValueError):
        m.restore(bad)
    bad = m.snapshot()
    bad.reward_m2 = -1.0
    with pytest.raises(ValueError):
        m.restore(bad)
    assert m.snapshot() == before


# -- learning ----------------------------------------------------------------------------


def _good_fraction(history: list[tuple[Profiles, list[Pairing]]]) -> float:
    outcomes = [compat(profiles, p) > 0 for profiles, pairs in history for p in pairs]
    return float(np.mean(outcomes))


def test_interaction_features_learn_pairwise_compatibility() -> None:
    """A linear model on [p_s, p_r] cannot rank partners per agent; one with p_s * p_r can.

    Reward is +1 when the hidden vectors of sender and receiver point the same way, -1
    otherwise (plus noise), with fresh agents every round: the policy must generalise.
    """

    def reward(profiles: Profiles, p: Pairing) -> float:
        return 1.0 if compat(profiles, p) > 0 else -1.0

    results = {}
    policies: dict[str, Matchmaker | RandomMatchmaker] = {
        "interaction": Matchmaker(32, beta=0.5, seed=3),
        "plain": Matchmaker(32, beta=0.5, seed=3, interaction_features=False),
        "random": RandomMatchmaker(seed=3),
    }
    for name, policy in policies.items():
        history = train(policy, 60, 16, aligned_profiles, reward, seed=7)  # 480 rewards
        results[name] = _good_fraction(history[-20:])
    assert results["interaction"] >= 0.85, results
    assert results["plain"] <= 0.7, results
    assert results["random"] <= 0.7, results
    assert results["interaction"] - results["plain"] >= 0.25, results


def test_learns_who_should_teach_whom() -> None:
    """Reward is high only when the stronger agent (pass@1 at [8]) teaches."""

    def make(rng: np.random.Generator, n: int) -> Profiles:
        return random_profiles(rng, n)

    def reward(profiles: Profiles, p: Pairing) -> float:
        return 1.0 if profiles[p.sender][8] > profiles[p.receiver][8] else -1.0

    m = Matchmaker(32, beta=0.5, seed=5)
    history = train(m, 40, 16, make, reward, seed=5)
    late = [
        profiles[p.sender][8] > profiles[p.receiver][8]
        for profiles, pairs in history[-15:]
        for p in pairs
    ]
    assert np.mean(late) >= 0.9


# -- prefiltering ------------------------------------------------------------------------


def _aligned_reward(profiles: Profiles, p: Pairing) -> float:
    return 1.0 if compat(profiles, p) > 0 else -1.0


@pytest.fixture(scope="module")
def trained_state() -> MatchmakerState:
    m = Matchmaker(32, beta=0.5, seed=1)
    train(m, 50, 16, aligned_profiles, _aligned_reward, seed=1)
    return m.snapshot()


def test_small_federations_score_every_pair() -> None:
    m = Matchmaker(32, seed=0, prefilter_min_agents=64, protocols=("akd", "lora"))
    n = 40
    m.select(random_profiles(np.random.default_rng(0), n))
    assert m.last_candidates == n * (n - 1) * 2  # both directions x 2 protocols


def test_prefilter_keeps_o_n_k_candidates(trained_state: MatchmakerState) -> None:
    n, k, extra = 300, 6, 2
    m = Matchmaker(32, beta=0.5, seed=0, prefilter_k=k, prefilter_random=extra)
    m.restore(trained_state)
    profiles = aligned_profiles(np.random.default_rng(3), n)
    pairings = m.select(profiles)
    # Refill passes pair whoever the sparse first pass stranded: the budget is still met.
    assert_valid_matching(pairings, profiles, n // 2)
    assert len(pairings) == n // 2
    assert m.last_candidates < 0.15 * n * (n - 1)
    left, right = prefilter_pairs(
        CheapScore(
            np.stack([profiles[a] for a in sorted(profiles)]),
            np.full(n, 0.5),
            m.features.layout,
            np.array(m.theta),
            np.diagonal(trained_state.a_inv),
            0.5,
        ),
        k,
        extra,
        np.random.default_rng(0),
    )
    assert len(left) <= n * (k + extra)
    assert np.all(left < right)
    degree = np.bincount(np.r_[left, right], minlength=n)
    assert degree.min() >= k
    # The prefiltered matchmaker still picks compatible pairs.
    assert np.mean([compat(profiles, p) > 0 for p in pairings]) >= 0.85


def test_prefilter_finds_the_best_pair(trained_state: MatchmakerState) -> None:
    rng = np.random.default_rng(4)
    profiles = aligned_profiles(rng, 120)
    # Two agents whose hidden vectors are long and aligned: by far the best pair.
    profiles["agent-005"][8:10] = (2.5, 0.0)
    profiles["agent-077"][8:10] = (2.4, 0.1)
    exact = Matchmaker(32, beta=0.5, seed=0, prefilter_min_agents=10_000)
    pre = Matchmaker(32, beta=0.5, seed=0, prefilter_k=3, prefilter_random=0)
    exact.restore(trained_state)
    pre.restore(trained_state)
    best_exact = exact.select(profiles)[0]
    best_pre = pre.select(profiles)[0]
    assert {best_exact.sender, best_exact.receiver} == {"agent-005", "agent-077"}
    assert (best_pre.sender, best_pre.receiver) == (best_exact.sender, best_exact.receiver)
    assert best_pre.ucb == pytest.approx(best_exact.ucb, rel=1e-9)
    assert pre.last_candidates < exact.last_candidates / 5


@pytest.mark.parametrize("kind", ["distinct", "ties", "nan", "inf_ties", "empty", "one"])
def test_descending_order_is_the_stable_descending_argsort(kind: str) -> None:
    from peerlm.services.cpm.matchmaker import _descending

    rng = np.random.default_rng(7)
    values = rng.standard_normal(5000)
    if kind == "ties":
        values = np.round(values, 1)  # many exact ties: the stable order must win
    elif kind == "nan":
        values[[3, 900, 4000]] = np.nan
    elif kind == "inf_ties":
        values[[10, 20, 30]] = -np.inf
    elif kind == "empty":
        values = values[:0]
    elif kind == "one":
        values = values[:1]
    got = _descending(values)
    assert np.array_equal(got, np.argsort(-values, kind="stable"))


def test_select_leaves_the_garbage_collector_as_it_found_it() -> None:
    import gc

    m = Matchmaker(32, seed=0)
    profiles = random_profiles(np.random.default_rng(5), 80)
    assert gc.isenabled()
    first = m.select(profiles)
    assert gc.isenabled() and len(first) == 40
    gc.disable()
    try:
        m.select(profiles)
        assert not gc.isenabled()
    finally:
        gc.enable()
