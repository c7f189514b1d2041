"""LinUCB state: Sherman–Morrison against an explicit inverse, and UCB scoring."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from peerlm.services.cpm import ContextFeatures, LinUCB

FINITE = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


@st.composite
def update_sequences(draw: st.DrawFn) -> tuple[int, float, list[np.ndarray], list[float]]:
    dim = draw(st.integers(1, 8))
    ridge = draw(st.floats(0.1, 10))
    n = draw(st.integers(0, 40))
    xs = [draw(arrays(np.float64, dim, elements=FINITE)) for _ in range(n)]
    rs = [draw(FINITE) for _ in range(n)]
    return dim, ridge, xs, rs


@settings(max_examples=60, deadline=None)
@given(update_sequences())
def test_sherman_morrison_matches_explicit_inverse(
    case: tuple[int, float, list[np.ndarray], list[float]],
) -> None:
    dim, ridge, xs, rs = case
    bandit = LinUCB(dim, ridge)
    a = ridge * np.eye(dim)
    b = np.zeros(dim)
    for x, r in zip(xs, rs, strict=True):
        bandit.update(x, r)
        a += np.outer(x, x)
        b += r * x
    expected = np.linalg.inv(a)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(bandit.a_inv, expected, rtol=1e-8, atol=1e-10 * scale)
    np.testing.assert_allclose(bandit.b, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bandit.theta, np.linalg.solve(a, b), rtol=1e-6, atol=1e-8)
    assert bandit.n_updates == len(xs)
    # The s s^T form keeps A^-1 bitwise symmetric without a symmetrising pass.
    assert np.array_equal(bandit.a_inv, bandit.a_inv.T)


def _trained(dim: int, n: int, seed: int) -> LinUCB:
    rng = np.random.default_rng(seed)
    bandit = LinUCB(dim, 0.5)
    for _ in range(n):
        bandit.update(rng.normal(size=dim), float(rng.normal()))
    return bandit


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(0, 30),
    st.integers(1, 12),
    st.floats(0, 3),
    st.integers(0, 2**32 - 1),
)
def test_ucb_scores_match_per_candidate_loop(
    dim: int, n_updates: int, m: int, beta: float, seed: int
) -> None:
    bandit = _trained(dim, n_updates, seed)
    contexts = np.random.default_rng(seed + 1).normal(size=(m, dim))
    ucb, mean = bandit.score(contexts, beta)
    a_inv, theta = np.array(bandit.a_inv), np.array(bandit.theta)
    for k, x in enumerate(contexts):
        mu = float(theta @ x)
        bonus = beta * np.sqrt(max(float(x @ a_inv @ x), 0.0))
        assert mean[k] == pytest.approx(mu, rel=1e-10, abs=1e-10)
        assert ucb[k] == pytest.approx(mu + bonus, rel=1e-10, abs=1e-10)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(2, 7),
    st.booleans(),
    st.booleans(),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
)
def test_score_pairs_matches_scoring_built_contexts(
    profile_dim: int,
    n_agents: int,
    interaction: bool,
    trust: bool,
    n_protocols: int,
    n_roles: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    protocols = [f"p{k}" for k in range(n_protocols)]
    roles = [f"r{k}" for k in range(n_roles)]
    features = ContextFeatures(profile_dim, protocols, roles, interaction=interaction, trust=trust)
    bandit = _trained(features.dim, 25, seed)
    profiles = rng.normal(size=(n_agents, profile_dim))
    trust_vec = rng.random(n_agents)
    left, right = np.triu_indices(n_agents, 1)
    ucb2, mean2 = bandit.score_pairs(features.layout, profiles, trust_vec, left, right, 0.7)
    combos = n_protocols * n_roles
    assert ucb2.shape == (len(left), 2 * combos)
    for p, (i, j) in enumerate(zip(left, right, strict=True)):
        for col in range(2 * combos):
            s, r = (i, j) if col < combos else (j, i)
            c = col % combos
            x = features.single(
                profiles[s], profiles[r], protocols[c // n_roles], roles[c % n_roles],
                trust_vec[s], trust_vec[r],
            )  # fmt: skip
            ucb, mean = bandit.score(x[None, :], 0.7)
            assert ucb2[p, col] == pytest.approx(ucb[0], rel=1e-9, abs=1e-9)
            assert mean2[p, col] == pytest.approx(mean[0], rel=1e-9, abs=1e-9)
    # The matchmaker's default: the per-pair part in float32, within float32 rounding.
    ucb32, mean32 = bandit.score_pairs(
        features.layout, profiles, trust_vec, left, right, 0.7, dtype=np.float32
    )
    assert ucb32.dtype == np.float64
    scale = 1.0 + np.abs(ucb2)
    assert np.all(np.abs(ucb32 - ucb2) <= 1e-4 * scale)
    assert np.all(np.abs(mean32 - mean2) <= 1e-4 * (1.0 + np.abs(mean2)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_score_pairs_over_many_blocks_matches_built_contexts(dtype: type) -> None:
    """More pairs than one block (1024), in both precisions, against LinUCB.score."""
    rng = np.random.default_rng(11)
    features = ContextFeatures(6, ["a", "b"], ["one_way"], interaction=True, trust=True)
    bandit = _trained(features.dim, 40, 11)
    n = 70
    profiles = rng.uniform(-1, 1, size=(n, 6))
    trust_vec = rng.random(n)
    left, right = np.triu_indices(n, 1)
    ucb2, mean2 = bandit.score_pairs(
        features.layout, profiles, trust_vec, left, right, 0.9, dtype=dtype
    )
    combos = 2
    senders = np.concatenate([np.repeat(left, combos), np.repeat(right, combos)])
    receivers = np.concatenate([np.repeat(right, combos), np.repeat(left, combos)])
    combo = np.tile(np.arange(combos), 2 * len(left))
    x = features.build(profiles, trust_vec, senders, receivers, combo, np.zeros_like(combo))
    ucb, mean = bandit.score(x, 0.9)
    # Rows of x: all forward tuples, then all reverse; columns of ucb2: forward, reverse.
    expect = np.hstack(
        [
            ucb[: combos * len(left)].reshape(-1, combos),
            ucb[combos * len(left) :].reshape(-1, combos),
        ]
    )
    expect_mean = np.hstack(
        [
            mean[: combos * len(left)].reshape(-1, combos),
            mean[combos * len(left) :].reshape(-1, combos),
        ]
    )
    tol = 1e-9 if dtype is np.float64 else 1e-4
    np.testing.assert_allclose(ucb2, expect, rtol=tol, atol=tol)
    np.testing.assert_allclose(mean2, expect_mean, rtol=tol, atol=tol)


def test_score_pairs_rejects_other_dtypes() -> None:
    features = ContextFeatures(3, ["a"], ["one_way"])
    bandit = LinUCB(features.dim)
    idx = np.array([0])
    with pytest.raises(ValueError, match="float32 or float64"):
        bandit.score_pairs(
            features.layout, np.zeros((2, 3)), np.zeros(2), idx, idx + 1, 1.0, dtype=np.float16
        )


def test_initial_state_is_ridge_identity() -> None:
    bandit = LinUCB(4, ridge=2.0)
    np.testing.assert_array_equal(bandit.a_inv, np.eye(4) / 2.0)
    np.testing.assert_array_equal(bandit.theta, np.zeros(4))
    ucb, mean = bandit.score(np.array([[1.0, 0, 0, 0]]), beta=2.0)
    assert mean[0] == 0.0
    assert ucb[0] == pytest.approx(2.0 * np.sqrt(0.5))


def test_views_are_read_only() -> None:
    bandit = _trained(3, 5, 0)
    for arr in (bandit.a_inv, bandit.b, bandit.theta):
        with pytest.raises(ValueError):
            arr[0] = 1.0


# NaN/Inf in the context trips numpy's invalid-value warning before the check rejects it.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(
    "x",
    [np.array([1.0, np.nan, 0.0]), np.array([np.inf, 0.0, 0.0]), np.ones(4), np.ones((3, 1))],
)
def test_bad_context_rejected_without_change(x: np.ndarray) -> None:
    bandit = _trained(3, 5, 1)
    a_inv, b, n = np.array(bandit.a_inv), np.array(bandit.b), bandit.n_updates
    with pytest.raises(ValueError):
        bandit.update(x, 1.0)
    np.testing.assert_array_equal(bandit.a_inv, a_inv)
    np.testing.assert_array_equal(bandit.b, b)
    assert bandit.n_updates == n


def test_non_finite_reward_rejected() -> None:
    bandit = LinUCB(2)
    with pytest.raises(ValueError):
        bandit.update(np.ones(2), float("nan"))
    assert bandit.n_updates == 0


def test_from_arrays_round_trip_is_exact() -> None:
    bandit = _trained(5, 20, 2)
    copy = LinUCB.from_arrays(np.array(bandit.a_inv), np.array(bandit.b), bandit.n_updates)
    assert np.array_equal(copy.a_inv, bandit.a_inv)
    assert np.array_equal(copy.b, bandit.b)
    assert copy.n_updates == bandit.n_updates
    x = np.arange(5.0)
    assert np.array_equal(copy.score(x[None], 1.0)[0], bandit.score(x[None], 1.0)[0])


@pytest.mark.parametrize(
    ("a_inv", "b", "n"),
    [
        (np.eye(3), np.zeros(2), 0),  # b of the wrong length
        (np.ones((2, 3)), np.zeros(2), 0),  # not square
        (np.array([[1.0, 0.5], [0.0, 1.0]]), np.zeros(2), 0),  # asymmetric
        (np.array([[1.0, np.nan], [np.nan, 1.0]]), np.zeros(2), 0),
        (-np.eye(2), np.zeros(2), 0),  # not positive definite
        (np.eye(2), np.zeros(2), -1),
    ],
)
def test_from_arrays_rejects_inconsistent_state(a_inv: np.ndarray, b: np.ndarray, n: int) -> None:
    with pytest.raises(ValueError):
        LinUCB.from_arrays(a_inv, b, n)


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        LinUCB(0)
    with pytest.raises(ValueError):
        LinUCB(3, ridge=0.0)
    with pytest.raises(ValueError):
        LinUCB(3, ridge=float("inf"))


@st.composite
def adversarial_contexts(draw: st.DrawFn) -> tuple[int, list[np.ndarray]]:
    """Profiles at the validator's bound (+-1e6, 0, 1), mixed with honest ones."""
    dp = draw(st.integers(2, 8))
    n = draw(st.integers(1500, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    values = np.array([-1e6, 1e6, 0.0, 1.0, -1.0, 1e-6])
    feats = ContextFeatures(dp)
    xs = []
    for k in range(n):
        pool = values if k % 7 else np.array([0.1, 0.2, 0.5])
        mat = feats.bound_profiles(rng.choice(pool, size=(2, dp)))
        trust = rng.uniform(0, 1, 2)
        xs.append(feats.single(mat[0], mat[1], "akd", "one_way", *trust))
    return dp, xs


@settings(max_examples=6, deadline=None)
@given(adversarial_contexts(), st.floats(1e-3, 1e-2))
def test_adversarial_contexts_keep_a_inv_positive_definite(
    case: tuple[int, list[np.ndarray]], reward: float
) -> None:
    dp, xs = case
    feats = ContextFeatures(dp)
    bandit = LinUCB(feats.dim)
    for x in xs:
        assert np.linalg.norm(x) <= feats.max_context_norm * (1 + 1e-12)
        bandit.update(x, reward)
        inv = np.asarray(bandit.a_inv)
        assert np.array_equal(inv, inv.T)
        assert float(np.min(np.diag(inv))) > 0
    a = np.eye(feats.dim) + sum(np.outer(x, x) for x in xs)
    inv = np.asarray(bandit.a_inv)
    assert np.linalg.eigvalsh(inv).min() > 0
    expected = np.linalg.inv(a)
    np.testing.assert_allclose(inv, expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
    assert bandit.check()


def test_sherman_morrison_alone_fails_where_refactoring_holds() -> None:
    """The unbounded attack broke plain Sherman–Morrison; A kept beside A^-1 recovers."""
    rng = np.random.default_rng(0)
    feats = ContextFeatures(32)
    plain = LinUCB(feats.dim, refactor_every=10**9)
    robust = LinUCB(feats.dim)
    failed = False
    for _ in range(400):
        p = rng.choice([-1e6, 1e6, 0.0, 1.0], size=(2, 32))
        x = feats.single(p[0], p[1], "akd", "one_way")  # deliberately not bounded
        if not failed:
            try:
                plain.commit(x, plain.prepare(x), 0.01)
            except ValueError:
                failed = True
        robust.update(feats.bound_context(x), 0.01)
    assert failed or not plain.check(), "the unbounded, unrefactored bandit should break"
    assert robust.check()


def test_from_arrays_rederives_a_drifted_inverse() -> None:
    bandit = _trained(5, 30, 3)
    bad = np.array(bandit.a_inv) * -1.0
    restored = LinUCB.from_arrays(bad, bandit.b, bandit.n_updates, np.array(bandit.a))
    assert restored.check()
    np.testing.assert_allclose(restored.a_inv, bandit.a_inv, rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="positive definite"):
        LinUCB.from_arrays(bad, bandit.b, bandit.n_updates)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(0, 40), st.integers(1, 70), st.integers(0, 2**32 - 1))
def test_block_update_equals_sequential_updates(dim: int, warm: int, k: int, seed: int) -> None:
    """One Woodbury step (the CPM's group commit) equals k rank-one steps to rounding."""
    rng = np.random.default_rng(seed)
    xs, rs = rng.normal(size=(k, dim)), rng.normal(size=k)
    block, seq = _trained(dim, warm, seed), _trained(dim, warm, seed)
    block.update_block(xs, rs)
    for x, r in zip(xs, rs, strict=True):
        seq.update(x, float(r))
    np.testing.assert_allclose(block.a_inv, seq.a_inv, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(block.b, seq.b, rtol=1e-12, atol=1e-12)
    assert block.n_updates == seq.n_updates and block.check()
    assert np.array_equal(block.a_inv, block.a_inv.T)
    with pytest.raises(ValueError, match="finite"):
        block.update_block(np.full((2, dim), np.nan), np.zeros(2))
    assert block.n_updates == seq.n_updates


def test_pair_tables_score_any_subset_of_their_agents_and_go_stale_on_update() -> None:
    # A round's refill passes score pairs among leftovers from tables built once for all
    # agents: the same figures as tables built for the leftovers alone.
    features = ContextFeatures(6, ["akd", "pmix"], ["teacher"], interaction=True, trust=True)
    bandit = _trained(features.dim, 25, 3)
    rng = np.random.default_rng(3)
    profiles, trust_vec = rng.normal(size=(30, 6)), rng.random(30)
    tables = bandit.pair_tables(features.layout, profiles, trust_vec, dtype=np.float32)
    sub = np.array([2, 5, 11, 17, 29])
    left, right = np.triu_indices(len(sub), 1)
    got = bandit.score_pair_tables(tables, sub[left], sub[right], 0.7)
    want = bandit.score_pairs(
        features.layout, profiles[sub], trust_vec[sub], left, right, 0.7, dtype=np.float32
    )
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g, w, rtol=1e-5, atol=1e-6)
    bandit.update(features.single(profiles[0], profiles[1], "akd", "teacher", 0.5, 0.5), 1.0)
    with pytest.raises(ValueError, match="stale"):
        bandit.score_pair_tables(tables, sub[left], sub[right], 0.7)
