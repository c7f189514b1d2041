"""Copy drills: correct, deterministic, and never a bank function or a private skill."""

from __future__ import annotations

import ast
import re

from peerlm.agent.tasks.bank import generate_bank
from peerlm.agent.tasks.copy_drills import copy_drills


def test_drills_are_deterministic_distinct_and_named_apart_from_the_bank() -> None:
    drills = copy_drills(300, 7)
    assert drills == copy_drills(300, 7)
    assert drills != copy_drills(300, 8)
    assert len(set(drills)) == 300
    assert all(re.match(r"def drill_[a-z]+\(", d) for d in drills)
    bank_names = {p.entry_point for p in generate_bank(20, 1)}
    assert not any(name.startswith("drill_") for name in bank_names)


def test_every_drill_runs_and_its_docstring_example_holds() -> None:
    for text in copy_drills(200, 11):
        namespace: dict[str, object] = {}
        exec(compile(text, "<drill>", "exec"), namespace)
        lines = [line.strip() for line in text.splitlines()]
        call = next(line for line in lines if line.startswith(">>> ")).removeprefix(">>> ")
        expected = lines[lines.index(">>> " + call) + 1]
        assert eval(call, namespace) == ast.literal_eval(expected), text


def test_every_body_constant_is_stated_in_the_docstring() -> None:
    """The point of a drill: the body's constants can only be predicted by copying them."""
    for text in copy_drills(300, 3):
        tree = ast.parse(text)
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        doc = ast.get_docstring(function) or ""
        statement = doc.split("\n", 1)[0]
        body = function.body[-1]
        constants = [
            node.value
            for node in ast.walk(body)
            if isinstance(node, ast.Constant) and not isinstance(node.value, bool)
        ]
        assert constants, text
        for value in constants:
            assert str(value) in statement, (value, text)
        # Integer constants that are not small multipliers lie outside the bank's range.
        assert all(isinstance(v, str) or abs(v) >= 21 or 2 <= v <= 9 for v in constants)


def test_drills_use_no_construct_of_the_default_private_skills() -> None:
    """No dict, formatting, boolean or sequence construct: drills teach copying, not a skill."""
    forbidden = (ast.Dict, ast.DictComp, ast.JoinedStr, ast.BoolOp, ast.Compare, ast.Subscript)
    for text in copy_drills(300, 5):
        function = ast.parse(text).body[0]
        assert isinstance(function, ast.FunctionDef)
        for node in ast.walk(function.body[-1]):
            assert not isinstance(node, forbidden), text
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id in {"len", "min", "max", "sum"}, text


def test_held_out_drills_are_never_in_the_corpus() -> None:
    from peerlm.agent.tasks.copy_drills import CORPUS_SEED, held_out_drills

    corpus = set(copy_drills(2_000, CORPUS_SEED))
    held_out = held_out_drills(50, 2_000)
    assert len(held_out) == len(set(held_out)) == 50
    assert not corpus & set(held_out)
    assert held_out_drills(50, 0) == held_out_drills(50, 0)
