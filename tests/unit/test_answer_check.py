"""A routed input's answer, judged by its own prompt's example: the own adapter's where the
slot's is demonstrably no better (``answer_check``), run in the real sandbox."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from peerlm.agent.exchange.answer_check import ANSWER_CHECKS, check_answers, takes_peer
from peerlm.agent.exchange.self_check import example_verdicts

PROMPT = '''def is_multiple(n: int) -> bool:
    """Return True if n is divisible by 2, otherwise False.

    >>> is_multiple(48)
    True
    """
    '''
RIGHT = "return n % 2 == 0\n"
WRONG = "return n % 13 == 0\n"  # fails the example: 48 is not a multiple of 13
PLAIN = 'def f(x: int) -> int:\n    """Return x plus one."""\n    '


@pytest.mark.parametrize(
    ("policy", "own_ok", "peer_ok", "peer"),
    [
        # The router alone.
        ("off", True, False, True),
        # The own adapter first: the slot only where the own answer fails its example.
        ("own_first", True, True, False),
        ("own_first", True, False, False),
        ("own_first", False, True, True),
        ("own_first", False, False, True),
        # The slot first: the own adapter only where it passes and the slot fails.
        ("peer_first", True, True, True),
        ("peer_first", True, False, False),
        ("peer_first", False, True, True),
        ("peer_first", False, False, True),
        # Nothing to check: the router decides.
        ("own_first", None, True, True),
        ("peer_first", None, None, True),
        # The slot's answer not judged (own_first never asks): the own answer passed.
        ("own_first", True, None, False),
    ],
)
def test_which_answer_each_policy_takes(
    policy: str, own_ok: bool | None, peer_ok: bool | None, peer: bool
) -> None:
    assert takes_peer(policy, own_ok, peer_ok) is peer  # type: ignore[arg-type]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="answer_check must be one of"):
        takes_peer("best", True, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="answer_check must be one of"):
        check_answers("best", [], [], [], example_verdicts)  # type: ignore[arg-type]


def test_verdicts_run_each_answer_against_its_prompts_example_in_the_sandbox() -> None:
    hostile = "import os\n    os.system('true')\n    while True:\n        pass\n"
    got = example_verdicts(
        [PROMPT, PROMPT, PLAIN, PROMPT], [RIGHT, WRONG, "return x + 1\n", hostile], timeout_s=2.0
    )
    # A hostile answer (the guard's None os.system, or the timeout) fails; no example: None.
    assert got == [True, False, None, False]


def test_own_first_keeps_the_own_answer_where_it_passes_and_counts_it() -> None:
    """The public-slice regression the check exists for: a "divisible by" prompt the router
    sends to the slot, which answers it wrongly while the own adapter answers it right."""
    other = PROMPT.replace("is_multiple", "fits")
    prompts = [PROMPT, other, PLAIN]
    own = [[RIGHT, WRONG], [WRONG, WRONG], ["return x + 1\n"]]
    peer = [[WRONG, RIGHT], [RIGHT, WRONG], ["return 0\n"]]
    judged: list[str] = []

    def verdicts(ps: Sequence[str], answers: Sequence[str]) -> list[bool | None]:
        judged.extend(answers)
        return example_verdicts(ps, answers)

    checked = check_answers("own_first", prompts, own, peer, verdicts)
    # Sample by sample: own passes -> own; own fails -> the slot (whatever it does);
    # nothing to check -> the slot, as the router said.
    assert checked.answers == [[RIGHT, RIGHT], [RIGHT, WRONG], ["return 0\n"]]
    assert checked.from_own == 1
    assert checked.own_ok == [[True, False], [False, False], [None]]
    # own_first never runs the slot's answers.
    assert checked.peer_ok == [[None, None], [None, None], [None]]
    assert judged == [a for o in own for a in o]
    # ... so it cannot say what peer_first would have answered.
    with pytest.raises(ValueError, match="cannot answer for 'peer_first'"):
        checked.picks("peer_first")
    # A peer_first check judges the slot's answer only where the own one passed, and every
    # policy's choice follows from it without running anything again.
    judged.clear()
    full = check_answers("peer_first", prompts, own, peer, verdicts)
    assert full.peer_ok == [[False, None], [None, None], [None]]
    assert judged == [*(a for o in own for a in o), WRONG]
    assert full.answers == [[RIGHT, RIGHT], [RIGHT, WRONG], ["return 0\n"]]
    assert full.pick(full.picks("own_first"), own, peer) == checked.answers
    assert full.pick(full.picks("off"), own, peer) == [list(p) for p in peer]
    # Where both pass, peer_first keeps the slot's answer and own_first the own one.
    both = check_answers("peer_first", [PROMPT], [[RIGHT]], [["return not n % 2\n"]], verdicts)
    assert both.answers == [["return not n % 2\n"]] and both.from_own == 0
    assert both.pick(both.picks("own_first"), [[RIGHT]], [["return not n % 2\n"]]) == [[RIGHT]]


def test_off_runs_nothing_and_answers_must_pair_up() -> None:
    ran: list[Sequence[str]] = []

    def verdicts(prompts: Sequence[str], answers: Sequence[str]) -> list[bool | None]:
        ran.append(answers)
        return [True] * len(answers)

    checked = check_answers("off", [PROMPT], [[RIGHT]], [[WRONG]], verdicts)
    assert checked.answers == [[WRONG]] and checked.from_own == 0 and ran == []
    with pytest.raises(ValueError, match="1 prompts, 2 own and 1 peer"):
        check_answers("own_first", [PROMPT], [[RIGHT], [RIGHT]], [[WRONG]], verdicts)
    with pytest.raises(ValueError, match="input 0: 2 own answers but 1 from the slot"):
        check_answers("own_first", [PROMPT], [[RIGHT, RIGHT]], [[WRONG]], verdicts)
    with pytest.raises(ValueError, match="verdicts gave 2 answers for 1"):
        check_answers("own_first", [PROMPT], [[RIGHT]], [[WRONG]], lambda p, a: [True, True])


def test_every_policy_is_named() -> None:
    assert ANSWER_CHECKS == ("off", "own_first", "peer_first")
