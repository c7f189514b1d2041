"""MetricsInterceptor refuses and counts request messages above max_message_bytes, for
unary and streamed requests, before any handler parses them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits
from peerlm.rpc import MetricsInterceptor, create_channel, create_server

LIMIT = 64 * 1024


async def _echo(request: bytes, context: Any) -> bytes:
    return request[:8]


async def _upload(requests: AsyncIterator[bytes], context: Any) -> bytes:
    total = 0
    async for part in requests:
        total += len(part)
    return str(total).encode()


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Channel, CollectorRegistry]]:
    registry = CollectorRegistry()
    limits = GrpcLimits(max_message_bytes=LIMIT)
    server = create_server(limits, [MetricsInterceptor(registry, "test", limits)])
    handler = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Upload": grpc.stream_unary_rpc_method_handler(_upload),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")  # a unit test of the interceptor only
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}", GrpcLimits(max_message_bytes=LIMIT * 8), None)
    try:
        yield channel, registry
    finally:
        await channel.close()
        await server.stop(None)


def _oversized(registry: CollectorRegistry, method: str) -> float:
    value = registry.get_sample_value(
        "peerlm_grpc_server_oversized_messages_total", {"component": "test", "method": method}
    )
    return value or 0.0


async def test_unary_requests_above_the_limit_are_refused_and_counted(
    served: tuple[grpc.aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = served
    echo = channel.unary_unary("/t.T/Echo")
    assert await echo(b"x" * LIMIT) == b"x" * 8  # at the limit: served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await echo(b"x" * (LIMIT + 1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{LIMIT + 1} bytes exceeds the limit of {LIMIT}" in (err.value.details() or "")
    assert _oversized(registry, "/t.T/Echo") == 1
    # The status reaches the client just before the server's interceptor records the call.
    for _ in range(200):
        code = registry.get_sample_value(
            "peerlm_grpc_server_requests_total",
            {"component": "test", "method": "/t.T/Echo", "code": "RESOURCE_EXHAUSTED"},
        )
        if code == 1:
            break
        await asyncio.sleep(0.05)
    assert code == 1


async def test_an_oversized_message_in_a_request_stream_ends_the_call(
    served: tuple[grpc.aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = served
    upload = channel.stream_unary("/t.T/Upload")
    assert await upload(iter([b"a" * 10, b"b" * LIMIT])) == str(10 + LIMIT).encode()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await upload(iter([b"a" * 10, b"b" * (2 * LIMIT), b"c"]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _oversized(registry, "/t.T/Upload") == 1
