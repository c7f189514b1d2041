"""On every gRPC server: health Watch through the interceptors, request
bytes parsed only after authorisation (garbage refused, counted, logged at a bounded rate),
and one process per listening address (gRPC and metrics ports)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from peerlm.config import GrpcLimits
from peerlm.metrics import MetricsPortError, new_registry, serve_metrics
from peerlm.pki.identity import Role
from peerlm.rpc import (
    MAX_STATUS_DETAILS,
    MetricsInterceptor,
    add_health_and_reflection,
    create_channel,
    create_server,
    set_serving,
)
from peerlm.security.authz import DEV_IDENTITY_METADATA_KEY, AuthInterceptor
from peerlm.security.mode import SecurityMode

ADMIN = "spiffe://acme/admin/ops"
AGENT = "spiffe://acme/agent/a1"
ECHO = "/t.T/Echo"
UPLOAD = "/t.T/Upload"
FEED = "/t.T/Feed"
REFUSE = "/t.T/Refuse"


@dataclass
class Parser:
    """A protobuf parser that remembers how often it ran."""

    calls: int = 0

    def __call__(self, raw: bytes) -> health_pb2.HealthCheckRequest:
        self.calls += 1
        return health_pb2.HealthCheckRequest.FromString(raw)


@dataclass
class Served:
    channel: grpc.aio.Channel
    registry: CollectorRegistry
    parser: Parser
    health: Any
    port: int
    seen: list[str] = field(default_factory=list)

    def counter(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {"component": "test", **labels})
        return value or 0.0


async def _serve(with_auth: bool) -> tuple[grpc.aio.Server, Served]:
    registry = new_registry()
    parser = Parser()
    seen: list[str] = []

    async def echo(request: health_pb2.HealthCheckRequest, context: Any) -> bytes:
        seen.append(request.service)
        return request.service.encode()

    async def upload(requests: AsyncIterator[health_pb2.HealthCheckRequest], context: Any) -> bytes:
        names = [r.service async for r in requests]
        seen.extend(names)
        return ",".join(names).encode()

    async def feed(request: health_pb2.HealthCheckRequest, context: Any) -> AsyncIterator[bytes]:
        seen.append(request.service)
        yield request.service.encode()

    async def refuse(request: health_pb2.HealthCheckRequest, context: Any) -> bytes:
        # Echoes the caller's text into the status, as a careless handler would.
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no service {request.service!r}")
        raise AssertionError("unreachable")

    interceptors: list[Any] = [MetricsInterceptor(registry, "test")]
    if with_auth:
        policy = {m: frozenset({Role.ADMIN}) for m in (ECHO, UPLOAD, FEED, REFUSE)}
        interceptors.append(
            AuthInterceptor(
                policy,
                federation="acme",
                mode=SecurityMode.INSECURE_DEV,
                registry=registry,
                component="test",
            )
        )
    server = create_server(GrpcLimits(), interceptors)
    handler = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parser),
            "Upload": grpc.stream_unary_rpc_method_handler(upload, request_deserializer=parser),
            "Feed": grpc.unary_stream_rpc_method_handler(feed, request_deserializer=parser),
            "Refuse": grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=parser),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    health = add_health_and_reflection(server, ["t.T"])
    # Plaintext loopback, as the insecure-dev mode the AuthInterceptor runs in here allows.
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await set_serving(health, ["t.T"], True)
    channel = create_channel(f"127.0.0.1:{port}", GrpcLimits(), None)
    return server, Served(channel, registry, parser, health, port, seen)


@pytest.fixture(params=[True, False], ids=["metrics+auth", "metrics-only"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    server, state = await _serve(with_auth=request.param)
    try:
        yield state
    finally:
        await state.channel.close()
        await server.stop(None)


@pytest.fixture
async def guarded() -> AsyncIterator[Served]:
    server, state = await _serve(with_auth=True)
    try:
        yield state
    finally:
        await state.channel.close()
        await server.stop(None)


def _as(identity: str) -> tuple[tuple[str, str], ...]:
    return ((DEV_IDENTITY_METADATA_KEY, identity),)


async def test_health_watch_streams_status_changes_through_the_interceptors(
    served: Served,
) -> None:
    stub = health_pb2_grpc.HealthStub(served.channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service="t.T"), metadata=_as(ADMIN))
    first = await asyncio.wait_for(call.read(), 10)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    await set_serving(served.health, ["t.T"], False)
    second = await asyncio.wait_for(call.read(), 10)
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    call.cancel()
    # A plain check still works alongside, and the watch was counted when it ended.
    check = await stub.Check(health_pb2.HealthCheckRequest(service=""), metadata=_as(ADMIN))
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch = "/grpc.health.v1.Health/Watch"
    await _eventually(
        lambda: (
            served.counter("peerlm_grpc_server_requests_total", method=watch, code="CANCELLED") == 1
        )
    )


async def _eventually(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.05)
    assert condition()


GARBAGE = b"\xff\xff\xff\xff"  # a field tag with no end: no protobuf parser accepts it


async def test_every_call_kind_parses_valid_requests(served: Served) -> None:
    valid = health_pb2.HealthCheckRequest(service="s").SerializeToString()
    md = _as(ADMIN)
    assert await served.channel.unary_unary(ECHO)(valid, metadata=md) == b"s"
    assert await served.channel.stream_unary(UPLOAD)(iter([valid, valid]), metadata=md) == b"s,s"
    assert [r async for r in served.channel.unary_stream(FEED)(valid, metadata=md)] == [b"s"]
    assert served.seen == ["s", "s", "s", "s"]


@pytest.mark.parametrize("method", [ECHO, UPLOAD, FEED])
async def test_garbage_from_an_unauthorised_caller_is_never_parsed(
    guarded: Served, method: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(guarded.channel, method, GARBAGE, _as(AGENT))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert guarded.parser.calls == 0
    assert guarded.counter("peerlm_grpc_server_malformed_messages_total", method=method) == 0


@pytest.mark.parametrize("method", [ECHO, UPLOAD, FEED])
async def test_garbage_from_an_authorised_caller_is_refused_counted_and_logged_once(
    served: Served, method: str
) -> None:
    with capture_logs() as logs:
        for _ in range(5):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _call(served.channel, method, GARBAGE, _as(ADMIN))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not parse" in (err.value.details() or "")
    assert served.seen == []  # the handler never ran
    assert served.counter("peerlm_grpc_server_malformed_messages_total", method=method) == 5
    # The status reaches the client just before the server records the call.
    await _eventually(
        lambda: (
            served.counter(
                "peerlm_grpc_server_requests_total", method=method, code="INVALID_ARGUMENT"
            )
            == 5
        )
    )
    lines = [e for e in logs if e.get("event") == "malformed_request"]
    assert len(lines) == 1 and lines[0]["method"] == method
    # The server still answers valid requests.
    valid = health_pb2.HealthCheckRequest(service="ok").SerializeToString()
    await _call(served.channel, method, valid, _as(ADMIN))
    assert served.seen == ["ok"]


async def _call(
    channel: grpc.aio.Channel, method: str, payload: bytes, md: tuple[tuple[str, str], ...]
) -> Any:
    if method == UPLOAD:
        return await channel.stream_unary(method)(iter([payload]), metadata=md)
    if method == FEED:
        return [r async for r in channel.unary_stream(method)(payload, metadata=md)]
    call: Callable[..., Any] = channel.unary_unary(method)
    return await call(payload, metadata=md)


@pytest.mark.parametrize("text", ["x" * 200_000, "\u00e9\U0001f600" * 20_000])
async def test_status_details_are_bounded_whatever_the_handler_echoes(
    served: Served, text: str
) -> None:
    """A handler that echoes the caller's text into its status must not turn the refusal
    into a transport error: gRPC's 8 KiB metadata limit would make the client see
    RESOURCE_EXHAUSTED "received metadata size exceeds limit" instead of the real code.
    Found by tests/security/test_rpc_fuzz.py (an overlay Deliver with a 256 KB recipient)."""
    request = health_pb2.HealthCheckRequest(service=text).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(served.channel, REFUSE, request, _as(ADMIN))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details() or ""
    assert details.startswith("no service 'xxx") or details.startswith("no service '\u00e9")
    assert len(details) <= MAX_STATUS_DETAILS and details.endswith("[truncated]")


async def test_a_second_server_on_a_bound_address_fails_naming_the_address() -> None:
    first = create_server(GrpcLimits())
    port = first.add_insecure_port("127.0.0.1:0")
    await first.start()
    second = create_server(GrpcLimits())
    try:
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            second.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        await second.stop(None)
        await first.stop(None)


def test_a_metrics_port_clash_names_the_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"127.0.0.1:{port}"):
            serve_metrics(new_registry(), "127.0.0.1", port)
