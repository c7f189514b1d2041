"""mTLS end to end: real certificates, a real grpc.aio server on 127.0.0.1, AuthInterceptor."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from peerlm.metrics import new_registry
from peerlm.pki.ca import init_ca, issue_certificate, load_ca, sign_leaf_certificate
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.security.authz import (
    AuthInterceptor,
    TlsFailureCounter,
    TlsFailureInterceptor,
    current_identity,
    describe_rpc_error,
    dev_identity_metadata,
)
from peerlm.security.credentials import TlsFiles, channel_credentials, server_credentials
from peerlm.security.mode import SecurityConfigError, SecurityMode, resolve_security

pytestmark = pytest.mark.integration

FEDERATION = "acme"
SERVICE = "peerlm.test.Echo"
TIMEOUT = 5.0


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


POLICY = {
    method("Whoami"): frozenset({Role.AGENT, Role.OVERLAY}),
    method("Count"): frozenset({Role.AGENT}),
    method("Written"): frozenset({Role.AGENT}),
    method("Gather"): frozenset({Role.AGENT}),
    method("Chat"): frozenset({Role.AGENT}),
    method("AdminOnly"): frozenset({Role.ADMIN}),
    # "Unlisted" is served but deliberately absent: deny by default.
}


# -- PKI for the whole module ---------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    home: Path
    other: Path

    def kit(self, name: str, *, other_ca: bool = False) -> TlsFiles:
        return TlsFiles.from_directory(self.other if other_ca else self.home, name)


def _write_odd_leaf(directory: Path, name: str, uris: list[str]) -> None:
    """A valid certificate from the CA in ``directory`` with hand-picked URI SANs."""
    ca = load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = sign_leaf_certificate(
        ca,
        public_key=key.public_key(),
        common_name=name,
        uris=uris,
        not_valid_before=now - timedelta(minutes=5),
        not_valid_after=now + timedelta(days=1),
    )
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    home, other = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("other")
    init_ca(home, federation=FEDERATION)
    issue_certificate(home, Role.CPM, "cpm", sans=["localhost", "127.0.0.1"])
    issue_certificate(home, Role.AGENT, "a1")
    issue_certificate(home, Role.OVERLAY, "ov1")
    now = datetime.now(UTC)
    issue_certificate(
        home,
        Role.AGENT,
        "expired",
        not_valid_before=now - timedelta(days=10),
        not_valid_after=now - timedelta(days=1),
    )
    _write_odd_leaf(home, "foreign", ["spiffe://elsewhere/agent/x"])
    _write_odd_leaf(home, "anonymous", ["https://example.org/not-spiffe"])
    # Same federation name, different key: a look-alike CA.
    init_ca(other, federation=FEDERATION)
    issue_certificate(other, Role.CPM, "cpm", sans=["localhost", "127.0.0.1"])
    issue_certificate(other, Role.AGENT, "a1")
    return Pki(home=home, other=other)


# -- a test server --------------------------------------------------------------------------


@dataclass
class Served:
    port: int
    registry: CollectorRegistry
    auth_contexts: list[dict[str, list[bytes]]] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def refusals(self, name: str, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "peerlm_auth_refusals_total",
            {"component": "test", "method": method(name), "reason": reason},
        )


def _echo_handler(served: Served) -> grpc.GenericRpcHandler[Any, Any]:
    async def whoami(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        served.auth_contexts.append({k: list(v) for k, v in context.auth_context().items()})
        return current_identity().spiffe_uri.encode()

    async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            await asyncio.sleep(0)
            yield f"{i}:{current_identity().name}".encode()

    async def written(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.write(current_identity().spiffe_uri.encode())

    async def gather(requests: AsyncIterator[bytes], context: Any) -> bytes:
        parts = [r async for r in requests]
        return b",".join(parts) + b"|" + current_identity().name.encode()

    async def chat(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r + b"@" + current_identity().name.encode()

    async def plain(request: bytes, context: Any) -> bytes:
        return b"should never run"

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Whoami": grpc.unary_unary_rpc_method_handler(whoami),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Written": grpc.unary_stream_rpc_method_handler(written),
            "Gather": grpc.stream_unary_rpc_method_handler(gather),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
            "AdminOnly": grpc.unary_unary_rpc_method_handler(plain),
            "Unlisted": grpc.unary_unary_rpc_method_handler(plain),
        },
    )


@contextlib.asynccontextmanager
async def serving(
    tls: TlsFiles | None, *, mode: SecurityMode = SecurityMode.MTLS
) -> AsyncIterator[Served]:
    registry = new_registry()
    served = Served(port=0, registry=registry)
    interceptor = AuthInterceptor(
        POLICY, federation=FEDERATION, mode=mode, registry=registry, component="test"
    )
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((_echo_handler(served),))
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    reflection.enable_server_reflection(
        [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if tls is None:
        served.port = server.add_insecure_port("127.0.0.1:0")
    else:
        served.port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    await server.start()
    try:
        yield served
    finally:
        await server.stop(None)


def secure(served: Served, creds: grpc.ChannelCredentials, **kw: Any) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(served.target, creds, **kw)


async def whoami(channel: grpc.aio.Channel, metadata: Any = None) -> str:
    reply: bytes = await channel.unary_unary(method("Whoami"))(
        b"", timeout=TIMEOUT, metadata=metadata
    )
    return reply.decode()


@contextlib.contextmanager
def refused(code: grpc.StatusCode) -> Iterator[list[grpc.aio.AioRpcError]]:
    box: list[grpc.aio.AioRpcError] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        yield box
    assert info.value.code() == code, info.value.details()
    box.append(info.value)


# -- accepted calls -------------------------------------------------------------------------


async def test_agent_is_accepted_and_handlers_see_its_identity(pki: Pki) -> None:
    async with (
        serving(pki.kit("cpm")) as served,
        secure(served, channel_credentials(pki.kit("a1"))) as channel,
    ):
        assert await whoami(channel) == f"spiffe://{FEDERATION}/agent/a1"
        stream = channel.unary_stream(method("Count"))(b"3", timeout=TIMEOUT)
        assert [m async for m in stream] == [b"0:a1", b"1:a1", b"2:a1"]
        written = channel.unary_stream(method("Written"))(b"", timeout=TIMEOUT)
        assert [m async for m in written] == [b"spiffe://acme/agent/a1"]
        gathered = await channel.stream_unary(method("Gather"))(iter([b"x", b"y"]), timeout=TIMEOUT)
        assert gathered == b"x,y|a1"
        chat = channel.stream_stream(method("Chat"))(iter([b"p", b"q"]), timeout=TIMEOUT)
        assert [m async for m in chat] == [b"p@a1", b"q@a1"]
    context = served.auth_contexts[0]
    # What gRPC core puts in the auth context of a verified mTLS peer (grpcio 1.85).
    assert context["transport_security_type"] == [b"ssl"]
    assert context["x509_pem_cert"][0].startswith(b"-----BEGIN CERTIFICATE-----")
    assert context["peer_spiffe_id"] == [b"spiffe://acme/agent/a1"]
    assert context["ssl_tls_version"] == [b"TLSv1.3"]


async def test_health_and_reflection_are_open_to_any_member(pki: Pki) -> None:
    async with (
        serving(pki.kit("cpm")) as served,
        secure(served, channel_credentials(pki.kit("ov1"))) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
        names = {s.name for s in responses[0].list_services_response.service}
        assert "grpc.health.v1.Health" in names
        # The overlay role may call Whoami too.
        assert await whoami(channel) == "spiffe://acme/overlay/ov1"


async def test_tls13_is_negotiated(pki: Pki) -> None:
    """A raw Python TLS client with a federation certificate sees TLS 1.3 and ALPN h2."""
    kit = pki.kit("a1")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(kit.ca_cert))
    context.load_cert_chain(kit.cert, kit.key)
    context.set_alpn_protocols(["h2"])
    async with serving(pki.kit("cpm")) as served:
        _reader, writer = await asyncio.open_connection(
            "127.0.0.1", served.port, ssl=context, server_hostname="localhost"
        )
        try:
            tls = writer.get_extra_info("ssl_object")
            assert tls.version() == "TLSv1.3"
            assert tls.selected_alpn_protocol() == "h2"
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


# -- authorisation refusals -----------------------------------------------------------------


async def test_wrong_role_is_permission_denied_and_counted(pki: Pki) -> None:
    async with serving(pki.kit("cpm")) as served:
        async with secure(served, channel_credentials(pki.kit("ov1"))) as channel:
            with refused(grpc.StatusCode.PERMISSION_DENIED) as errors:
                await channel.unary_unary(method("AdminOnly"))(b"", timeout=TIMEOUT)
            details = errors[0].details() or ""
            assert method("AdminOnly") in details and "'overlay'" in details and "admin" in details
            # Streaming methods are guarded the same way.
            with refused(grpc.StatusCode.PERMISSION_DENIED):
                stream = channel.unary_stream(method("Count"))(b"1", timeout=TIMEOUT)
                _ = [m async for m in stream]
        assert served.refusals("AdminOnly", "role_not_allowed") == 1.0
        assert served.refusals("Count", "role_not_allowed") == 1.0


async def test_method_missing_from_policy_is_denied(pki: Pki) -> None:
    async with serving(pki.kit("cpm")) as served:
        async with secure(served, channel_credentials(pki.kit("a1"))) as channel:
            with refused(grpc.StatusCode.PERMISSION_DENIED) as errors:
                await channel.unary_unary(method("Unlisted"))(b"", timeout=TIMEOUT)
            assert "not in this server's authorisation policy" in (errors[0].details() or "")
            # A method nobody serves stays UNIMPLEMENTED (and is not counted).
            with refused(grpc.StatusCode.UNIMPLEMENTED):
                await channel.unary_unary(method("Nope"))(b"", timeout=TIMEOUT)
        assert served.refusals("Unlisted", "method_not_in_policy") == 1.0


async def test_other_federation_is_unauthenticated(pki: Pki) -> None:
    async with serving(pki.kit("cpm")) as served:
        async with secure(served, channel_credentials(pki.kit("foreign"))) as channel:
            with refused(grpc.StatusCode.UNAUTHENTICATED) as errors:
                await whoami(channel)
            assert "'elsewhere'" in (errors[0].details() or "")
        async with secure(served, channel_credentials(pki.kit("anonymous"))) as channel:
            with refused(grpc.StatusCode.UNAUTHENTICATED) as errors:
                await whoami(channel)
            assert "no spiffe" in (errors[0].details() or "")
        assert served.refusals("Whoami", "wrong_federation") == 1.0
        assert served.refusals("Whoami", "bad_identity") == 1.0


async def test_dev_identity_metadata_is_ignored_under_mtls(pki: Pki) -> None:
    claim = dev_identity_metadata(PeerIdentity(FEDERATION, Role.ADMIN, "root"))
    async with (
        serving(pki.kit("cpm")) as served,
        secure(served, channel_credentials(pki.kit("a1"))) as channel,
    ):
        assert await whoami(channel, metadata=claim) == "spiffe://acme/agent/a1"
        with refused(grpc.StatusCode.PERMISSION_DENIED):
            await channel.unary_unary(method("AdminOnly"))(b"", timeout=TIMEOUT, metadata=claim)


# -- handshake refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("client", ["other-ca", "no-certificate", "expired"])
async def test_bad_client_certificates_are_refused_in_the_handshake(pki: Pki, client: str) -> None:
    ca = pki.kit("a1").ca_cert.read_bytes()
    stranger = pki.kit("a1", other_ca=True)
    creds = {
        # Trusts the server, but presents a certificate the server's CA never issued
        # (TlsFiles.load would refuse this kit, so build the credentials by hand).
        "other-ca": lambda: grpc.ssl_channel_credentials(
            ca, stranger.key.read_bytes(), stranger.cert.read_bytes()
        ),
        "no-certificate": lambda: grpc.ssl_channel_credentials(root_certificates=ca),
        "expired": lambda: channel_credentials(pki.kit("expired")),
    }[client]()
    async with serving(pki.kit("cpm")) as served:
        async with secure(served, creds) as channel:
            with refused(grpc.StatusCode.UNAVAILABLE) as errors:
                await whoami(channel)
        assert "did not accept our certificate" in describe_rpc_error(errors[0])
        # Nothing reached Python on the server: handshake refusals are not counted there.
        assert served.refusals("Whoami", "no_certificate") is None


async def test_client_refuses_a_server_from_another_ca(pki: Pki) -> None:
    registry = new_registry()
    counter = TlsFailureCounter(registry, component="client")
    async with serving(pki.kit("cpm", other_ca=True)) as served:
        channel = secure(
            served,
            channel_credentials(pki.kit("a1")),
            interceptors=[TlsFailureInterceptor(counter)],
        )
        async with channel:
            with refused(grpc.StatusCode.UNAVAILABLE) as errors:
                await whoami(channel)
    assert "do not trust the server's certificate" in describe_rpc_error(errors[0])
    assert (
        registry.get_sample_value(
            "peerlm_grpc_client_tls_failures_total",
            {"component": "client", "reason": "untrusted_server"},
        )
        == 1.0
    )


# -- insecure-dev ---------------------------------------------------------------------------


class _NullLogger:
    def info(self, event: str, /, **kw: Any) -> None:
        pass

    def warning(self, event: str, /, **kw: Any) -> None:
        pass


async def test_insecure_dev_on_loopback_uses_the_metadata_identity() -> None:
    mode = resolve_security(
        insecure_dev=True, listen_host="127.0.0.1", tls=None, component="test", logger=_NullLogger()
    )
    async with serving(None, mode=mode) as served:
        async with grpc.aio.insecure_channel(served.target) as channel:
            me = PeerIdentity(FEDERATION, Role.AGENT, "dev1")
            assert await whoami(channel, metadata=dev_identity_metadata(me)) == me.spiffe_uri
            stream = channel.unary_stream(method("Count"))(
                b"2", timeout=TIMEOUT, metadata=dev_identity_metadata(me)
            )
            assert [m async for m in stream] == [b"0:dev1", b"1:dev1"]
            with refused(grpc.StatusCode.UNAUTHENTICATED) as errors:
                await whoami(channel)
            assert "peerlm-dev-identity" in (errors[0].details() or "")
            with refused(grpc.StatusCode.UNAUTHENTICATED):
                await whoami(channel, metadata=(("peerlm-dev-identity", "spiffe://acme/x"),))
        assert served.refusals("Whoami", "no_dev_identity") == 1.0
        assert served.refusals("Whoami", "bad_identity") == 1.0


def test_resolve_security_refuses_unsafe_setups(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SecurityConfigError, match="loopback"):
        resolve_security(
            insecure_dev=True, listen_host="0.0.0.0", tls=None, component="t", logger=_NullLogger()
        )
    kit = pki.kit("a1")
    keyless = TlsFiles(ca_cert=kit.ca_cert, cert=kit.cert, key=tmp_path / "missing.key")
    with pytest.raises(SecurityConfigError, match=r"missing\.key"):
        resolve_security(
            insecure_dev=False,
            listen_host="0.0.0.0",
            tls=keyless,
            component="t",
            logger=_NullLogger(),
        )


async def test_mtls_interceptor_on_a_plaintext_port_refuses_everyone() -> None:
    """A mis-wired server (mTLS policy, plaintext port) fails closed, not open."""
    async with serving(None, mode=SecurityMode.MTLS) as served:
        async with grpc.aio.insecure_channel(served.target) as channel:
            claim = dev_identity_metadata(PeerIdentity(FEDERATION, Role.AGENT, "a1"))
            with refused(grpc.StatusCode.UNAUTHENTICATED):
                await whoami(channel, metadata=claim)
        assert served.refusals("Whoami", "no_certificate") == 1.0
