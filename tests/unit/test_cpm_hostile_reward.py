"""A student reporting an extreme (accepted) reward: what it does to everyone else's
rewards through the CPM's running normaliser (services/cpm/normalise.py). Audit finding,
fixed by winsorising (``reward_clip_sigmas``, default 3): the paper's plain z-score
(``None``) still shows the defect. The two attacks winsorising leaves open, and the robust
normaliser (services/cpm/robust_normalise.py) that closes them, at the end."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from peerlm.services.cpm import CpmSettings, Matchmaker
from peerlm.services.cpm.normalise import RewardNormaliser
from peerlm.services.cpm.robust_normalise import RobustRewardNormaliser


def _later_spread(clip_sigmas: float | None) -> float:
    rng = np.random.default_rng(0)
    normaliser = RewardNormaliser(clip_sigmas=clip_sigmas)
    for reward in rng.normal(0.0, 0.2, 200):  # honest Eq. 3 rewards
        normaliser.update(float(reward))
    # One student's report, inside every check the CPM makes (finite, |r| <= 1e6).
    normaliser.update(CpmSettings().max_reward_magnitude)
    later = [normaliser.update(float(r)) for r in rng.normal(0.0, 0.2, 50)]
    return float(np.std(later))


def test_one_reward_at_the_magnitude_bound_does_not_flatten_everyone_elses() -> None:
    """Honest rewards must still z-score apart: without the report the later z-scores have
    a standard deviation of about 1.2; under the plain z-score, after it, 0.002."""
    assert CpmSettings().reward_clip_sigmas == 3.0
    assert _later_spread(3.0) > 1.0
    assert _later_spread(None) < 0.01


def test_winsorising_waits_for_a_spread_and_keeps_order() -> None:
    n = RewardNormaliser(clip_sigmas=3.0, clip_after=10)
    for r in (1e5, -1e5):  # the first rewards cannot be judged: folded in as they are
        assert n.clip(r) == r
        n.update(r)
    n = RewardNormaliser(clip_sigmas=3.0)
    for r in np.linspace(-1, 1, 10):
        n.update(float(r))
    bound = n.mean + 3 * n.std
    assert n.clip(1e6) == pytest.approx(bound) and n.clip(-1e6) == pytest.approx(n.mean - 3 * n.std)
    assert n.clip(0.3) == 0.3  # inside the bound: unchanged
    before = n.state()
    with pytest.raises(ValueError):
        n.update(float("nan"))
    assert n.state() == before
    with pytest.raises(ValueError, match="clip_sigmas"):
        RewardNormaliser(clip_sigmas=0.0)
    with pytest.raises(ValueError, match="clip_sigmas"):
        Matchmaker(reward_clip_sigmas=float("inf"))


def test_a_restored_matchmaker_keeps_winsorising() -> None:
    """Snapshot and restore carry (count, mean, m2); the bound comes from the settings, so
    a restored CPM clips the next extreme report exactly as the original would."""
    a = Matchmaker(seed=0)
    profiles = {f"a{i}": np.full(32, 0.1 * i) for i in range(4)}
    rng = np.random.default_rng(1)
    for _ in range(6):
        for p in a.select(profiles):
            a.observe(p, float(rng.normal(0, 0.2)))
    b = Matchmaker(seed=0)
    b.restore(a.snapshot())
    pairing = a.select(profiles)[0]
    assert a.observe(pairing, 1e6) == b.observe(pairing, 1e6) < 4.0


# -- the two attacks winsorising leaves open, against the robust normaliser ----------------
#
# Under "robust" (median and 1.4826 * MAD over the last 256 rewards) both attacks below
# leave the honest z-scores spread out and ordered as the honest rewards are; under the
# default "zscore" the same reports flatten them. Each test asserts both, so it proves the
# difference and would fail if either normaliser changed what it does.
#
# The thresholds: with no attack the honest z-scores have a standard deviation of about 1
# under either normaliser; flattened, 0.0007-0.02 (what is left is the z-score's slow drift
# as the count grows, and rounding). "Not flattened" is asserted as > 0.5 (25 times the
# largest flattened value, and what a normaliser whose scale is inflated twofold still
# gives) and "flattened" as < 0.05. A spread could also be kept by noise, so the robust
# z-scores must also rank the honest rewards (correlation > 0.95 with them, 0.996-0.999
# measured); the flattened ones carry nothing of them (|correlation| < 0.5, <= 0.11
# measured).


def _normaliser(kind: str) -> RewardNormaliser | RobustRewardNormaliser:
    return RewardNormaliser(clip_sigmas=3.0) if kind == "zscore" else RobustRewardNormaliser()


def _honest_after(
    kind: str, hostile: Callable[[int], bool], seed: int, total: int = 600, start: int = 400
) -> tuple[float, float]:
    """``total`` rewards, those where ``hostile(i)`` at the magnitude bound, the rest honest
    (s.d. 0.2); the spread of the honest z-scores from the ``start``-th reward on and their
    correlation with the raw honest rewards."""
    bound = CpmSettings().max_reward_magnitude
    rng = np.random.default_rng(seed)
    normaliser = _normaliser(kind)
    zs, raw = [], []
    for i in range(total):
        if hostile(i):
            normaliser.update(bound)
            continue
        reward = float(rng.normal(0.0, 0.2))
        z = normaliser.update(reward)
        if i >= start:
            zs.append(z)
            raw.append(reward)
    return float(np.std(zs)), float(np.corrcoef(zs, raw)[0, 1])


@pytest.mark.parametrize("position", [0, 3, 9])
def test_a_report_among_the_first_ten_flattens_the_z_score_but_not_the_robust_one(
    position: int,
) -> None:
    """Attack (a): one report at the bound among the first ten rewards (not yet winsorised).
    Measured on rewards 50-249, while the report is still in the robust normaliser's window
    of 256: it is the median and MAD that resist it, not the window forgetting it."""
    assert RobustRewardNormaliser().window == 256
    for seed in range(3):
        spread, corr = _honest_after("zscore", lambda i: i == position, seed, 250, 50)
        assert spread < 0.05 and abs(corr) < 0.5  # the defect the robust normaliser closes
        spread, corr = _honest_after("robust", lambda i: i == position, seed, 250, 50)
        assert spread > 0.5 and corr > 0.95


@pytest.mark.parametrize("share", [0.11, 0.25, 0.33])
def test_a_member_filing_a_share_of_the_rewards_cannot_flatten_the_robust_z_score(
    share: float,
) -> None:
    """Attack (b): a member filing ``share`` of the rewards, every one at the bound from the
    first round on, each clipped at the running bound's edge and pushing it up."""

    def hostile(i: int) -> bool:  # evenly spread: the i-th reward is the member's ~share
        return int((i + 1) * share) > int(i * share)

    for seed in range(3):
        spread, corr = _honest_after("zscore", hostile, seed)
        assert spread < 0.05 and abs(corr) < 0.5
        spread, corr = _honest_after("robust", hostile, seed)
        # At 1/3 of the window the scale is inflated ~2.2x (spread ~0.45): still ordered.
        assert spread > (0.5 if share <= 0.25 else 0.3) and corr > 0.95


def test_the_robust_normaliser_breaks_down_at_half_the_window() -> None:
    """What stays open (docs/security.md): a member filing every other reward holds half the
    window, and the median itself is then theirs to move."""
    spread, _ = _honest_after("robust", lambda i: i % 2 == 0, 0)
    # 3e-7: still ordered (the scale is the member's), but nothing the bandit can learn from.
    assert spread < 0.01
