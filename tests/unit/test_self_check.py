"""A teacher's self-check: each answer runs against its own prompt's docstring example in
the sandbox; what fails is not sent, what shows no example is sent unchecked."""

from __future__ import annotations

import pytest
from peerlm.agent.exchange.self_check import example_program, self_check
from peerlm.agent.tasks.bank import generate_bank

PROMPT = '''def render_list(xs: list[int]) -> str:
    """Return 4 times each number in xs, written in order and joined by ";".

    >>> render_list([18, 6, 30])
    "72;24;120"
    """
    '''
RIGHT = 'return ";".join(str(x * 4) for x in xs)\n'
WRONG = 'return ",".join(str(x * 4) for x in xs)\n'


def test_the_program_checks_the_example_as_a_value_without_the_closing_quotes() -> None:
    program = example_program(PROMPT, RIGHT)
    assert program is not None
    # The expected text is read as a value (the bank writes strings in double quotes).
    assert program.endswith('assert (render_list([18, 6, 30])) == ("72;24;120")\n')
    assert program.startswith(PROMPT + RIGHT)


def test_a_prompt_without_a_checkable_example_gives_no_program() -> None:
    plain = 'def f(x: int) -> int:\n    """Return x plus one."""\n    '
    assert example_program(plain, "return x + 1\n") is None
    printed = 'def f() -> None:\n    """Print hi.\n\n    >>> f()\n    hi there\n    """\n    '
    assert example_program(printed, "print('hi there')\n") is None  # not an expression
    assert example_program("not python (", "x") is None


def test_only_the_answers_that_pass_their_example_are_kept() -> None:
    plain = 'def f(x: int) -> int:\n    """Return x plus one."""\n    '
    hostile = "import os\n    os.system('rm -rf /')\n    while True:\n        pass\n"
    checked = self_check(
        [PROMPT, PROMPT, plain, PROMPT, PROMPT],
        [RIGHT, WRONG, "return 0\n", hostile, RIGHT],
        max_workers=1,
        timeout_s=2.0,
    )
    # The unchecked plain prompt is kept; the wrong, hostile (refused by the sandbox or
    # out of time) answers are not.
    assert checked.kept == (0, 2, 4)
    assert checked.checked == 4 and checked.failed == 2


def test_the_bank_references_pass_their_own_examples() -> None:
    """The check refuses no right answer: the bank's references (six per category) pass
    their own examples."""
    problems = generate_bank(6, seed=3)
    checked = self_check(
        [p.prompt for p in problems], [p.reference for p in problems], max_workers=2
    )
    assert checked.checked == len(problems) and checked.failed == 0


def test_an_answer_that_only_returns_the_examples_result_passes() -> None:
    """What the check cannot see (stated in the module docstring): one example does not
    tell a function from a constant."""
    checked = self_check([PROMPT], ['return "72;24;120"\n'], max_workers=1)
    assert checked.kept == (0,) and checked.failed == 0


def test_prompts_and_answers_must_pair_up() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        self_check([PROMPT, PROMPT], [RIGHT])


def test_the_experiments_teacher_sends_only_what_passed_and_counts_the_rest() -> None:
    """``teach_self_check`` in the experiment: the teacher's answers go through the same
    check as the agent's; the kept ones keep their X_u indices, the client counts both."""
    from types import SimpleNamespace

    from peerlm.app.experiment_distill import teacher_answers
    from peerlm.app.experiment_plan import ExperimentPlan

    answers = {PROMPT: RIGHT, PROMPT.replace("render_list", "render_two"): WRONG}
    prompts = list(answers)
    generated: list[str] = []

    def generate(ps: list[str], max_new_tokens: int, temperature: float) -> list[list[str]]:
        generated.extend(ps)
        return [[answers[p]] for p in ps]

    host = SimpleNamespace(generate=generate)
    for on, kept in ((False, [0, 1]), (True, [0])):
        teacher = SimpleNamespace(host=host, self_checked=0, self_check_failed=0, answered=None)
        world = SimpleNamespace(
            plan=ExperimentPlan(teach_self_check=on),
            transfer=prompts,
            teachable=lambda client, t: [0, 1],
        )
        chosen, completions = teacher_answers(world, teacher, 1)  # type: ignore[arg-type]
        assert chosen == kept and completions == [answers[prompts[k]] for k in kept]
        # A teacher of several students answers once a round: the same answers, no new
        # generation, no second check; the next round answers again.
        generated.clear()
        assert teacher_answers(world, teacher, 1) == (chosen, completions)  # type: ignore[arg-type]
        assert generated == []
        teacher_answers(world, teacher, 2)  # type: ignore[arg-type]
        assert generated == prompts
    assert teacher.self_checked == 4 and teacher.self_check_failed == 2
