"""What a teacher teaches (peerlm.agent.exchange.teaching): Wilson bounds, competence, the scope."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from peerlm.agent.exchange.teaching import (
    Competence,
    competence_of,
    teachable_indices,
    wilson_lower_bound,
)


def test_wilson_lower_bound_matches_the_textbook_values() -> None:
    # Hand-computed with z = 1.96: 0/n gives 0, n/n gives n / (n + z^2).
    assert wilson_lower_bound(0, 10) == 0.0
    assert wilson_lower_bound(10, 10) == pytest.approx(10 / (10 + 1.959963984540054**2))
    # 5 of 10: (0.5 + z^2/20 - z*sqrt(0.025 + z^2/400)) / (1 + z^2/10) = 0.2366
    assert wilson_lower_bound(5, 10) == pytest.approx(0.2366, abs=1e-4)
    assert wilson_lower_bound(0, 0) == 0.0


@pytest.mark.parametrize(("k", "n"), [(-1, 3), (4, 3), (0, -1)])
def test_wilson_lower_bound_refuses_impossible_counts(k: int, n: int) -> None:
    with pytest.raises(ValueError, match="passed"):
        wilson_lower_bound(k, n)


@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_lower_bound_is_below_the_rate_and_grows_with_evidence(kn: tuple[int, int]) -> None:
    k, n = kn
    low = wilson_lower_bound(k, n)
    assert 0.0 <= low <= k / n + 1e-12
    # Twice the evidence at the same rate never lowers the bound.
    assert wilson_lower_bound(2 * k, 2 * n) >= low - 1e-12


def test_competence_counts_greedy_passes_per_category() -> None:
    c = competence_of([("dict", 1, 1), ("dict", 0, 1), ("dict", 1, 1), ("list", 0, 1)])
    assert c.counts == {"dict": (2, 3), "list": (0, 1)}
    # Several samples: a problem counts as passed only when every sample passed.
    assert competence_of([("a", 1, 2), ("a", 2, 2)]).counts == {"a": (1, 2)}


def test_competence_keeps_categories_with_enough_evidence_only() -> None:
    c = Competence({"expert": (20, 33), "lucky": (1, 1), "weak": (1, 39), "none": (0, 0)})
    # 20/33 -> bound 0.44; 1/1 -> 0.21; 1/39 -> 0.005; no problems -> no evidence.
    assert c.categories(0.2) == frozenset({"expert", "lucky"})
    assert c.categories(0.3) == frozenset({"expert"})
    assert c.categories(0.0) == frozenset({"expert", "lucky", "weak"})


def test_competence_round_trips_and_refuses_bad_counts() -> None:
    c = Competence({"a": (1, 2), "b": (0, 5)})
    assert Competence.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="bad counts"):
        Competence.from_dict({"a": [3, 2]})
    with pytest.raises(ValueError):
        Competence.from_dict({"a": [1]})


def test_a_competent_teacher_answers_only_the_prompts_of_its_skills() -> None:
    categories = ["dict", "boolean", "string", "boolean", "format"]
    teacher = Competence({"boolean": (25, 35), "string": (0, 2), "dict": (0, 0)})
    assert teachable_indices(categories, teacher, scope="competent", min_pass=0.2) == [1, 3]
    # The paper's rule, and a teacher with no measurement yet, answer everything.
    assert teachable_indices(categories, teacher, scope="all", min_pass=0.2) == list(range(5))
    assert teachable_indices(categories, None, scope="competent", min_pass=0.2) == list(range(5))
    # A teacher with no evidence of any skill has nothing to teach.
    nothing = Competence({"boolean": (0, 35)})
    assert teachable_indices(categories, nothing, scope="competent", min_pass=0.2) == []


def test_z_default_is_the_two_sided_95_percent_quantile() -> None:
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.975)
    assert wilson_lower_bound(3, 7) == pytest.approx(wilson_lower_bound(3, 7, z))
    assert math.isclose(wilson_lower_bound(3, 7, 0.0), 3 / 7)
