"""The code chain's task metrics: implementation pass and generated-test share (sandboxed)."""

from __future__ import annotations

import pytest
from peerlm.agent.fedwave.chain_tasks import (
    MAX_ASSERTS,
    assert_lines,
    generated_test_programs,
    implementation_program,
    score_chain_tasks,
)
from peerlm.agent.fedwave.code_chain import chain_of
from peerlm.agent.tasks.bank import generate_bank


def test_program_builders() -> None:
    assert implementation_program("def f():\n", "    return 1\n\n", "assert f() == 1\n") == (
        "def f():\n    return 1\nassert f() == 1\n"
    )
    text = "assert f(1) == 2\n  assert f(2) == 3  \nprint('x')\nx = 1\n"
    assert assert_lines(text) == ["assert f(1) == 2", "assert f(2) == 3"]
    assert len(assert_lines("assert True\n" * 40)) == MAX_ASSERTS
    assert generated_test_programs("def f(x):\n    return x\n", "assert f(1) == 1\n") == [
        "def f(x):\n    return x\n\nassert f(1) == 1\n"
    ]


def test_scores_count_real_passes_and_failures() -> None:
    items = [chain_of(p) for p in generate_bank(1, seed=0)[:2]]
    a, b = items
    _, sig_a, body_a, tests_a = a.artefacts
    tests_b = b.artefacts[3]
    first_b = tests_b.splitlines()[0]
    wrong_b = first_b.rsplit("==", 1)[0] + "== 'surely not this'"
    scores = score_chain_tasks(
        items,
        bodies=[body_a, "    return None\n"],  # a: the reference body; b: wrong
        generated_tests=[tests_a, first_b + "\n" + wrong_b + "\nnot a test\n"],
    )
    assert scores.implementation_passed == (True, False)
    assert scores.pass_at_1 == 0.5
    assert scores.tests_total == (len(tests_a.splitlines()), 2)
    assert scores.tests_passed == (len(tests_a.splitlines()), 1)
    assert scores.test_share == pytest.approx(
        (len(tests_a.splitlines()) + 1) / (len(tests_a.splitlines()) + 2)
    )
    # A chained run: the body under a mis-named signature fails the reference tests.
    renamed = sig_a.replace(a.problem.entry_point, "other_name", 1)
    chained = score_chain_tasks([a], [body_a], [""], signatures=[renamed])
    assert chained.implementation_passed == (False,)
    assert chained.tests_total == (0,) and chained.test_share == 0.0
    with pytest.raises(ValueError, match="one length"):
        score_chain_tasks(items, [body_a], ["", ""])
