"""pass@k: the unbiased estimator and sandboxed evaluation of completions."""

from __future__ import annotations

import json
from fractions import Fraction
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st
from peerlm.agent.eval.evaluation import evaluate, pass_at_k
from peerlm.agent.tasks.bank import generate_bank


def _exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_pass_at_k_known_values() -> None:
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 5, 5) == pytest.approx(1 - 1 / 252)  # C(10,5) = 252
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every draw of 3 holds a correct one
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)


def test_pass_at_k_beyond_n() -> None:
    assert pass_at_k(3, 1, 5) == 1.0
    assert pass_at_k(3, 0, 5) == 0.0


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0)])
def test_pass_at_k_rejects_invalid_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@st.composite
def _nck(draw: st.DrawFn) -> tuple[int, int, int]:
    n = draw(st.integers(1, 300))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(_nck())
def test_pass_at_k_matches_the_combinatorial_formula(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), rel=1e-9, abs=1e-12)


@given(_nck())
def test_pass_at_k_is_monotone(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12


def test_evaluate_counts_statuses_and_pass_at_k() -> None:
    bank = generate_bank(2, seed=3)
    string_a, string_b, arith = bank[0], bank[1], bank[2]
    completions = {
        # 2 of 3 correct
        string_a.task_id: [string_a.reference, "return None\n", string_a.reference],
        # 0 of 2 correct: a failure and a timeout
        string_b.task_id: ["return 1 / 0\n", "while True:\n        pass\n"],
        # 1 of 1 correct
        arith.task_id: [arith.reference],
    }
    # 3 s: a correct program under a loaded machine (a test suite beside an experiment)
    # once took more than 1 s to start, pass and end.
    report = evaluate([string_a, string_b, arith], completions, ks=(1, 2, 5), timeout_s=3.0)
    by_id = {p.task_id: p for p in report.problems}
    a, b, c = by_id[string_a.task_id], by_id[string_b.task_id], by_id[arith.task_id]
    assert (a.n, a.c, b.n, b.c, c.n, c.c) == (3, 2, 2, 0, 1, 1)
    assert a.pass_at[1] == pytest.approx(2 / 3) and a.pass_at[2] == 1.0 and 5 not in a.pass_at
    assert b.pass_at == {1: 0.0, 2: 0.0}  # k > n is left out
    assert c.pass_at == {1: 1.0}
    assert b.statuses["failed"] == 1 and b.statuses["timeout"] == 1
    assert report.status_counts == {
        "passed": 3,
        "failed": 2,
        "timeout": 1,
        "memory": 0,
        "error": 0,
    }
    assert report.n_samples == 6
    assert report.mean[1] == pytest.approx((2 / 3 + 0.0 + 1.0) / 3)
    assert report.mean[2] == pytest.approx((1.0 + 0.0) / 2)  # only problems with n >= 2
    assert 5 not in report.mean
    assert list(report.per_category) == ["string", "arithmetic"]  # bank order
    assert report.per_category["string"][1] == pytest.approx((2 / 3 + 0.0) / 2)
    assert report.per_category["arithmetic"][1] == 1.0
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["pass@1"] == pytest.approx(report.mean[1])
    assert as_json["problems"][0]["pass@5"] is None


def test_evaluate_rejects_inconsistent_input() -> None:
    bank = generate_bank(1, seed=0)[:2]
    good = {p.task_id: [p.reference] for p in bank}
    with pytest.raises(ValueError, match="unknown task ids"):
        evaluate(bank, {**good, "nope/1": ["x"]})
    with pytest.raises(ValueError, match="no completions"):
        evaluate(bank, {bank[0].task_id: [bank[0].reference]})
    with pytest.raises(ValueError, match="no completions"):
        evaluate(bank, {**good, bank[1].task_id: []})
    with pytest.raises(TypeError, match="list of completions"):
        evaluate(bank, {**good, bank[1].task_id: bank[1].reference})
    with pytest.raises(ValueError, match="duplicate"):
        evaluate([bank[0], bank[0]], good)
    with pytest.raises(ValueError, match="ks"):
        evaluate(bank, good, ks=(0,))


# ------------------------------------------------------------------- structural match

_PROMPT = 'def repeat(s: str) -> list[str]:\n    """Return s repeated 3 times."""\n    '


def test_structural_match_ignores_literals_and_renamed_identifiers() -> None:
    from peerlm.agent.eval.evaluation import structural_match

    reference = "return [s] * 3\n"
    assert structural_match(_PROMPT, "return [s] * 2\n", reference)  # wrong constant
    assert structural_match(_PROMPT, "return [s] * 3  # three\n", reference)  # a comment
    body = "out = []\n    for i in range(3):\n        out.append(s)\n    return out\n"
    renamed = body.replace("out", "acc").replace(" i ", " j ")
    assert structural_match(_PROMPT, renamed, body)


def test_structural_match_sees_structure() -> None:
    from peerlm.agent.eval.evaluation import structural_match

    reference = "return [s] * 3\n"
    assert not structural_match(_PROMPT, "return [s] + 3\n", reference)  # another operator
    assert not structural_match(_PROMPT, "return s * 3\n", reference)  # no list
    assert not structural_match(_PROMPT, "", reference)
    # Attributes and builtins are structure: .append is not .extend, len is not abs.
    assert not structural_match(_PROMPT, "return s.upper()\n", "return s.lower()\n")
    assert not structural_match(_PROMPT, "return len(s)\n", "return abs(s)\n")
    # Two distinct names are not one name used twice.
    assert not structural_match(_PROMPT, "return s + t\n", "return s + s\n")


def test_structural_match_of_untokenizable_code_is_false() -> None:
    from peerlm.agent.eval.evaluation import structural_form, structural_match

    assert structural_form('return "unterminated\n') is None
    assert not structural_match(_PROMPT, 'return """open\n', "return [s] * 3\n")


def test_structural_match_rate_counts_samples() -> None:
    from peerlm.agent.eval.evaluation import structural_match_rate

    problem = generate_bank(1, 0)[0]
    ref = problem.reference
    assert structural_match_rate(problem, [ref, ref, "pass\n", "return\n"]) == 0.5
    assert structural_match_rate(problem, []) == 0.0
    with pytest.raises(TypeError):
        structural_match_rate(problem, ref)


def test_evaluate_takes_known_outcomes_and_adds_what_it_ran() -> None:
    bank = generate_bank(2, seed=3)
    a, b = bank[0], bank[1]
    wrong = "return None\n"
    # A known status stands for its program: the wrong completion counts as passed here,
    # which only a lookup (not a sandbox run) can give.
    known = {a.program(wrong): "passed"}
    report = evaluate([a, b], {a.task_id: [wrong], b.task_id: [b.reference]}, ks=(1,), known=known)
    by_id = {p.task_id: p for p in report.problems}
    assert by_id[a.task_id].c == 1 and by_id[b.task_id].c == 1
    assert known == {a.program(wrong): "passed", b.program(b.reference): "passed"}
    # Without the map the same wrong completion fails: the sandbox judged it.
    fresh = evaluate([a], {a.task_id: [wrong]}, ks=(1,))
    assert fresh.problems[0].c == 0
