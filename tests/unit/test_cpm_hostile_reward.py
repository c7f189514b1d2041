"""A student reporting an extreme (accepted) reward: what it does to everyone else's
rewards through the CPM's running normaliser (services/cpm/normalise.py). Audit finding,
fixed by winsorising (``reward_clip_sigmas``, default 3): the paper's plain z-score
(``None``) still shows the defect."""

from __future__ import annotations

import numpy as np
import pytest
from peerlm.services.cpm import CpmSettings, Matchmaker
from peerlm.services.cpm.normalise import RewardNormaliser


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
