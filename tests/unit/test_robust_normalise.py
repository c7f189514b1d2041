"""The windowed median/MAD reward normaliser (services/cpm/robust_normalise.py): its
statistics, its invariances, its bounds, its fallbacks and its settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import CpmSettings, Matchmaker, RewardNormaliser, RobustRewardNormaliser
from peerlm.services.cpm.robust_normalise import MIN_REWARD_WINDOW, robust_scale
from pydantic import ValidationError

REWARDS = st.lists(
    st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False), min_size=1, max_size=80
)


def test_median_and_mad_of_a_known_sample() -> None:
    """[1, 2, 3, 4, 100]: median 3, |x - 3| = [2, 1, 0, 1, 97], MAD 1, scale 1.4826; the
    outlier 100 changes neither (the mean and s.d. would be 22 and 39)."""
    n = RobustRewardNormaliser(16, clip_sigmas=None)
    zs = [n.update(r) for r in (1.0, 2.0, 3.0, 4.0, 100.0)]
    assert n.centre == 3.0 and n.scale == pytest.approx(1.4826)
    assert zs[-1] == pytest.approx(math.sqrt(4))  # (100 - 3) / 1.4826 = 65, bounded by sqrt(n-1)
    assert n.normalise(4.0) == pytest.approx(1 / 1.4826, rel=1e-5)
    assert n.normalise(1.0) == pytest.approx(-2 / 1.4826, rel=1e-5)
    assert n.normalise(-50.0) == -2.0  # bounded by sqrt(n - 1) too
    assert n.statistics() == (3.0, pytest.approx(1.4826))


def test_the_matchmaker_reports_its_normalisers_centre_and_spread() -> None:
    """What GetStats reports as reward_mean/reward_std: the statistics rewards are z-scored
    by, under either normaliser (the robust snapshot holds no moments)."""
    rewards = [0.1, -0.2, 0.4, 0.0, 9.0]
    for kind in ("zscore", "robust"):
        m = Matchmaker(seed=0, reward_normaliser=kind)  # type: ignore[arg-type]
        assert m.reward_statistics == (0.0, 0.0)
        profiles = {"a": np.full(32, 0.1), "b": np.full(32, 0.2)}
        for r in rewards:
            m.observe(m.select(profiles)[0], r)
        centre, spread = m.reward_statistics
        if kind == "zscore":
            assert centre == pytest.approx(np.mean(rewards))
            assert spread == pytest.approx(np.std(rewards))
        else:  # median 0.1, |r - 0.1| = [0, .3, .3, .1, 8.9]: MAD 0.3
            assert centre == pytest.approx(0.1) and spread == pytest.approx(1.4826 * 0.3)


def test_first_rewards_zero_then_bounded_like_the_running_z_score() -> None:
    n = RobustRewardNormaliser(clip_sigmas=3.0)
    assert n.update(5.0) == 0.0
    assert n.update(7.0) == pytest.approx(0.6745, abs=1e-3)  # (7 - 6) / (1.4826 * 1)
    assert abs(n.update(1e6)) <= math.sqrt(2)


@settings(max_examples=100, deadline=None)
@given(REWARDS)
def test_z_scores_match_numpy_and_are_bounded(rewards: list[float]) -> None:
    window = MIN_REWARD_WINDOW
    n = RobustRewardNormaliser(window, clip_sigmas=3.0)
    for k, r in enumerate(rewards, start=1):
        z = n.update(r)
        kept = np.array(rewards[max(0, k - window) : k])  # the new reward folded in first
        centre = float(np.median(kept))
        mad = float(np.median(np.abs(kept - centre)))
        bound = min(3.0, math.sqrt(len(kept) - 1))
        assert abs(z) <= bound
        if mad > 0:
            expected = (r - centre) / (1.4826 * mad + 1e-6)
            assert z == pytest.approx(max(-bound, min(bound, expected)), rel=1e-9, abs=1e-12)
    assert n.count == len(rewards) and len(n.rewards) == min(len(rewards), window)


@settings(max_examples=100, deadline=None)
@given(
    REWARDS.filter(lambda rs: len(rs) >= 3),
    st.floats(0.01, 100.0),
    st.floats(-1e3, 1e3, allow_nan=False),
)
def test_z_scores_are_translation_and_scale_equivariant(
    rewards: list[float], scale: float, shift: float
) -> None:
    """z(a * r + b) = z(r) for a > 0 and -z(r) for a < 0, up to the eps in the denominator
    (negligible once the spread is well above it, which the assume makes sure)."""
    base = RobustRewardNormaliser(MIN_REWARD_WINDOW, clip_sigmas=3.0)
    moved = RobustRewardNormaliser(MIN_REWARD_WINDOW, clip_sigmas=3.0)
    flipped = RobustRewardNormaliser(MIN_REWARD_WINDOW, clip_sigmas=3.0)
    for r in rewards:
        z = base.update(r)
        spread = base.scale
        z_moved = moved.update(scale * r + shift)
        z_flipped = flipped.update(-scale * r + shift)
        if spread == 0.0:
            assert z == z_moved == z_flipped == 0.0
            continue
        assume(spread * min(scale, 1.0) > 1e-2)
        tol = 1e-3 + 1e-9 * (abs(shift) + scale * 1e3) / (spread * scale)
        assert z_moved == pytest.approx(z, abs=tol)
        assert z_flipped == pytest.approx(-z, abs=tol)


def test_ties_fall_back_to_the_iqr_then_the_mean_deviation_then_zero() -> None:
    # MAD 0 (most of the window is 0.0, like refused exchanges), IQR > 0.
    values = np.array([0.0] * 5 + [1.0, 2.0, 3.0])
    q25, q75 = np.percentile(values, [25, 75])
    assert robust_scale(values, 0.0) == pytest.approx((q75 - q25) / 1.349)
    # MAD and IQR 0: the mean absolute deviation from the median, Gaussian-consistent.
    values = np.array([0.0] * 15 + [2.0])
    assert robust_scale(values, 0.0) == pytest.approx(2.0 / 16 * math.sqrt(math.pi / 2))
    # Everything equal: no spread, and every z-score is 0 (never r / eps).
    n = RobustRewardNormaliser(clip_sigmas=3.0)
    assert [n.update(0.25) for _ in range(40)] == [0.0] * 40
    # A spread at rounding level: bounded by clip_sigmas, not (r - m) / 1e-16.
    n = RobustRewardNormaliser(clip_sigmas=3.0)
    for _ in range(40):
        n.update(1.0)
    assert abs(n.update(1.0 + 1e-15)) <= 3.0
    assert abs(n.update(1.0 + 1e-9)) <= 3.0
    assert abs(n.update(1e6)) == 3.0


def test_the_window_keeps_the_last_rewards_and_bad_input_changes_nothing() -> None:
    n = RobustRewardNormaliser(16)
    for r in range(40):
        n.update(float(r))
    assert n.rewards == tuple(float(r) for r in range(24, 40)) and n.count == 40
    before = n.state()
    for bad in (math.nan, math.inf, 1e13):
        with pytest.raises(ValueError):
            n.update(bad)
    assert n.state() == before
    copy = n.copy()
    n.update(1.0)
    assert copy.state() == before  # independent


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": MIN_REWARD_WINDOW - 1}, "window"),
        ({"window": 10**6}, "window"),
        ({"window": 16, "rewards": [1.0] * 17}, "do not fit"),
        ({"window": 16, "rewards": [1.0] * 3, "count": 5}, "holds 5"),
        ({"window": 16, "rewards": [1.0] * 3, "count": -1}, "holds 0"),
        ({"window": 16, "rewards": [math.nan]}, "finite"),
        ({"clip_sigmas": 0.0}, "clip_sigmas"),
    ],
)
def test_inconsistent_construction_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RobustRewardNormaliser(**kwargs)  # type: ignore[arg-type]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match="reward_window"):
        CpmSettings(reward_normaliser="robust", reward_window=MIN_REWARD_WINDOW - 1)
    with pytest.raises(ValidationError, match="reward_normaliser"):
        CpmSettings(reward_normaliser="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reward_normaliser"):
        Matchmaker(reward_normaliser="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        Matchmaker(reward_normaliser="robust", reward_window=4)
    # The service defaults to the robust normaliser (docs/matchmaker.md, "Reward normalisation").
    assert CpmSettings().reward_normaliser == "robust"


def test_honest_rewards_z_score_close_to_the_running_z_score() -> None:
    """Without a hostile report the robust z-scores carry the same information as the
    paper's: after 30 rewards their correlation is above 0.9 on every seed."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        rewards = rng.normal(0.05, 0.2, 300)
        robust = RobustRewardNormaliser(clip_sigmas=3.0)
        zscore = RewardNormaliser(clip_sigmas=3.0)
        a = [robust.update(float(r)) for r in rewards]
        b = [zscore.update(float(r)) for r in rewards]
        assert np.corrcoef(a[30:], b[30:])[0, 1] > 0.9
        assert 0.8 < float(np.std(a[30:])) < 1.2
