"""Search: top-K merge, the threshold controller, and recall on planted clusters."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from peerlm.overlay.messages import Candidate
from peerlm.overlay.search import merge_top_k
from peerlm.overlay.threshold import ThresholdController, quantile_threshold

from tests.overlay_harness import federation

candidates = st.lists(
    st.builds(
        Candidate,
        node_id=st.sampled_from([f"p{i}" for i in range(12)]),
        address=st.just("a"),
        similarity=st.floats(-1, 1, allow_nan=False),
    ),
    max_size=30,
)


@given(lists=st.lists(candidates, max_size=5), k=st.integers(1, 15))
def test_merge_is_a_deduplicated_top_k(lists: list[list[Candidate]], k: int) -> None:
    merged = merge_top_k(lists, k)
    best: dict[str, float] = {}
    for lst in lists:
        for c in lst:
            best[c.node_id] = max(best.get(c.node_id, -2.0), c.similarity)
    expected = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    assert [(c.node_id, c.similarity) for c in merged] == expected
    # merging is associative: merging partial merges gives the same answer
    halves = [merge_top_k(lists[:2], k), merge_top_k(lists[2:], k)]
    assert merge_top_k(halves, k) == merged


def test_threshold_initialises_from_the_probe_then_follows_the_controller() -> None:
    c = ThresholdController(target_acceptance=0.25, step=0.1, drift_slack=0.5, window=100)
    assert c.current() is None
    samples = [i / 100 for i in range(100)]
    tau0 = c.update(tau_used=0.0, scored=100, accepted=90, drift=1.0, samples=samples)
    assert tau0 == quantile_threshold(samples, 0.25)
    # too many accepted: the threshold rises; drift lowers it
    up = c.update(tau_used=0.5, scored=100, accepted=80, drift=1.0, samples=[])
    assert up > 0.5
    down = c.update(tau_used=0.5, scored=100, accepted=25, drift=0.8, samples=[])
    assert down < 0.5
    assert -1.0 <= c.update(tau_used=-1.0, scored=10, accepted=0, drift=-1.0, samples=[]) <= 1.0


@pytest.mark.slow
def test_planted_clusters_are_found_with_few_comparisons() -> None:
    fed = federation(120, seed=3, zone_cap=10)
    fed.build()
    k = 12
    for _ in range(2):  # the first round also initialises tau
        results = fed.query_all(k)
    assert len(results) == 120
    assert fed.recall(results, k) >= 0.9
    scored = sum(ev.stats.scored for ev in results.values()) / len(results)
    assert scored < 120 / 2, "the search must not degenerate into scanning everyone"
    for nid, ev in results.items():
        assert len(ev.results) == k
        assert nid not in {c.node_id for c in ev.results}
        sims = [c.similarity for c in ev.results]
        assert sims == sorted(sims, reverse=True)
