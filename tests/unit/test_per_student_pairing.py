"""``pairing="per_student"``: every agent the student of one teacher a round (ours, beyond
Algorithm 2's disjoint pairs), in the LinUCB matchmaker, Random-P2P, the Oracle and the
experiment's plan."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import CpmSettings, Matchmaker, Pairing, RandomMatchmaker
from peerlm.services.cpm.matching import greedy_students


def profiles_of(rng: np.random.Generator, n: int, dim: int = 32) -> dict[str, np.ndarray]:
    return {f"agent-{k:03d}": rng.random(dim) for k in range(n)}


def assert_per_student(pairings: list[Pairing], agents: set[str], capacity: int | None) -> None:
    students = [p.receiver for p in pairings]
    assert len(students) == len(set(students)), "a student with two teachers"
    assert all(p.sender != p.receiver for p in pairings)
    assert {a for p in pairings for a in (p.sender, p.receiver)} <= agents
    if capacity is not None:
        assert max(Counter(p.sender for p in pairings).values(), default=0) <= capacity


def test_the_walk_keeps_a_student_once_and_a_teacher_within_its_capacity() -> None:
    senders = np.array([0, 0, 0, 1, 2, 2, 3], dtype=np.intp)
    receivers = np.array([1, 2, 3, 1, 0, 2, 3], dtype=np.intp)
    served, load = np.zeros(4, dtype=np.intp), np.zeros(4, dtype=np.intp)
    # 0 teaches 1 and 2 (capacity 2), not 3; 1 -> 1 is student 1 again; 2 -> 0 kept;
    # 2 -> 2 and 3 -> 3 are self-pairs.
    assert greedy_students(senders, receivers, 10, served, load, 2) == [0, 1, 4]
    assert served.tolist() == [1, 1, 1, 0]
    assert load.tolist() == [2, 0, 1, 0]
    # The state carries over: a refill walk continues from it, and the budget bounds it.
    assert greedy_students(np.array([0, 1]), np.array([3, 3]), 1, served, load, 2) == [1]
    assert greedy_students(senders, receivers, 0, served, load, 2) == []


def test_the_walk_gives_a_student_several_distinct_teachers() -> None:
    # Walk order: 0 -> 1 twice (under two protocols), then 2 -> 1, 3 -> 1, 0 -> 2.
    senders = np.array([0, 0, 2, 3, 0], dtype=np.intp)
    receivers = np.array([1, 1, 1, 1, 2], dtype=np.intp)
    served, load = np.zeros(4, dtype=np.intp), np.zeros(4, dtype=np.intp)
    taken: set[tuple[int, int]] = set()
    # Student 1 takes its best two distinct teachers (0 once, then 2), not a third.
    assert greedy_students(senders, receivers, 10, served, load, 4, 2, taken) == [0, 2, 4]
    assert served.tolist() == [0, 2, 1, 0] and taken == {(0, 1), (2, 1), (0, 2)}
    # A refill walk keeps the pairs kept before: 0 -> 2 again is refused, 3 -> 2 is not.
    again = greedy_students(np.array([0, 3]), np.array([2, 2]), 10, served, load, 4, 2, taken)
    assert again == [1] and served.tolist() == [0, 2, 2, 0]
    assert greedy_students(senders, receivers, 10, served, load, 4, 0, taken) == []


def assert_teachers(pairings: list[Pairing], k: int) -> None:
    """Every student has at most ``k`` teachers, all distinct, none itself."""
    by_student = Counter(p.receiver for p in pairings)
    assert max(by_student.values(), default=0) <= k
    pairs = [(p.sender, p.receiver) for p in pairings]
    assert len(pairs) == len(set(pairs)) and all(s != r for s, r in pairs)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 12),
    k=st.integers(1, 4),
    capacity=st.one_of(st.none(), st.integers(2, 6)),
    seed=st.integers(0, 2**16),
)
def test_every_agent_has_its_teachers(n: int, k: int, capacity: int | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = Matchmaker(
        8, seed=seed, pairing="per_student", teacher_capacity=capacity, teachers_per_student=k
    )
    for p in m.select(profiles_of(rng, 6, dim=8)):
        m.observe(p, float(rng.normal()))
    pairings = m.select(profiles_of(rng, n, dim=8))
    assert_teachers(pairings, k)
    if capacity is not None:
        assert max(Counter(p.sender for p in pairings).values(), default=0) <= capacity
    if capacity is None and n >= 2:
        # Nothing but the other agents bounds a student's teachers.
        assert Counter(p.receiver for p in pairings) == {
            a: min(k, n - 1) for a in profiles_of(rng, n, dim=8)
        }


def test_a_student_of_two_teachers_gets_its_two_best() -> None:
    rng = np.random.default_rng(6)
    m = Matchmaker(32, seed=6, pairing="per_student", teachers_per_student=2)
    for _ in range(6):
        for p in m.select(profiles_of(rng, 6)):
            m.observe(p, float(np.sum(rng.random(3))))
    profiles = profiles_of(rng, 6)
    pairings = m.select(profiles)
    assert len(pairings) == 12
    for student in profiles:
        mine = sorted((p.ucb for p in pairings if p.receiver == student), reverse=True)
        rivals = sorted(
            (ucb_of(m, profiles, s, student) for s in profiles if s != student), reverse=True
        )
        assert mine == pytest.approx(rivals[:2], abs=1e-5)
    one = Matchmaker(32, seed=6, pairing="per_student", teachers_per_student=1)
    assert len(one.select(profiles)) == 6


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 12),
    capacity=st.one_of(st.none(), st.integers(1, 4)),
    budget=st.one_of(st.none(), st.integers(0, 14)),
    seed=st.integers(0, 2**16),
)
def test_every_agent_is_a_student_once(
    n: int, capacity: int | None, budget: int | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m = Matchmaker(
        8, pair_budget=budget, seed=seed, pairing="per_student", teacher_capacity=capacity
    )
    for p in m.select(profiles_of(rng, 6, dim=8)):
        m.observe(p, float(rng.normal()))
    profiles = profiles_of(rng, n, dim=8)
    pairings = m.select(profiles)
    assert_per_student(pairings, set(profiles), capacity)
    limit = n if budget is None else min(budget, n)
    if n < 2:
        assert pairings == []
    elif capacity == 1:
        # The last student may find only itself with room.
        assert limit - 1 <= len(pairings) <= limit
    else:
        assert len(pairings) == limit


def ucb_of(m: Matchmaker, profiles: dict[str, np.ndarray], sender: str, receiver: str) -> float:
    """The UCB of ``sender -> receiver`` alone: a round of the two under per_student pairs
    both directions, and a pair's context depends on its two agents only."""
    two = m.select({sender: profiles[sender], receiver: profiles[receiver]})
    return next(p.ucb for p in two if p.sender == sender)


def test_each_student_gets_its_best_teacher_when_teachers_have_room() -> None:
    rng = np.random.default_rng(4)
    m = Matchmaker(32, seed=4, pairing="per_student")
    for _ in range(6):
        for p in m.select(profiles_of(rng, 8)):
            m.observe(p, float(np.sum(rng.random(3))))
    profiles = profiles_of(rng, 8)
    pairings = m.select(profiles)
    assert {p.receiver for p in pairings} == set(profiles)
    for p in pairings:
        rivals = [ucb_of(m, profiles, s, p.receiver) for s in profiles if s != p.receiver]
        assert p.ucb >= max(rivals) - 1e-5


def test_refill_passes_serve_every_student_of_a_prefiltered_round() -> None:
    profiles = profiles_of(np.random.default_rng(2), 90)
    pairings = Matchmaker(32, seed=2, pairing="per_student", teacher_capacity=2).select(profiles)
    assert_per_student(pairings, set(profiles), 2)
    assert len(pairings) == 90


def test_disjoint_pairing_is_unchanged_by_the_setting() -> None:
    profiles = profiles_of(np.random.default_rng(1), 9)
    plain = Matchmaker(32, seed=1).select(profiles)
    named = Matchmaker(32, seed=1, pairing="disjoint", teacher_capacity=3).select(profiles)
    assert [(p.sender, p.receiver, p.ucb) for p in plain] == [
        (p.sender, p.receiver, p.ucb) for p in named
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pairing": "everyone"},
        {"pairing": "per_student", "matching": "blossom"},
        {"pairing": "per_student", "teacher_capacity": 0},
        {"pairing": "per_student", "teachers_per_student": 0},
        {"pairing": "per_student", "teachers_per_student": 17},
        {"pairing": "per_student", "teachers_per_student": True},
        {"pairing": "disjoint", "teachers_per_student": 2},
    ],
)
def test_the_matchmaker_refuses_what_it_cannot_walk(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Matchmaker(32, **kwargs)  # type: ignore[arg-type]


def test_the_service_settings_carry_the_pairing_and_refuse_blossom() -> None:
    from peerlm.config import explicit_settings

    s = explicit_settings(CpmSettings, {"pairing": "per_student", "teacher_capacity": 2})
    profiles = profiles_of(np.random.default_rng(0), 6)
    assert_per_student(s.new_matchmaker().select(profiles), set(profiles), 2)
    with pytest.raises(ValueError, match="greedy"):
        explicit_settings(CpmSettings, {"pairing": "per_student", "matching": "blossom"})
    with pytest.raises(ValueError):
        explicit_settings(CpmSettings, {"pairing": "per_student", "teacher_capacity": 0})
    two = explicit_settings(CpmSettings, {"pairing": "per_student", "teachers_per_student": 2})
    assert_teachers(two.new_matchmaker().select(profiles), 2)
    assert len(two.new_matchmaker().select(profiles)) == 12
    with pytest.raises(ValueError, match="per_student"):
        explicit_settings(CpmSettings, {"teachers_per_student": 2})
    with pytest.raises(ValueError):
        explicit_settings(CpmSettings, {"pairing": "per_student", "teachers_per_student": 17})


@pytest.mark.parametrize("capacity", [None, 1, 2])
def test_random_p2p_per_student_draws_a_teacher_for_everyone(capacity: int | None) -> None:
    profiles = profiles_of(np.random.default_rng(3), 7)
    seen: set[tuple[str, str]] = set()
    for seed in range(10):
        r = RandomMatchmaker(seed=seed, pairing="per_student", teacher_capacity=capacity)
        pairings = r.select(profiles)
        assert_per_student(pairings, set(profiles), capacity)
        assert len(pairings) >= 6
        again = RandomMatchmaker(seed=seed, pairing="per_student", teacher_capacity=capacity)
        assert [(p.sender, p.receiver) for p in again.select(profiles)] == [
            (p.sender, p.receiver) for p in pairings
        ]
        seen |= {(p.sender, p.receiver) for p in pairings}
    assert len(seen) > 20  # random teachers, not a fixed assignment
    assert len(RandomMatchmaker(pair_budget=3, pairing="per_student").select(profiles)) == 3
    with pytest.raises(ValueError):
        RandomMatchmaker(pairing="per_student", teacher_capacity=0)


def test_random_p2p_draws_several_distinct_teachers_a_student() -> None:
    profiles = profiles_of(np.random.default_rng(3), 5)
    for seed in range(5):
        one = RandomMatchmaker(seed=seed, pairing="per_student").select(profiles)
        pairings = RandomMatchmaker(
            seed=seed, pairing="per_student", teachers_per_student=3
        ).select(profiles)
        assert_teachers(pairings, 3)
        assert Counter(p.receiver for p in pairings) == dict.fromkeys(profiles, 3)
        # A student's first draw is the one a single-teacher round draws.
        assert pairings[0] == one[0]
    capped = RandomMatchmaker(
        seed=0, pairing="per_student", teacher_capacity=2, teachers_per_student=2
    ).select(profiles)
    assert_teachers(capped, 2)
    assert max(Counter(p.sender for p in capped).values()) <= 2
    assert (
        len(
            RandomMatchmaker(pair_budget=7, pairing="per_student", teachers_per_student=2).select(
                profiles
            )
        )
        == 7
    )
    for bad in (
        {"teachers_per_student": 0},
        {"teachers_per_student": 17},
        {"teachers_per_student": 2.7},
        {"pairing": "disjoint", "teachers_per_student": 2},
    ):
        with pytest.raises(ValueError):
            RandomMatchmaker(**bad)  # type: ignore[arg-type]


def test_the_oracle_keeps_each_students_best_teacher() -> None:
    from peerlm.app.experiment_distill import _oracle_keeps
    from peerlm.app.experiment_plan import ExperimentPlan

    gains = {(0, 1): 0.9, (0, 2): 0.8, (1, 2): 0.7, (2, 0): 0.5, (1, 0): 0.6, (2, 1): 0.1}
    trials = {k: (g, None, None, 1.0) for k, g in gains.items()}
    per_student = ExperimentPlan(pairing="per_student", teachers_per_student=1)
    kept = [k for k, _ in _oracle_keeps(per_student, 3, trials)]
    assert kept == [(0, 1), (0, 2), (1, 0)]
    capped = ExperimentPlan(pairing="per_student", teacher_capacity=1, teachers_per_student=1)
    assert [k for k, _ in _oracle_keeps(capped, 3, trials)] == [(0, 1), (1, 2), (2, 0)]
    disjoint = ExperimentPlan(pairing="disjoint")
    assert [k for k, _ in _oracle_keeps(disjoint, 3, trials)] == [(0, 1)]
    two = ExperimentPlan(agents=3, pairing="per_student", teachers_per_student=2)
    assert [k for k, _ in _oracle_keeps(two, 3, trials)] == [
        (0, 1),
        (0, 2),
        (1, 2),
        (1, 0),
        (2, 0),
        (2, 1),
    ]


def test_the_plan_pairs_per_student_by_default_and_refuses_bad_values() -> None:
    from peerlm.services.cpm import HeteroGreedyMatchmaker

    from peerlm.app.experiment_exchange import pairing_policy
    from peerlm.app.experiment_plan import DEFAULT_TEACHERS_PER_STUDENT, ExperimentPlan

    with pytest.raises(ValueError, match="pairing"):
        ExperimentPlan(pairing="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="teacher_capacity"):
        ExperimentPlan(pairing="per_student", teacher_capacity=0)
    for bad in (0, 17, True, 1.5):
        with pytest.raises(ValueError, match="teachers_per_student"):
            ExperimentPlan(agents=6, teachers_per_student=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_student"):
        ExperimentPlan(pairing="disjoint", teachers_per_student=2)
    two = ExperimentPlan(teachers_per_student=2)
    assert two.cpm_settings(1).teachers_per_student == 2
    assert two.exchange_own_steps == 2 * two.integration_steps
    # Unsaid, the pairing's default, resolved: a stored plan names the number it ran.
    assert ExperimentPlan().teachers_per_student == DEFAULT_TEACHERS_PER_STUDENT
    assert ExperimentPlan(pairing="disjoint").teachers_per_student == 1
    # A student has at most one lesson from every other client, and so LocalOnly+.
    pair = ExperimentPlan(agents=2, teachers_per_student=3)
    assert pair.lessons_per_student == 1 and pair.exchange_own_steps == pair.integration_steps
    assert ExperimentPlan().pairing == "per_student"
    plan = ExperimentPlan(teacher_capacity=2, teachers_per_student=1)
    assert (plan.cpm_settings(1).pairing, plan.cpm_settings(1).teacher_capacity) == (
        "per_student",
        2,
    )
    assert ExperimentPlan(pairing="disjoint").cpm_settings(1).pairing == "disjoint"
    # Random-P2P follows the plan; Heuristic-P2P stays Algorithm 4's disjoint pairs.
    profiles = profiles_of(np.random.default_rng(5), 6)
    random = pairing_policy("random", plan, 0).select(profiles)
    assert_per_student(random, set(profiles), 2)
    assert len(random) == 6
    assert isinstance(pairing_policy("heuristic", plan, 0), HeteroGreedyMatchmaker)
