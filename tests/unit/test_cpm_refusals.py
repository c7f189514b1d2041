"""Refused exchanges at the CPM core: reported like a reward, learnt as ``refusal_reward``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import CpmSettings
from peerlm.services.cpm.core import CpmCore, CpmError, RewardReport
from peerlm.services.cpm.records import DirectiveRecord, DirectiveStatus
from peerlm.services.cpm.refusals import FAILURE_REASONS, failure_name
from peerlm.services.cpm.store import MemoryCpmStore, SqliteCpmStore
from pydantic import ValidationError

from peerlm.wire.v1 import cpm_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _core(
    store: MemoryCpmStore | SqliteCpmStore | None = None, *, refusal_reward: float = 0.0
) -> CpmCore:
    settings = CpmSettings(
        directive_ttl_s=60, round_interval_s=30, init=True, refusal_reward=refusal_reward
    )
    return CpmCore(settings, store or MemoryCpmStore(), Clock())


def _directive(c: CpmCore, round_: int = 1) -> DirectiveRecord:
    for i, a in enumerate(["a", "b"]):
        feats = [float(x) for x in np.random.default_rng(i).uniform(0, 1, 32)]
        c.submit_profile(a, round_, feats, f"127.0.0.1:{5000 + i}", connected=2)
    [d] = c.matchmake().directives
    return d


def test_the_wire_enum_and_the_core_list_agree() -> None:
    wire = {
        v.number: v.name.removeprefix("EXCHANGE_FAILURE_").lower()
        for v in cpm_pb2.DESCRIPTOR.enum_types_by_name["ExchangeFailure"].values
    }
    assert wire.pop(0) == "unspecified"
    assert wire == dict(FAILURE_REASONS)


@given(st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_failure_name_accepts_exactly_the_closed_list(code: int) -> None:
    if code == 0:
        assert failure_name(code) == ""
    elif code in FAILURE_REASONS:
        assert failure_name(code) == FAILURE_REASONS[code]
    else:
        with pytest.raises(ValueError, match="not one of"):
            failure_name(code)


def test_a_refusal_is_recorded_and_learnt_as_the_refusal_reward() -> None:
    c = _core(refusal_reward=-0.5)
    d = _directive(c)
    out = c.report_rewards([RewardReport(d.student, d.directive_id, 0.0, kilobytes=3, failure=2)])[
        0
    ]
    assert not isinstance(out, CpmError)
    assert out.bandit_updates == 1
    assert out.directive.reward is not None
    assert out.directive.reward.failure == "parameter_space"
    assert out.directive.reward.reward == -0.5  # what the bandit learnt, in the ledger
    assert out.directive.reward.kilobytes == 3
    # The teacher's trust counts the refused exchange as a non-success.
    assert c.matchmaker.snapshot().trust[d.teacher] == (1, 0)
    # Once: a retry (or a reward after it) is ALREADY_EXISTS, and changes nothing.
    before = c.matchmaker.snapshot()
    for rep in (
        RewardReport(d.student, d.directive_id, 0.0, failure=2),
        RewardReport(d.student, d.directive_id, 1.0),
    ):
        [err] = c.report_rewards([rep])
        assert isinstance(err, CpmError) and err.reason == "replayed"
    assert c.matchmaker.snapshot() == before


def test_a_refusal_feeds_the_bandit_what_a_reward_of_that_value_would() -> None:
    refused, rewarded, other = _core(refusal_reward=-0.25), _core(), _core()
    for c, rep in ((refused, (0.0, 4)), (rewarded, (-0.25, 0)), (other, (0.5, 0))):
        # Two ordinary rewards first, so that the z-score depends on the third's value.
        for round_, value in ((1, 1.0), (2, 0.0)):
            first = _directive(c, round_)
            c.report_reward(first.student, first.directive_id, value)
        d = _directive(c, round_=3)
        [out] = c.report_rewards([RewardReport(d.student, d.directive_id, rep[0], failure=rep[1])])
        assert not isinstance(out, CpmError)
    np.testing.assert_allclose(refused.matchmaker.theta, rewarded.matchmaker.theta)
    assert not np.allclose(refused.matchmaker.theta, other.matchmaker.theta)


@pytest.mark.parametrize(
    ("who", "failure", "reward", "code", "reason"),
    [
        ("student", 6, 0.0, "INVALID_ARGUMENT", "failure_reason"),
        ("student", -1, 0.0, "INVALID_ARGUMENT", "failure_reason"),
        ("student", 1, 0.3, "INVALID_ARGUMENT", "failure_with_reward"),
        ("teacher", 1, 0.0, "PERMISSION_DENIED", "not_receiver"),
        ("mallory", 3, 0.0, "PERMISSION_DENIED", "not_receiver"),
    ],
)
def test_bad_refusals_leave_state_unchanged(
    who: str, failure: int, reward: float, code: str, reason: str
) -> None:
    c = _core()
    d = _directive(c)
    agent = {"student": d.student, "teacher": d.teacher}.get(who, who)
    before = c.matchmaker.snapshot()
    [err] = c.report_rewards([RewardReport(agent, d.directive_id, reward, failure=failure)])
    assert isinstance(err, CpmError) and (err.code, err.reason) == (code, reason)
    assert c.matchmaker.snapshot() == before
    assert c.open_count == 1  # still open: the student may still report it


def test_a_refusal_after_a_reward_is_already_exists() -> None:
    c = _core()
    d = _directive(c)
    c.report_reward(d.student, d.directive_id, 0.4)
    [err] = c.report_rewards([RewardReport(d.student, d.directive_id, 0.0, failure=1)])
    assert isinstance(err, CpmError) and err.code == "ALREADY_EXISTS"
    assert c.matchmaker.n_updates == 1


def test_refusals_survive_a_restart_and_replay_as_learnt(tmp_path: Path) -> None:
    db = tmp_path / "cpm.db"
    store = SqliteCpmStore(db)
    c = _core(store, refusal_reward=-1.0)
    d = _directive(c)
    c.report_rewards([RewardReport(d.student, d.directive_id, 0.0, failure=4)])
    theta = c.matchmaker.theta.copy()
    store.close()
    # A later CPM with another refusal_reward replays what was learnt, not its setting.
    store = SqliteCpmStore(db)
    again = CpmCore(
        CpmSettings(directive_ttl_s=60, round_interval_s=30, refusal_reward=0.0, db=db),
        store,
        Clock(),
    )
    row = store.get_directive(d.directive_id)
    assert row is not None and row.status is DirectiveStatus.REWARDED
    assert row.reward is not None and row.reward.failure == "sender_proof"
    assert row.reward.reward == -1.0
    np.testing.assert_allclose(again.matchmaker.theta, theta)
    store.close()


@settings(max_examples=20, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_refusal_reward_is_bounded_at_start(value: float) -> None:
    if abs(value) <= 1e6:
        assert CpmSettings(refusal_reward=value).refusal_reward == value
    else:
        with pytest.raises(ValidationError, match="refusal_reward"):
            CpmSettings(refusal_reward=value)
