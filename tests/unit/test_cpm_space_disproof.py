"""The CPM acts on students' disproofs of a sender's declared parameter-space fingerprint.

A member may declare another member's fingerprint to be paired for merges; the students
that pull its adapter find out and name it in ``space_mismatch``. One disproof excludes
the (student, sender) pair from same-space protocols; ``space_disproof_quorum`` distinct
students make the sender undeclared for everyone until it declares another fingerprint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from peerlm.services.cpm import CpmSettings
from peerlm.services.cpm.core import CpmCore, CpmError
from peerlm.services.cpm.records import DirectiveRecord, DirectiveStatus
from peerlm.services.cpm.store import CpmStore, MemoryCpmStore, SqliteCpmStore

NAMES = ["a", "b", "c", "d", "e", "f"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _core(store: CpmStore | None = None, db: Path | None = None, quorum: int = 2) -> CpmCore:
    settings = CpmSettings(
        init=True,
        protocols=("svd_hka",),
        merge_senders=3,
        directive_ttl_s=60,
        space_disproof_quorum=quorum,
        **({"db": db} if db is not None else {}),
    )
    return CpmCore(settings, store or MemoryCpmStore(), Clock())


def _submit(c: CpmCore, spaces: dict[str, str] | None = None) -> None:
    for k, name in enumerate(NAMES):
        feats = [float(x) for x in np.random.default_rng(k).uniform(0, 1, 32)]
        c.submit_profile(
            name,
            1,
            feats,
            f"127.0.0.1:{6000 + k}",
            connected=len(NAMES),
            param_space=(spaces or {}).get(name, "ps"),
            protocols=("akd", "svd_hka"),
        )


def _senders(d: DirectiveRecord) -> set[str]:
    return {d.teacher, *(n for n, _ in d.co_senders)}


def _rounds(c: CpmCore, n: int = 12) -> list[DirectiveRecord]:
    """``n`` matchmaking rounds (every agent submits again), each directive rewarded 0."""
    out = []
    for _ in range(n):
        _submit(c)
        for d in c.matchmake().directives:
            c.report_reward(d.student, d.directive_id, 0.0)
            out.append(d)
    return out


def _pairs_with(directives: Sequence[DirectiveRecord], x: str) -> set[str]:
    """Everyone ``x`` was paired with for a merge: its students, and its senders."""
    partners: set[str] = set()
    for d in directives:
        if x in _senders(d):
            partners.add(d.student)
        if d.student == x:
            partners |= _senders(d)
    return partners


def _first_with_co_sender(c: CpmCore) -> tuple[DirectiveRecord, str]:
    _submit(c)
    d = next(d for d in c.matchmake().directives if d.co_senders)
    return d, d.co_senders[0][0]


def test_a_named_co_sender_is_excluded_from_its_students_merges_only() -> None:
    """A co-sender whose adapter the student found of another space is recorded as
    disproved by that student and is never again paired with it (neither way, teacher or
    co-sender); it is still paired with every other member (one disproof is not the
    quorum)."""
    c = _core()
    d, liar = _first_with_co_sender(c)
    c.report_reward(d.student, d.directive_id, 0.1, space_mismatch=[liar])
    assert c.disproved_by(liar) == {d.student}
    assert c.disproved_members == 0
    directives = _rounds(c)
    assert d.student not in _pairs_with(directives, liar)
    assert _pairs_with(directives, liar) == set(NAMES) - {liar, d.student}


def test_a_hostile_student_cannot_exclude_an_honest_member_from_others_pairs() -> None:
    """A student naming an honest teacher (it may lie) cuts only its own pairing: the
    teacher is paired with every other member, the hostile student with every other."""
    c = _core()
    _submit(c)
    d = c.matchmake().directives[0]
    hostile, honest = d.student, d.teacher
    c.report_reward(hostile, d.directive_id, 0.0, space_mismatch=[honest])
    directives = _rounds(c)
    assert _pairs_with(directives, honest) == set(NAMES) - {honest, hostile}
    assert _pairs_with(directives, hostile) == set(NAMES) - {hostile, honest}


def _disprove_by_two(c: CpmCore) -> str:
    """Two distinct students disprove one sender's claim; that sender's name."""
    d, liar = _first_with_co_sender(c)
    c.report_reward(d.student, d.directive_id, 0.0, space_mismatch=[liar])
    for _ in range(20):
        _submit(c)
        for e in c.matchmake().directives:
            named = [liar] if liar in _senders(e) and e.student != d.student else []
            c.report_reward(e.student, e.directive_id, 0.0, space_mismatch=named)
            if named:
                assert len(c.disproved_by(liar)) == 2
                return liar
    raise AssertionError("no second student pulled from the liar")


def test_after_the_quorum_the_liar_is_paired_with_nobody_until_it_declares_another() -> None:
    """Two distinct students' disproofs: the liar is matched as undeclared, so no merge
    names it; declaring the same fingerprint again does not clear it, declaring another
    does (its disproofs were of the old claim)."""
    c = _core()
    liar = _disprove_by_two(c)
    assert c.disproved_members == 1
    assert _pairs_with(_rounds(c), liar) == set()
    _submit(c, {liar: "ps"})  # the same claim again
    assert c.disproved_members == 1 and len(c.disproved_by(liar)) == 2
    _submit(c, {liar: "ps-other"})
    assert c.disproved_members == 0 and c.disproved_by(liar) == frozenset()


def test_a_quorum_of_one_excludes_at_the_first_disproof() -> None:
    c = _core(quorum=1)
    d, liar = _first_with_co_sender(c)
    c.report_reward(d.student, d.directive_id, 0.0, space_mismatch=[liar])
    assert c.disproved_members == 1
    assert _pairs_with(_rounds(c), liar) == set()


@pytest.mark.parametrize("which", ["student", "stranger", "repeat", "unknown", "flood"])
def test_naming_a_non_sender_is_refused_and_records_nothing(which: str) -> None:
    """INVALID_ARGUMENT (reason ``space_mismatch``): the directive stays open, the bandit
    and the disproofs unchanged; the same report without the bad name is then accepted."""
    c = _core()
    d, co = _first_with_co_sender(c)
    stranger = next(n for n in NAMES if n != d.student and n not in _senders(d))
    named = {
        "student": [d.student],
        "stranger": [co, stranger],
        "repeat": [co, co],
        "unknown": ["nobody"],
        # More names than a directive has senders: refused before any is looked at.
        "flood": [co] * 100_000,
    }[which]
    before = c.matchmaker.snapshot()
    with pytest.raises(CpmError) as err:
        c.report_reward(d.student, d.directive_id, 0.2, space_mismatch=named)
    assert (err.value.code, err.value.reason) == ("INVALID_ARGUMENT", "space_mismatch")
    assert c.matchmaker.snapshot() == before
    assert all(c.disproved_by(n) == frozenset() for n in NAMES)
    assert c.space_disproofs_recorded == 0
    assert d.directive_id in {o.directive_id for o in c.open_directives_for(d.student)}
    out = c.report_reward(d.student, d.directive_id, 0.2, space_mismatch=[co])
    assert out.directive.status is DirectiveStatus.REWARDED
    assert c.disproved_by(co) == {d.student}


def test_a_refusal_names_the_mismatched_teacher() -> None:
    """With the failure (PARAMETER_SPACE) the teacher itself may be named."""
    c = _core()
    _submit(c)
    d = c.matchmake().directives[0]
    c.report_reward(d.student, d.directive_id, 0.0, failure=2, space_mismatch=[d.teacher])
    assert c.disproved_by(d.teacher) == {d.student}


def test_a_student_of_another_space_disproves_nothing() -> None:
    """A student that now declares another fingerprint than the sender disproves nothing
    (a mismatch was expected); its report is accepted."""
    c = _core()
    d, liar = _first_with_co_sender(c)
    c.report_reward(d.student, d.directive_id, 0.0, space_mismatch=[liar])
    _submit(c)
    e = next(e for e in c.matchmake().directives if e.student != liar and e.co_senders)
    _submit(c, {e.student: "ps-mine"})  # the student re-declared before reporting
    named = [e.co_senders[0][0]]
    c.report_reward(e.student, e.directive_id, 0.0, space_mismatch=named)
    assert e.student not in c.disproved_by(named[0])
    assert c.space_disproofs_recorded == 1


def test_disproofs_survive_a_restart(tmp_path: Path) -> None:
    """Recorded with the rewards in the store: a restarted CPM still holds both students'
    disproofs and still leaves the liar unpaired."""
    db = tmp_path / "cpm.db"
    store = SqliteCpmStore(db)
    c = _core(store, db)
    liar = _disprove_by_two(c)
    students = c.disproved_by(liar)
    store.close()  # like a SIGKILL: nothing but what was committed
    store = SqliteCpmStore(db)
    again = _core(store, db)
    assert again.disproved_by(liar) == students and again.disproved_members == 1
    assert _pairs_with(_rounds(again, 4), liar) == set()
    store.close()


def test_the_quorum_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="space_disproof_quorum"):
        CpmSettings(space_disproof_quorum=0)
    assert CpmSettings().space_disproof_quorum == 2
