"""The node context: the one server factory and the one channel factory of a process."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.security.mode import SecurityConfigError
from tests.node_contexts import dev_context, kit_context

pytestmark = pytest.mark.integration

FEDERATION = "nodetest"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation=FEDERATION)
    issue_certificate(root, Role.AGENT, "server", sans=["127.0.0.1", "peer.example.org"])
    issue_certificate(root, Role.AGENT, "member")
    issue_certificate(root, Role.ADMIN, "ops")
    return root


async def _list_services(pki: Path, caller: str, target: str) -> list[str]:
    role = Role.ADMIN if caller == "ops" else Role.AGENT
    async with kit_context(pki, caller, role=role).dial(target) as peer:
        stub = reflection_pb2_grpc.ServerReflectionStub(peer.channel)  # type: ignore[no-untyped-call]
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    return [s.name for s in replies[0].list_services_response.service]


async def test_reflection_is_for_admins_and_health_for_every_member(pki: Path) -> None:
    ctx = kit_context(pki, "server", listen="127.0.0.1:0")
    server = await ctx.serve([], {}, listen="127.0.0.1:0")
    target = f"127.0.0.1:{server.port}"
    try:
        await server.serving(True)
        assert "grpc.health.v1.Health" in await _list_services(pki, "ops", target)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _list_services(pki, "member", target)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with kit_context(pki, "member").dial(target) as peer:
            stub = health_pb2_grpc.HealthStub(peer.channel)  # type: ignore[no-untyped-call]
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refusals = ctx.registry.get_sample_value(
            "peerlm_auth_refusals_total",
            {
                "component": "agent",
                "method": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                "reason": "role_not_allowed",
            },
        )
        assert refusals == 1
    finally:
        await server.stop(0)


def test_a_certificate_without_the_advertised_host_is_reported(pki: Path) -> None:
    ctx = kit_context(pki, "server")
    assert ctx.check_advertised("127.0.0.1:7000")
    assert ctx.check_advertised("peer.example.org:7000")
    assert not ctx.check_advertised("other.example.org:7000")
    gauge = "peerlm_tls_advertised_host_unlisted_count"
    assert ctx.registry.get_sample_value(gauge, {"component": "agent", "host": "127.0.0.1"}) == 0
    unlisted = {"component": "agent", "host": "other.example.org"}
    assert ctx.registry.get_sample_value(gauge, unlisted) == 1
    # A certificate with no SAN at all names no host.
    assert not kit_context(pki, "member").check_advertised("127.0.0.1:7000")


def test_every_process_registry_has_process_and_build_metrics(pki: Path) -> None:
    from peerlm import __version__

    registry = kit_context(pki, "member").registry
    assert registry.get_sample_value("peerlm_build_info", {"version": __version__}) == 1
    assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
    assert registry.get_sample_value("process_open_fds") is not None


def test_plaintext_dials_only_loopback() -> None:
    ctx = dev_context(FEDERATION, "dev")
    with pytest.raises(SecurityConfigError):
        ctx.dial("10.1.2.3:5000")
    assert ctx.dev_metadata() == (("peerlm-dev-identity", f"spiffe://{FEDERATION}/agent/dev"),)
    assert ctx.expect("someone") is None  # no certificates, no sender proofs


def test_under_mtls_transfers_must_prove_their_sender(pki: Path) -> None:
    ctx = kit_context(pki, "member")
    expected = ctx.expect("server")
    assert expected is not None and expected.sender == "server"
    assert expected.recipient == "member"
    cpm = ctx.expect(Role.CPM)
    assert cpm is not None and cpm.sender is None and cpm.role is Role.CPM
    assert ctx.dev_metadata() == ()
