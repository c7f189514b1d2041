"""FedWave's workflow type and the generated code value chain (peerlm.agent.fedwave)."""

from __future__ import annotations

import pytest
from peerlm.agent.fedwave.code_chain import (
    CODE_CHAIN_STAGES,
    build_code_chain,
    chain_of,
    requirement_of,
)
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.tasks.bank import CATEGORIES, function_key, generate_bank, public_problems
from peerlm.agent.tasks.dataset import Problem
from pydantic import ValidationError


def workflow(*stages: tuple[str, tuple[str, ...]]) -> Workflow:
    return Workflow.model_validate({"stages": [{"name": n, "agents": list(a)} for n, a in stages]})


CHAIN = workflow(("specify", ("a1", "a2")), ("implement", ("a3",)), ("test", ("a4", "a5")))


def test_workflow_knows_order_stages_and_neighbours() -> None:
    assert CHAIN.stage_names == CODE_CHAIN_STAGES
    assert CHAIN.agents == ("a1", "a2", "a3", "a4", "a5")
    assert CHAIN.stage_index("a5") == 2 and CHAIN.stage_of("a3").name == "implement"
    before, after = CHAIN.adjacent("a3")
    assert before is not None and before.name == "specify"
    assert after is not None and after.name == "test"
    assert CHAIN.adjacent("a1")[0] is None and CHAIN.adjacent("a4")[1] is None
    with pytest.raises(KeyError, match="not in the workflow"):
        CHAIN.stage_index("mallory")


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([("only", ("a",))], "at least 2"),
        ([("s", ("a",)), ("s", ("b",))], "unique"),
        ([("s", ("a",)), ("t", ("a",))], "serves stages"),
        ([("s", ("a", "a")), ("t", ("b",))], "listed twice"),
        ([("s", ()), ("t", ("b",))], "at least 1"),
        ([("Bad Name", ("a",)), ("t", ("b",))], "lower-case"),
    ],
)
def test_workflow_refuses_bad_shapes(
    stages: list[tuple[str, tuple[str, ...]]], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        workflow(*stages)


def test_workflow_is_frozen_and_refuses_unknown_keys() -> None:
    with pytest.raises(ValidationError):
        CHAIN.stages = ()  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        Workflow.model_validate({"stages": [], "server": "x"})


def test_every_bank_template_retells_as_a_requirement() -> None:
    problems = generate_bank(6, seed=3)  # every template of every category at least once
    for problem in problems:
        text = requirement_of(problem)
        assert text.startswith(f"Write a function named {problem.entry_point} that ")
        assert text.endswith(".\n") and "\n" not in text[:-1]


def test_requirement_spells_out_arguments_and_example() -> None:
    problem = Problem(
        task_id="t/1",
        category="dict",
        prompt='def f(xs: dict[str, int], k: int) -> int:\n    """Return it.\n\n'
        '    >>> f({"a": 1}, 2)\n    3\n    """\n    ',
        reference="return 3\n",
        tests="assert f({}, 1) == 3\n",
        entry_point="f",
    )
    assert requirement_of(problem) == (
        "Write a function named f that takes xs (a dict[str, int]) and k (an int) and "
        'returns an int. Return it. For example, f({"a": 1}, 2) gives 3.\n'
    )
    with pytest.raises(ValueError, match="not in the bank's format"):
        requirement_of(Problem("t/2", "dict", "def f(): pass\n", "x\n", "y\n", "f"))


def test_each_stage_input_is_the_previous_stage_output() -> None:
    item = chain_of(generate_bank(1, seed=0)[0])
    examples = [item.example(i) for i in range(3)]
    assert examples[0].source == item.requirement
    assert examples[1].source == examples[0].target
    # The tester sees the whole function: the signature stage's and the body stage's output.
    assert examples[2].source == examples[0].target + examples[1].target
    assert examples[2].source == item.problem.prompt + item.problem.reference
    assert examples[2].target == item.problem.tests
    assert [e.stage for e in examples] == list(CODE_CHAIN_STAGES)
    with pytest.raises(IndexError):
        item.example(3)


def test_split_is_disjoint_deterministic_and_dealt_to_every_agent() -> None:
    split = build_code_chain(CHAIN, per_stage=30, n_test=24, n_public=12, seed=5)
    again = build_code_chain(CHAIN, per_stage=30, n_test=24, n_public=12, seed=5)
    assert split == again
    assert build_code_chain(CHAIN, per_stage=30, n_test=24, n_public=12, seed=6) != split
    assert {a: len(split.of_agent(a)) for a in CHAIN.agents} == {
        "a1": 15, "a2": 15, "a3": 30, "a4": 15, "a5": 15,
    }  # fmt: skip
    owners: dict[str, str] = {}
    for stage, by_agent in split.private.items():
        for examples in by_agent.values():
            for example in examples:
                assert example.stage == stage
                # no function is in two parts: no stage's data holds another's reference
                assert owners.setdefault(example.task_id, stage) == stage
    test_ids = {item.problem.task_id for item in split.test}
    assert not test_ids & set(owners)
    assert len(test_ids) == 24 and len(split.public) == 12
    public_texts = set(split.public)
    for by_agent in split.private.values():
        for examples in by_agent.values():
            assert not {e.source for e in examples} & public_texts
    # Nothing the tiny models were pre-trained on.
    pretraining = {function_key(p) for p in public_problems()}
    assert not {function_key(item.problem) for item in split.test} & pretraining
    # The stage parts draw on many categories, not one each.
    assert len({item.problem.category for item in split.test}) > len(CATEGORIES) // 2


def test_split_refuses_what_it_cannot_build() -> None:
    two = workflow(("a", ("x",)), ("b", ("y",)))
    with pytest.raises(ValueError, match="has 3 stages"):
        build_code_chain(two, per_stage=4, n_test=1, n_public=1, seed=0)
    with pytest.raises(ValueError, match="every agent needs data"):
        build_code_chain(CHAIN, per_stage=1, n_test=1, n_public=1, seed=0)
    with pytest.raises(ValueError, match="must not be negative"):
        build_code_chain(CHAIN, per_stage=4, n_test=-1, n_public=1, seed=0)
    with pytest.raises(ValueError, match="bank categories"):
        build_code_chain(CHAIN, per_stage=4, n_test=1, n_public=1, seed=0, categories=["x"])
    with pytest.raises(KeyError):
        build_code_chain(CHAIN, per_stage=4, n_test=1, n_public=1, seed=0).of_agent("zz")
