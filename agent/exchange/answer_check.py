"""Which adapter's answer a routed input gets, judged by the example its own prompt shows
(``answer_check``; our choice beyond the papers).

The input router (:mod:`.peer_knowledge`) sends an input to the peer slot when it looks
unlike the participant's own data. It errs on a few inputs (measured on worlds 0 and 23:
1-2 of a client's 80 public test problems, all "divisible by" prompts that read like the
boolean category), and the slot, which learnt a peer's skills since it was copied from the
own adapter, may fail one the own adapter passes: a regression against training alone
that no gate on validation data sees. Every bank prompt shows a worked example in its
docstring (``>>> call`` and the result; :mod:`.self_check`), and an answer that does not
reproduce it is wrong whatever the hidden tests say. So before a routed input's answer
leaves the participant, the own adapter's answer (and under ``peer_first``, where that
passes, the slot's) is run against that example in the participant's sandbox:

* ``own_first`` (the default): the own adapter's answer, unless it fails its prompt's
  example; then the slot's. Where the example is among the tests (as in the bank), a
  routed input then never scores below the own adapter alone: a participant answers what
  it can demonstrably do itself, and the slot only what it demonstrably cannot.
* ``peer_first``: the slot's answer, unless it fails the example and the own one passes.
* ``off``: the router alone (the slot's answer).

A prompt without a checkable example is left to the router. Only routed inputs are
checked: choosing between two adapters' answers on every input would be best-of-two
sampling, a gain training alone could buy with a second sample, not knowledge from a peer.
Answers are paired by sample position (the own adapter's k-th with the slot's k-th), so
a choice replaces one answer by one answer and pass@k keeps its meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["ANSWER_CHECKS", "AnswerCheck", "CheckedAnswers", "check_answers", "takes_peer"]

AnswerCheck = Literal["off", "own_first", "peer_first"]
ANSWER_CHECKS: tuple[str, ...] = get_args(AnswerCheck)

#: ``verdicts(prompts, completions)``: per completion, whether it reproduces its prompt's
#: example (None: nothing to check); :func:`~.self_check.example_verdicts` with limits.
Verdicts = Callable[[Sequence[str], Sequence[str]], Sequence["bool | None"]]


def takes_peer(policy: AnswerCheck, own_ok: bool | None, peer_ok: bool | None) -> bool:
    """Whether a routed input's answer is the peer slot's under ``policy``, given whether
    the own adapter's and the slot's answers reproduce the prompt's example (None: the
    prompt shows none to check, or the answer was not judged; a prompt without a checkable
    example is the router's)."""
    if policy == "off" or own_ok is None:
        return True
    if policy == "own_first":
        return not own_ok
    if policy == "peer_first":
        return peer_ok is not False or not own_ok
    raise ValueError(f"answer_check must be one of {ANSWER_CHECKS}, not {policy!r}")


@dataclass(frozen=True)
class CheckedAnswers:
    """The answers chosen per input (per sample), and what the check saw: ``own_ok`` and
    ``peer_ok`` per input and sample (None: nothing to check, or not run because no policy
    needs it: the slot's answer is judged only where the own one passed, and only under
    ``peer_first``), ``from_own`` the answers the own adapter gave in the slot's place.
    Every policy's choice follows from a ``peer_first`` check (:meth:`picks`)."""

    answers: list[list[str]]
    own_ok: list[list[bool | None]]
    peer_ok: list[list[bool | None]]
    from_own: int
    #: The policy the check ran under: it judged what that policy needs, so it answers
    #: for that policy and the weaker ones (``off`` < ``own_first`` < ``peer_first``).
    checked_as: AnswerCheck = "peer_first"

    def picks(self, policy: AnswerCheck) -> list[list[bool]]:
        """Per input and sample, whether ``policy`` takes the slot's answer (what another
        policy would have answered, from the same check, without running anything again).
        Raises :class:`ValueError` for a policy that needs verdicts the check did not run
        (``peer_first`` from an ``own_first`` check: the slot's answers were not judged)."""
        if ANSWER_CHECKS.index(policy) > ANSWER_CHECKS.index(self.checked_as):
            raise ValueError(f"a check run as {self.checked_as!r} cannot answer for {policy!r}")
        return [
            [takes_peer(policy, o, p) for o, p in zip(own_i, peer_i, strict=True)]
            for own_i, peer_i in zip(self.own_ok, self.peer_ok, strict=True)
        ]

    @staticmethod
    def pick(
        picks: Sequence[Sequence[bool]], own: Sequence[Sequence[str]], peer: Sequence[Sequence[str]]
    ) -> list[list[str]]:
        """The answers ``picks`` (from :meth:`picks`) choose."""
        return [
            [p if take else o for take, o, p in zip(takes, own_i, peer_i, strict=True)]
            for takes, own_i, peer_i in zip(picks, own, peer, strict=True)
        ]


def check_answers(
    policy: AnswerCheck,
    prompts: Sequence[str],
    own: Sequence[Sequence[str]],
    peer: Sequence[Sequence[str]],
    verdicts: Verdicts,
) -> CheckedAnswers:
    """Per routed input (``prompts``), the own adapter's or the slot's answer per sample,
    as ``policy`` picks by ``verdicts`` (module docstring). With ``off`` nothing runs.
    Raises :class:`ValueError` when the inputs, or an input's samples, do not pair up."""
    if policy not in ANSWER_CHECKS:
        raise ValueError(f"answer_check must be one of {ANSWER_CHECKS}, not {policy!r}")
    if not len(prompts) == len(own) == len(peer):
        raise ValueError(f"{len(prompts)} prompts, {len(own)} own and {len(peer)} peer answers")
    for i, (o, p) in enumerate(zip(own, peer, strict=True)):
        if len(o) != len(p):
            raise ValueError(f"input {i}: {len(o)} own answers but {len(p)} from the slot")
    if policy == "off":
        unchecked: list[list[bool | None]] = [[None] * len(p) for p in peer]
        return CheckedAnswers([list(p) for p in peer], unchecked, unchecked, 0, "off")
    flat_prompts = [prompt for prompt, p in zip(prompts, peer, strict=True) for _ in p]
    own_flat = [a for o in own for a in o]
    peer_flat = [a for p in peer for a in p]
    own_checked = _judged(verdicts, flat_prompts, own_flat)
    # The slot's answer matters only where the own one passes (peer_first keeps the slot's
    # unless it fails there; own_first never asks): each sandbox run costs a process.
    peer_checked: list[bool | None] = [None] * len(peer_flat)
    if policy == "peer_first":
        ask = [k for k, ok in enumerate(own_checked) if ok]
        judged = _judged(verdicts, [flat_prompts[k] for k in ask], [peer_flat[k] for k in ask])
        for k, ok in zip(ask, judged, strict=True):
            peer_checked[k] = ok
    own_iter, peer_iter = iter(own_checked), iter(peer_checked)
    own_ok = [[next(own_iter) for _ in p] for p in peer]
    peer_ok = [[next(peer_iter) for _ in p] for p in peer]
    picks = CheckedAnswers([], own_ok, peer_ok, 0, policy).picks(policy)
    answers = CheckedAnswers.pick(picks, own, peer)
    from_own = sum(not take for takes in picks for take in takes)
    return CheckedAnswers(answers, own_ok, peer_ok, from_own, policy)


def _judged(verdicts: Verdicts, prompts: list[str], answers: list[str]) -> list[bool | None]:
    """``verdicts`` of ``answers``, checked to give one per answer."""
    if not answers:
        return []
    got = list(verdicts(prompts, answers))
    if len(got) != len(answers):
        raise ValueError(f"verdicts gave {len(got)} answers for {len(answers)}")
    return got
