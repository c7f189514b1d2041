"""The agent's reward stream when a real CPM refuses it as it opens: the client raises the
CPM's own status, never the INTERNAL that grpc.aio gives a write racing that status
(grpc/grpc#36066), nor an UNAVAILABLE that would be retried for a minute.

The race depends on when the CPM's status reaches the client against when the write is
sent. The first test runs it as it comes (here 2-11 % of refused reports hit it before the
fix); the other two fix the order of events, each one way, with the client's real stream
call whose writes are held back: until the status has reached gRPC's core but not the
event loop (the race: the write fails as INTERNAL), or until the status has been
delivered (the write is refused as the call has ended). Nothing is faked: the CPM, the
channel, the calls and their errors are real; only when the write starts is chosen.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from peerlm.agent.cpm.client import CpmClient
from prometheus_client import CollectorRegistry

from peerlm.pki.identity import Role
from tests.cpm_harness import CpmProcess, Pki
from tests.node_contexts import kit_context

pytestmark = pytest.mark.integration

DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
async def cpm(tmp_path: Path) -> Any:
    proc = CpmProcess(
        Pki.create(tmp_path, agents=1),
        tmp_path / "cpm.db",
        tmp_path,
        {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"},
    ).start()
    yield proc
    proc.terminate()


def _non_agent(cpm: CpmProcess, registry: CollectorRegistry) -> CpmClient:
    """A client holding the admin's certificate: the CPM refuses it every reward call."""
    ctx = kit_context(cpm.pki.root, "admin", role=Role.ADMIN, registry=registry)
    return CpmClient(ctx, cpm.target, reward_retry_s=3)


def _unary_fallbacks(registry: CollectorRegistry) -> float:
    labels = {"kind": "reward_unary"}
    return registry.get_sample_value("peerlm_agent_cpm_recoveries_total", labels) or 0.0


class _HeldWrites:
    """The client's real stream call, each write started only after ``hold`` has run."""

    def __init__(self, call: Any, hold: Callable[[Any], Awaitable[None]]) -> None:
        self._call = call
        self._hold = hold

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    async def write(self, request: Any) -> None:
        await self._hold(self._call)
        await self._call.write(request)


def _hold_writes(client: CpmClient, hold: Callable[[Any], Awaitable[None]]) -> None:
    open_stream = client._stub.ReportRewards
    client._stub.ReportRewards = lambda **kw: _HeldWrites(open_stream(**kw), hold)


async def test_every_refused_report_carries_the_cpms_status(cpm: CpmProcess) -> None:
    registry = CollectorRegistry()
    client = _non_agent(cpm, registry)
    try:
        codes = []
        for _ in range(100):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.report_reward("0" * 32, 0.1)
            codes.append(err.value.code())
        assert codes == [DENIED] * 100
        # Each write that raced (none, or a few) was answered by the unary call.
        assert _unary_fallbacks(registry) <= 100
    finally:
        await client.close()


async def test_a_write_racing_the_refusal_is_answered_by_the_unary_call(cpm: CpmProcess) -> None:
    """The write starts after the CPM's refusal reached gRPC's core but before the event
    loop delivered it: grpc.aio fails the write with INTERNAL and overwrites the call's
    status with it. The client must still raise PERMISSION_DENIED, at once.

    The loop is blocked for 0.5 s so that the refusal reaches the core first; on a loaded
    machine it may come later (the write then goes out and the stream's read gets the
    status: no race), so the report is repeated, on a new stream each time, until the race
    was hit, at most five times."""

    async def after_the_status_reached_the_core(call: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.wait_for_connection()  # the request headers are sent
        # Block the event loop (not a wait for a result): gRPC's core threads receive the
        # CPM's refusal meanwhile, and the loop cannot deliver it before the write.
        time.sleep(0.5)

    registry = CollectorRegistry()
    client = _non_agent(cpm, registry)
    _hold_writes(client, after_the_status_reached_the_core)
    try:
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.report_reward("0" * 32, 0.1)
            assert err.value.code() == DENIED
            assert "ReportReward" in (err.value.details() or "")
            assert time.monotonic() - started < 3  # not retried: a refusal is final
            if _unary_fallbacks(registry):
                break
        assert _unary_fallbacks(registry) == 1  # the race was hit, and recovered from
    finally:
        await client.close()


async def test_a_write_after_the_refusal_is_judged_by_the_calls_status(cpm: CpmProcess) -> None:
    """The write starts after the refusal was delivered: grpc.aio refuses it as the call
    has ended (InvalidStateError). That is PERMISSION_DENIED, not a stream that ended (which
    the client would retry as UNAVAILABLE for reward_retry_s)."""

    async def after_the_status_was_delivered(call: Any) -> None:
        assert await call.code() == DENIED

    registry = CollectorRegistry()
    client = _non_agent(cpm, registry)
    _hold_writes(client, after_the_status_was_delivered)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.report_reward("0" * 32, 0.1)
        assert err.value.code() == DENIED
        assert time.monotonic() - started < 2  # not retried for reward_retry_s (3 s)
        assert _unary_fallbacks(registry) == 0
    finally:
        await client.close()
