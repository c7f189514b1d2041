"""The synthetic federation: deterministic, documented layout, honest reward structure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.bench.synthetic import (
    DYNAMIC_SLICE,
    FAMILY_SLICE,
    HISTOGRAM_SLICE,
    PROFILE_DIM,
    OracleMatchmaker,
    SyntheticConfig,
    SyntheticFederation,
    js_divergence,
    max_weight_matching,
)


def _random_pairs(env: SyntheticFederation, rng: np.random.Generator) -> list[tuple[str, str]]:
    perm = rng.permutation(len(env.names))
    return [
        (env.names[int(perm[2 * k])], env.names[int(perm[2 * k + 1])])
        for k in range(len(perm) // 2)
    ]


def _play(env: SyntheticFederation, rounds: int, seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [env.step(_random_pairs(env, rng)) for _ in range(rounds)]


@pytest.mark.parametrize("het", ["high", "low"])
def test_deterministic_under_a_seed(het: str) -> None:
    a = SyntheticFederation(12, het, seed=7)  # type: ignore[arg-type]
    b = SyntheticFederation(12, het, seed=7)  # type: ignore[arg-type]
    for x, y in zip(a.profiles().values(), b.profiles().values(), strict=True):
        np.testing.assert_array_equal(x, y)
    assert _play(a, 5, 1) == _play(b, 5, 1)
    np.testing.assert_array_equal(a.skills, b.skills)
    np.testing.assert_array_equal(a.profile_matrix(), b.profile_matrix())
    c = SyntheticFederation(12, het, seed=8)  # type: ignore[arg-type]
    assert not np.array_equal(a.copy().skills, c.skills)
    np.testing.assert_array_equal(a.copy().skills, SyntheticFederation(12, het, 7).skills)


def test_profiles_are_stable_within_a_round() -> None:
    env = SyntheticFederation(6, "high", 0)
    first = env.profiles()
    second = env.profiles()
    for name in env.names:
        np.testing.assert_array_equal(first[name], second[name])
    first[env.names[0]][:] = 99.0  # a copy: the environment is unaffected
    assert env.profiles()[env.names[0]][0] != 99.0


@pytest.mark.parametrize(("n", "het"), [(8, "high"), (16, "low"), (33, "high")])
def test_profile_layout(n: int, het: str) -> None:
    env = SyntheticFederation(n, het, seed=3)  # type: ignore[arg-type]
    for _ in range(3):
        profiles = env.profiles()
        assert list(profiles) == list(env.names)
        mat = np.stack(list(profiles.values()))
        assert mat.shape == (n, PROFILE_DIM)
        assert np.all(np.isfinite(mat))
        fam = mat[:, FAMILY_SLICE]
        assert set(np.unique(fam)) <= {0.0, 1.0}
        np.testing.assert_array_equal(fam.sum(axis=1), 1.0)
        np.testing.assert_array_equal(fam.argmax(axis=1), env.families)
        hist = mat[:, HISTOGRAM_SLICE]
        assert np.all(hist >= 0)
        np.testing.assert_allclose(hist.sum(axis=1), 1.0)
        dyn = mat[:, DYNAMIC_SLICE]
        assert np.all((dyn[:, 0] >= 0) & (dyn[:, 0] <= 1))  # profile[8]: pass@1
        # profile[8] is a noisy view of the true local pass@1.
        noise = env.config.profile_noise
        assert np.max(np.abs(dyn[:, 0] - env.client_pass_at_1())) < 6 * noise
        env.step(_random_pairs(env, np.random.default_rng(0)))
    # Deltas (profile[11], [12]) are the change of the reported pass@1 / loss.
    before = env.profile_matrix()
    env.step([])
    after = env.profile_matrix()
    np.testing.assert_allclose(after[:, 11], after[:, 8] - before[:, 8])
    np.testing.assert_allclose(after[:, 12], after[:, 9] - before[:, 9])


def test_heterogeneity_changes_the_data_spread() -> None:
    high = SyntheticFederation(64, "high", 0)
    low = SyntheticFederation(64, "low", 0)
    js_high = high.js_matrix()[np.triu_indices(64, 1)].mean()
    js_low = low.js_matrix()[np.triu_indices(64, 1)].mean()
    assert js_high > 0.5 > 0.1 > js_low
    assert len(set(low.families.tolist())) <= low.config.families_low
    assert len(set(high.families.tolist())) > 2


def test_js_matrix_matches_pairwise_function() -> None:
    env = SyntheticFederation(7, "high", 2)
    js = env.js_matrix()
    for i, j in itertools.combinations(range(7), 2):
        assert js[i, j] == pytest.approx(js_divergence(env.distribution[i], env.distribution[j]))
        assert js[i, j] == pytest.approx(env.js_divergence(env.names[i], env.names[j]))
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert js_divergence([0.5, 0.5], [0.5, 0.5]) == pytest.approx(0.0)


def test_expected_reward_matrix_matches_scalar() -> None:
    env = SyntheticFederation(6, "high", 4)
    e = env.expected_reward_matrix()
    assert np.all(np.isnan(np.diag(e)))
    for i, j in itertools.permutations(range(6), 2):
        assert e[i, j] == pytest.approx(env.expected_reward(env.names[i], env.names[j]))
    with pytest.raises(ValueError):
        env.expected_reward(env.names[0], env.names[0])


def test_rewards_are_expected_plus_gaussian_noise() -> None:
    """Observed rewards scatter around the true expectation with the configured noise."""
    diffs = []
    for seed in range(400):
        env = SyntheticFederation(2, "high", seed)
        s, r = env.names
        expected = env.expected_reward(s, r)
        [observed] = env.step([(s, r)])
        diffs.append(observed - expected)
    d = np.array(diffs)
    assert abs(d.mean()) < 0.05
    assert d.std() == pytest.approx(SyntheticConfig().reward_noise, rel=0.15)


def test_noise_free_rewards_equal_expectation() -> None:
    cfg = SyntheticConfig(reward_noise=0.0)
    env = SyntheticFederation(10, "high", 1, cfg)
    pairs = _random_pairs(env, np.random.default_rng(1))
    expected = [env.expected_reward(s, r) for s, r in pairs]
    assert env.step(pairs) == pytest.approx(expected)


def test_reward_structure_compatibility_and_complementarity() -> None:
    """Incompatible families transfer negatively; a stronger compatible teacher helps more."""
    cfg = SyntheticConfig(reward_noise=0.0, delta_per_kb=0.0)
    env = SyntheticFederation(64, "high", 11, cfg)
    e = env.expected_reward_matrix()
    compat = env._compat  # hidden state, read by the test only
    off = ~np.eye(64, dtype=bool)
    # Negative compatibility -> strictly negative expected reward (negative transfer).
    neg = (compat < 0) & off
    assert neg.any()
    assert np.all(e[neg] < 0)
    # Positive compatibility and a teacher at least as skilled everywhere -> positive reward.
    skills = env.skills
    dominates = np.all(skills[:, None, :] >= skills[None, :, :], axis=2) & off & (compat > 0)
    strict = dominates & np.any(skills[:, None, :] > skills[None, :, :] + 0.01, axis=2)
    assert strict.any()
    assert np.all(e[strict] > 0)
    # Complementarity is weighted by the student's distribution: raising the teacher's skill
    # in the student's main category raises the reward more than elsewhere.
    main_of = env.distribution.argmax(axis=1)
    room = [
        (s, r)
        for s, r in np.argwhere(strict)
        if skills[s, main_of[r]] + 0.05 < env.capacity[r]
        and skills[s, env.distribution[r].argmin()] + 0.05 < env.capacity[r]
    ]
    assert room
    s, r = room[0]
    main = int(main_of[r])
    minor = int(np.argmin(env.distribution[r]))
    base = env.expected_reward(env.names[s], env.names[r])
    env.skills[s, main] += 0.05
    up_main = env.expected_reward(env.names[s], env.names[r])
    env.skills[s, main] -= 0.05
    env.skills[s, minor] += 0.05
    up_minor = env.expected_reward(env.names[s], env.names[r])
    assert up_main - base > up_minor - base >= 0


def test_communication_cost_lowers_rewards() -> None:
    a = SyntheticFederation(8, "high", 3, SyntheticConfig(delta_per_kb=0.0))
    b = SyntheticFederation(8, "high", 3)
    ea, eb = a.expected_reward_matrix(), b.expected_reward_matrix()
    off = ~np.eye(8, dtype=bool)
    assert np.all(eb[off] < ea[off])


def test_skill_updates_are_bounded() -> None:
    env = SyntheticFederation(16, "high", 2)
    start = env.skills.copy()
    rng = np.random.default_rng(0)
    prev = env.skills.copy()
    for _ in range(200):
        env.step(env.optimal_pairs() if rng.random() < 0.5 else _random_pairs(env, rng))
        assert np.all(env.skills >= 0.0)
        assert np.all(env.skills <= env.capacity[:, None] + 1e-12)
        # One exchange moves a skill by at most eta (times the largest gap, <= 1).
        assert np.max(np.abs(env.skills - prev)) <= env.config.eta + env.config.local_rate
        prev = env.skills.copy()
    assert env.mean_pass_at_1() > float(np.einsum("ik,ik->i", env.distribution, start).mean())


def test_network_does_not_saturate_immediately() -> None:
    env = SyntheticFederation(32, "high", 0)
    p0 = env.mean_pass_at_1()
    for _ in range(10):
        env.step(env.optimal_pairs())
    p10 = env.mean_pass_at_1()
    for _ in range(90):
        env.step(env.optimal_pairs())
    p100 = env.mean_pass_at_1()
    assert p0 < p10 < p100 < 1.0
    assert p10 - p0 < 0.5 * (p100 - p0)  # still rising well after round 10


def test_step_rejects_overlapping_pairs() -> None:
    env = SyntheticFederation(4, "high", 0)
    a, b, c, _ = env.names
    with pytest.raises(ValueError):
        env.step([(a, b), (b, c)])
    with pytest.raises(ValueError):
        env.step([(a, a)])


def test_a_student_of_several_teachers_gains_every_lesson() -> None:
    """``several_teachers``: each lesson's reward is the one it has alone (all from the
    round's state) and the student's skills move by the lessons' deltas added up."""
    env = SyntheticFederation(4, "high", 0, SyntheticConfig(reward_noise=0.0, local_rate=0.0))
    a, b, c, d = env.names
    alone = [env.expected_reward(b, a), env.expected_reward(c, a)]
    start = env.skills[0].copy()
    deltas = []
    for teacher in (b, c):
        twin = env.copy()
        twin.step([(teacher, a)])
        deltas.append(twin.skills[0] - start)
    rewards = env.step([(b, a), (c, a)], several_teachers=True)
    assert rewards == pytest.approx(alone)
    expected = np.clip(start + deltas[0] + deltas[1], 0.0, env.capacity[0])
    assert env.skills[0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="twice"):
        env.step([(b, a), (b, a)], several_teachers=True)
    with pytest.raises(ValueError, match="also teach"):
        env.step([(b, a), (a, d)], several_teachers=True)
    with pytest.raises(ValueError, match="disjoint"):
        env.step([(b, a), (c, a)])


@pytest.mark.parametrize("n", [2, 5, 8, 13])
def test_oracle_beats_every_pairing(n: int) -> None:
    """The oracle's total true expected reward is >= that of any disjoint pairing."""
    env = SyntheticFederation(n, "high", n)
    e = env.expected_reward_matrix()
    oracle = env.optimal_value()
    assert oracle == pytest.approx(env.expected_total(OracleMatchmaker(env).select_pairs()))
    k = n // 2
    best = -np.inf
    # Exhaustive over maximum matchings and both directions for small n.
    for perm in itertools.permutations(range(n)):
        pairs = [(perm[2 * i], perm[2 * i + 1]) for i in range(k)]
        if any(a > b for a, b in pairs) or [a for a, _ in pairs] != sorted(a for a, _ in pairs):
            continue
        best = max(best, sum(max(e[a, b], e[b, a]) for a, b in pairs))
        if n > 8:
            break
    assert oracle >= best - 1e-12
    if n <= 8:
        assert oracle == pytest.approx(best)


def test_oracle_beats_baselines_every_round() -> None:
    from peerlm.services.cpm import HeteroGreedyMatchmaker, Matchmaker, RandomMatchmaker

    env = SyntheticFederation(16, "high", 1)
    policies = [RandomMatchmaker(seed=0), HeteroGreedyMatchmaker(), Matchmaker(seed=0)]
    for _ in range(10):
        e = env.expected_reward_matrix()
        opt = env.optimal_value(e)
        profiles = env.profiles()
        for pol in policies:
            chosen = pol.select(profiles)
            value = sum(e[env.index(p.sender), env.index(p.receiver)] for p in chosen)
            assert opt >= value - 1e-9
            for p in chosen:
                pol.observe(p, env.expected_reward(p.sender, p.receiver))
        env.step(env.optimal_pairs(e))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 21), st.integers(0, 2**31 - 1))
def test_matching_backends_agree(n: int, seed: int) -> None:
    pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n, n))
    w = w + w.T
    a = max_weight_matching(w, "networkx")
    b = max_weight_matching(w, "milp")
    assert len(a) == len(b) == n // 2
    for m in (a, b):
        used = [v for e in m for v in e]
        assert len(set(used)) == len(used)
    assert sum(w[i, j] for i, j in a) == pytest.approx(sum(w[i, j] for i, j in b))
