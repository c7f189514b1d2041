"""The peer server's send budget (slow readers): the accounting and its waits."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.peer.send_budget import SendBudget, SendLedger
from peerlm.agent.settings import PeerSendSettings
from pydantic import ValidationError


def test_total_and_identity_bounds_queue_what_does_not_fit() -> None:
    ledger = SendLedger(total_bytes=10, identity_bytes=4)
    assert ledger.request("a", 4) is None
    assert ledger.request("a", 1) is not None  # a's share is full
    assert ledger.request("b", 4) is None
    assert ledger.request("c", 4) is not None  # the total (10) would be passed
    assert ledger.in_flight == 8 and ledger.waiting == 2


def test_bytes_coming_back_go_to_the_identity_holding_least() -> None:
    ledger = SendLedger(total_bytes=4, identity_bytes=4)
    assert ledger.request("slow", 2) is None
    assert ledger.request("slow", 2) is None
    first_slow = ledger.request("slow", 2)  # queued first
    honest = ledger.request("honest", 2)  # queued second, but holds nothing
    assert first_slow is not None and honest is not None
    # One of slow's writes finishes: honest (holding 0) goes before slow (holding 2).
    assert ledger.release("slow", 2) == [honest]
    assert ledger.held("honest") == 2 and ledger.held("slow") == 2
    assert ledger.release("honest", 2) == [first_slow]


def test_a_waiting_identity_holding_more_does_not_block_one_holding_less() -> None:
    ledger = SendLedger(total_bytes=4, identity_bytes=4)
    assert ledger.request("a", 3) is None
    waiting = ledger.request("a", 1)  # a holds 3: granted, it fits the total
    assert waiting is None
    later = ledger.request("b", 2)  # nothing free
    assert later is not None
    assert ledger.release("a", 1) == []  # one byte free: b needs two
    assert ledger.release("a", 3) == [later]
    assert ledger.held("b") == 2 and ledger.waiting == 0


def test_equal_holders_go_first_come_and_a_waiter_can_leave() -> None:
    ledger = SendLedger(total_bytes=4, identity_bytes=4)
    assert ledger.request("a", 3) is None
    big = ledger.request("b", 4)
    small = ledger.request("c", 2)
    assert big is not None and small is not None
    assert ledger.release("a", 3) == [big]  # b and c hold nothing: b came first
    assert ledger.withdraw(small) == []
    assert ledger.waiting == 0 and ledger.in_flight == 4


def test_a_chunk_larger_than_the_share_goes_alone() -> None:
    ledger = SendLedger(total_bytes=8, identity_bytes=2)
    assert ledger.request("a", 5) is None  # a holds nothing: sent alone, all 5 bytes count
    assert ledger.held("a") == 5
    assert ledger.request("a", 1) is not None  # nothing more for a until it comes back
    assert ledger.request("b", 5) is not None  # 5 + 5 would pass the total
    assert len(ledger.release("a", 5)) == 2  # a's 1 byte and b's 5 now fit the total
    assert ledger.in_flight == 6


def test_releasing_more_than_held_is_an_error() -> None:
    ledger = SendLedger(total_bytes=8, identity_bytes=8)
    with pytest.raises(ValueError, match="holds 0"):
        ledger.release("a", 1)
    with pytest.raises(ValueError, match="positive"):
        SendLedger(total_bytes=0, identity_bytes=1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 6), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_never_more_than_the_bounds_and_everything_comes_back(
    steps: list[tuple[str, int, bool]],
) -> None:
    ledger = SendLedger(total_bytes=10, identity_bytes=4)
    granted: list[tuple[str, int]] = []
    queued: dict[int, tuple[str, int]] = {}
    for identity, nbytes, release_one in steps:
        ticket = ledger.request(identity, nbytes)
        if ticket is None:
            granted.append((identity, nbytes))
        else:
            queued[ticket] = (identity, nbytes)
        if release_one and granted:
            for t in ledger.release(*granted.pop(0)):
                granted.append(queued.pop(t))
        # The bounds, each passed by at most one request larger than itself.
        assert ledger.in_flight <= 10 + 6
        assert all(ledger.held(i) <= 6 for i in "abc")
    while granted:
        for t in ledger.release(*granted.pop()):
            granted.append(queued.pop(t))
    assert ledger.in_flight == 0 and not queued and ledger.waiting == 0


async def test_a_wait_that_runs_out_reserves_nothing() -> None:
    budget = SendBudget(total_bytes=4, identity_bytes=4)
    assert await budget.reserve("a", 4, timeout_s=1)
    assert not await budget.reserve("b", 1, timeout_s=0.01)
    assert budget.ledger.waiting == 0 and budget.ledger.held("b") == 0


async def test_a_waiter_is_woken_when_bytes_come_back() -> None:
    budget = SendBudget(total_bytes=4, identity_bytes=4)
    assert await budget.reserve("a", 4, timeout_s=1)
    waiter = asyncio.ensure_future(budget.reserve("b", 2, timeout_s=30))
    await asyncio.sleep(0)
    assert not waiter.done()
    budget.release("a", 4)
    assert await waiter
    assert budget.ledger.held("b") == 2


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    budget = SendBudget(total_bytes=4, identity_bytes=4)
    assert await budget.reserve("a", 4, timeout_s=1)
    waiter = asyncio.ensure_future(budget.reserve("b", 2, timeout_s=30))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release("a", 4)
    assert budget.ledger.in_flight == 0 and budget.ledger.waiting == 0


def test_a_share_above_the_budget_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="identity_bytes"):
        PeerSendSettings(budget_bytes=1 << 20, identity_bytes=2 << 20)
    assert PeerSendSettings().identity_bytes <= PeerSendSettings().budget_bytes
