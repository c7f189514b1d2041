"""The paired bootstrap of ``run-experiment`` and the per-client slices."""

from __future__ import annotations

import numpy as np
import pytest
from peerlm.agent.tasks.world import World

from peerlm.app.experiment_slices import slices_of_world
from peerlm.app.experiment_stats import paired_bootstrap


def test_paired_interval_is_narrower_than_the_spread_of_either_strategy() -> None:
    rng = np.random.default_rng(0)
    # Problems differ a lot; strategy b is a + 0.05 on every problem, plus a little noise.
    a = rng.uniform(0, 1, size=(3, 200))
    b = a + 0.05 + rng.normal(0, 0.01, size=a.shape)
    means, diffs = paired_bootstrap({"a": a, "b": b}, [("b", "a")], replicates=500)
    d = diffs[("b", "a")]
    assert d.low > 0.04 and d.high < 0.06  # paired: the problem variance cancels
    assert means["a"].high - means["a"].low > 10 * (d.high - d.low)
    assert means["a"].low <= means["a"].mean <= means["a"].high


def test_no_difference_gives_an_interval_around_zero() -> None:
    rng = np.random.default_rng(1)
    a = rng.uniform(0, 1, size=(3, 100))
    b = a + rng.normal(0, 0.1, size=a.shape)
    _, diffs = paired_bootstrap({"a": a, "b": b}, [("a", "b")], replicates=500)
    assert diffs[("a", "b")].low < 0 < diffs[("a", "b")].high


def test_bootstrap_is_reproducible() -> None:
    a = np.arange(12, dtype=float).reshape(3, 4)
    first = paired_bootstrap({"a": a, "b": a[::-1]}, [("a", "b")], replicates=100)
    assert first == paired_bootstrap({"a": a, "b": a[::-1]}, [("a", "b")], replicates=100)


@pytest.mark.parametrize(
    "values",
    [
        {"a": np.zeros((2, 3)), "b": np.zeros((2, 4))},
        {"a": np.zeros((0, 3))},
        {"a": np.array([[np.nan]])},
        {},
    ],
)
def test_bootstrap_refuses_bad_matrices(values: dict[str, np.ndarray]) -> None:
    with pytest.raises(ValueError):
        paired_bootstrap(values, [])


def test_bootstrap_refuses_unknown_pairs() -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        paired_bootstrap({"a": np.zeros((1, 1))}, [("a", "z")])


def test_slices_follow_the_world() -> None:
    world = World(
        public_categories=("list",),
        private_categories=("dict", "loop"),
        skills=(("dict",), ()),
    )
    s = slices_of_world(world, 0)
    assert s.own == {"dict"} and s.lacked == {"loop"} and s.public == {"list"}
    assert s.of("dict") == "own" and s.of("list") == "public" and s.of("zzz") is None
    assert slices_of_world(world, 1).lacked == {"dict", "loop"}
    with pytest.raises(ValueError, match="not in a world"):
        slices_of_world(world, 2)


def test_share_of_a_gain_is_the_ratio_of_the_differences_with_an_interval_around_it() -> None:
    from peerlm.app.experiment_stats import paired_share

    rng = np.random.default_rng(2)
    base = rng.uniform(1.0, 3.0, size=(3, 150))
    top = base - 0.8 + rng.normal(0, 0.05, size=base.shape)  # NLL: lower is better
    mid = base - 0.6 + rng.normal(0, 0.05, size=base.shape)
    share = paired_share({"mid": mid, "base": base, "top": top}, "mid", "base", "top")
    assert share is not None
    expected = (mid.mean() - base.mean()) / (top.mean() - base.mean())
    assert share.mean == pytest.approx(expected)
    assert 0.7 < share.low <= share.mean <= share.high < 0.8
    # The same ratio for a metric where higher is better.
    up = paired_share({"mid": -mid, "base": -base, "top": -top}, "mid", "base", "top")
    assert up is not None and up.mean == pytest.approx(expected)


def test_share_of_no_gain_is_undefined_and_unknown_names_are_refused() -> None:
    from peerlm.app.experiment_stats import paired_share

    a = np.ones((2, 10))
    assert paired_share({"a": a, "b": a, "c": a}, "a", "b", "c") is None
    with pytest.raises(ValueError, match="unknown strategy"):
        paired_share({"a": a, "b": a}, "a", "b", "top")
