"""``probe_scope``: where a student of ``run-experiment`` measures its Eq. 3 reward."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from peerlm.agent import Problem

from peerlm.app.experiment import ExperimentPlan
from peerlm.app.experiment_distill import reward_examples, reward_scope
from peerlm.app.experiment_slices import ClientSlices
from peerlm.app.experiment_world import World

CATEGORIES = ("dict", "format", "boolean", "string")


def _problem(category: str, k: int) -> Problem:
    return Problem(
        task_id=f"{category}-{k}",
        category=category,
        prompt=f"def {category}_{k}():\n    ",
        reference=f"return {k}\n",
        tests=f"assert {category}_{k}() == {k}\n",
        entry_point=f"{category}_{k}",
    )


def _world(plan: ExperimentPlan, slices: list[ClientSlices]) -> World:
    probe = [_problem(c, k) for c in CATEGORIES for k in range(2)]
    return World(
        plan=plan,
        models=Path("unused"),
        clients_data=[],
        transfer=[],
        transfer_sha256="",
        test=[],
        probe=probe,
        slices=slices,
        public=("string",),
    )


def _slices(own: str, lacked: tuple[str, ...]) -> ClientSlices:
    return ClientSlices(frozenset({own}), frozenset(lacked), frozenset({"string"}))


STUDENT: Any = SimpleNamespace(val_examples=[("def v():\n    ", "return 0\n")])


def test_the_lacked_scope_keeps_only_the_students_lacked_categories() -> None:
    slices = [_slices("dict", ("format", "boolean")), _slices("format", ("dict", "boolean"))]
    world = _world(ExperimentPlan(probe_scope="lacked"), slices)
    for i, sl in enumerate(slices):
        got = reward_examples(world, STUDENT, i)
        want = [(p.prompt, p.reference) for p in world.probe if p.category in sl.lacked]
        assert got == want and len(got) == 4
        # Neither its own skill nor a public category is in its reward.
        assert not any(sl.own & {p.category} for p in world.probe if (p.prompt, p.reference) in got)


def test_all_scope_is_the_whole_probe_and_val_is_the_students_own_data() -> None:
    slices = [_slices("dict", ("format", "boolean"))]
    world = _world(ExperimentPlan(), slices)
    assert reward_examples(world, STUDENT, 0) == world.probe_examples
    val = _world(ExperimentPlan(reward="val"), slices)
    assert reward_examples(val, STUDENT, 0) == STUDENT.val_examples


def test_the_answered_scope_measures_a_package_on_the_probe_of_its_categories() -> None:
    """Under ``answered`` the gate and merges see the whole probe; an AKD package's reward
    is measured on the probe problems of the categories its prompts are labelled with in
    X_u (the agent's ``reward_scope``); the other scopes have no such function."""
    slices = [_slices("dict", ("format", "boolean"))]
    world = _world(ExperimentPlan(probe_scope="answered"), slices)
    world.transfer = ["def a():\n    ", "def b():\n    ", "def c():\n    "]
    world.transfer_categories = ["format", "string", "format"]
    assert reward_examples(world, STUDENT, 0) == world.probe_examples
    scope = reward_scope(world, STUDENT)
    assert scope is not None
    want = [(p.prompt, p.reference) for p in world.probe if p.category == "format"]
    assert scope(["def a():\n    ", "def c():\n    "]) == want and len(want) == 2
    both = scope(world.transfer)
    assert [p.category for p in world.probe if (p.prompt, p.reference) in both] == [
        "format", "format", "string", "string",
    ]  # fmt: skip
    assert scope([]) == []
    for other in ("all", "lacked"):
        assert reward_scope(_world(ExperimentPlan(probe_scope=other), slices), STUDENT) is None


class _Router:
    """Sends the slot the probe problems of one category (what a fitted router does with
    the categories its client lacks)."""

    def __init__(self, category: str) -> None:
        self.category = category

    def to_peer(self, prompts: list[str]) -> list[bool]:
        return [p.startswith(f"def {self.category}_") for p in prompts]


def test_the_routed_scope_measures_only_what_the_slot_will_answer() -> None:
    """Under ``routed`` a package is measured on the probe problems of its categories that
    the student's router sends to its peer slot: a lesson in a category the router keeps
    on the own adapter (public, own) is measured on nothing, so its reward is the KB
    penalty alone; without a router nothing is measured."""
    slices = [_slices("dict", ("format", "boolean"))]
    world = _world(ExperimentPlan(probe_scope="routed"), slices)
    world.transfer = ["def a():\n    ", "def b():\n    ", "def c():\n    "]
    world.transfer_categories = ["format", "string", "boolean"]
    assert reward_examples(world, STUDENT, 0) == world.probe_examples  # the gate's
    student: Any = SimpleNamespace(router=_Router("format"), val_examples=[])
    scope = reward_scope(world, student)
    assert scope is not None
    fmt = [(p.prompt, p.reference) for p in world.probe if p.category == "format"]
    assert scope(world.transfer) == fmt and len(fmt) == 2
    assert scope(["def b():\n    "]) == []  # public: the own adapter answers it
    assert scope(["def c():\n    "]) == []  # lacked, but the router keeps it
    alone: Any = SimpleNamespace(router=None, val_examples=[])
    nothing = reward_scope(world, alone)
    assert nothing is not None and nothing(world.transfer) == []


def test_a_student_lacking_nothing_measures_on_the_whole_probe() -> None:
    world = _world(ExperimentPlan(probe_scope="lacked"), [_slices("dict", ())])
    assert reward_examples(world, STUDENT, 0) == world.probe_examples


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"probe_scope": "own"}, "probe_scope must be"),
        ({"probe_scope": "lacked", "reward": "val"}, "needs reward 'probe'"),
        ({"probe_scope": "routed", "reward": "val"}, "needs reward 'probe'"),
        ({"probe_scope": "routed", "integration": "shared"}, "needs a peer slot"),
    ],
)
def test_bad_scopes_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExperimentPlan(**fields)


def test_the_default_answered_scope_is_moot_without_a_probe() -> None:
    """``answered`` is the default; under ``reward="val"`` there is no probe to scope, so
    the plan is valid and no package is measured on a probe subset."""
    plan = ExperimentPlan(reward="val")
    assert plan.probe_scope == "answered"
    assert reward_scope(_world(plan, [_slices("dict", ())]), STUDENT) is None
