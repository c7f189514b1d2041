"""One member's flood of calls cannot lock a server for the others.

A real mTLS server built by the node context, the one place servers are assembled. The
flooding member opens health Watch streams (long-lived, open to every member); with the
per-identity bound it holds at most ``max_calls_per_identity`` of them, the rest are refused
with RESOURCE_EXHAUSTED and counted, and another member is served meanwhile. Without the
bound the same flood takes every slot of ``max_concurrent_rpcs``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerlm.config import GrpcLimits
from peerlm.node import ADMIN_HEADROOM, CALLS_PER_MEMBER
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from tests.node_contexts import kit_context

pytestmark = pytest.mark.integration

FEDERATION = "floodtest"
PER_IDENTITY = 4
GLOBAL = 12
FLOOD = 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation=FEDERATION)
    issue_certificate(root, Role.AGENT, "server", sans=["127.0.0.1"])
    issue_certificate(root, Role.AGENT, "flooder")
    issue_certificate(root, Role.AGENT, "honest")
    return root


async def _watch_first(stub: health_pb2_grpc.HealthStub) -> grpc.aio.UnaryStreamCall:
    """Open a Watch stream and wait for its first answer: the call now holds a slot."""
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    await call.read()
    return call


async def _flood_and_check(
    pki: Path, per_identity: int, global_limit: int
) -> tuple[int, int, str, float]:
    limits = GrpcLimits(max_concurrent_rpcs=global_limit, max_calls_per_identity=per_identity)
    ctx = kit_context(pki, "server", limits=limits, listen="127.0.0.1:0")
    server = await ctx.serve([], {}, listen="127.0.0.1:0")
    target = f"127.0.0.1:{server.port}"
    held: list[grpc.aio.UnaryStreamCall] = []
    try:
        await server.serving(True)
        async with kit_context(pki, "flooder").dial(target) as flooder:
            stub = health_pb2_grpc.HealthStub(flooder.channel)  # type: ignore[no-untyped-call]
            results = await asyncio.gather(
                *(_watch_first(stub) for _ in range(FLOOD)), return_exceptions=True
            )
            held = [r for r in results if isinstance(r, grpc.aio.UnaryStreamCall)]
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
            async with kit_context(pki, "honest").dial(target) as honest:
                other = health_pb2_grpc.HealthStub(honest.channel)  # type: ignore[no-untyped-call]
                try:
                    reply = await other.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                    outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.aio.AioRpcError as err:
                    outcome = err.code().name
            for call in held:
                call.cancel()
        counted = ctx.registry.get_sample_value(
            "peerlm_auth_refusals_total",
            {
                "component": "agent",
                "method": "/grpc.health.v1.Health/Watch",
                "reason": "identity_limit",
            },
        )
        return len(held), len(refused), outcome, counted or 0.0
    finally:
        await server.stop(0)


async def test_a_flooding_member_leaves_the_others_served(pki: Path) -> None:
    # Room for the whole flood at the server: every refusal is the per-identity bound's.
    held, refused, outcome, counted = await _flood_and_check(pki, PER_IDENTITY, 2 * FLOOD)
    assert held == PER_IDENTITY and refused == FLOOD - PER_IDENTITY
    assert outcome == "SERVING"  # the honest member is answered during the flood
    assert counted == FLOOD - PER_IDENTITY


async def test_without_the_bound_the_same_flood_locks_the_server(pki: Path) -> None:
    # The control: a bound as large as the server lets one member take every slot.
    held, _refused, outcome, _counted = await _flood_and_check(pki, GLOBAL * 10, GLOBAL)
    assert held == GLOBAL
    assert outcome == "RESOURCE_EXHAUSTED"


async def test_slots_come_back_when_calls_end(pki: Path) -> None:
    limits = GrpcLimits(max_calls_per_identity=2)
    ctx = kit_context(pki, "server", limits=limits, listen="127.0.0.1:0")
    server = await ctx.serve([], {}, listen="127.0.0.1:0")
    try:
        await server.serving(True)
        async with kit_context(pki, "honest").dial(f"127.0.0.1:{server.port}") as peer:
            stub = health_pb2_grpc.HealthStub(peer.channel)  # type: ignore[no-untyped-call]
            for _ in range(10):  # far more calls than slots, one after another
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_a_population_server_has_room_for_every_member_and_the_operators() -> None:
    # The CPM's default population (max_agents 10,000): a feed and a call each, plus room
    # for admin calls and probes, above the default limit of 1,024 that 1,060 agents filled.
    assert GrpcLimits().max_concurrent_rpcs < 10_000 * CALLS_PER_MEMBER + ADMIN_HEADROOM
