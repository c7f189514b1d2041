"""Overlay: one member flooding Deliver is limited per sender while another
member's messages are still accepted, and an address claimed for a node is dialled only
when the server there holds that node's certificate (real overlay node, mTLS on loopback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import structlog
from peerlm.overlay import OverlaySettings, codec
from peerlm.overlay import messages as m
from peerlm.overlay.dialcheck import CertifiedAddressVerifier
from peerlm.overlay.main import OverlayRuntime
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.ratelimit import SenderBuckets
from peerlm.overlay.transport import DeliveryPolicy, PeerPool
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits, load_settings
from peerlm.metrics import new_registry
from peerlm.rpc import create_channel
from peerlm.security.credentials import channel_credentials
from peerlm.wire.v1 import overlay_pb2_grpc
from tests.overlay_process_harness import FEDERATION, OverlayPki, free_port

pytestmark = pytest.mark.integration

LOG = structlog.get_logger("test")
BURST = 20
BATCH = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> OverlayPki:
    return OverlayPki.create(tmp_path_factory.mktemp("pki"), ["a", "b", "c"])


@pytest.fixture
async def receiver(pki: OverlayPki) -> AsyncIterator[OverlayRuntime]:
    tls = pki.tls("b")
    overrides: dict[str, Any] = {
        "federation": FEDERATION,
        "listen": "127.0.0.1:0",
        "tls.ca_cert": tls.ca_cert,
        "tls.cert": tls.cert,
        "tls.key": tls.key,
        "leave_grace_s": 0.2,
        "protocol.epoch_period": 3600.0,
        "protocol.genesis_time": time.time() + 3000,
        # One token a second: the test's few seconds cannot refill a batch of ten.
        "protocol.deliver_rate": 0.1,
        "protocol.deliver_burst": float(BURST),
    }
    runtime = await OverlayRuntime.create(load_settings(OverlaySettings, None, overrides), LOG)
    await runtime.enter(asyncio.Event())
    yield runtime
    await runtime.close()


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    total = 0.0
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def _deliver(pki: OverlayPki, who: str, port: int, batches: int) -> list[grpc.StatusCode]:
    channel = create_channel(f"127.0.0.1:{port}", GrpcLimits(), channel_credentials(pki.tls(who)))
    stub = overlay_pb2_grpc.OverlayStub(channel)  # type: ignore[no-untyped-call]
    codes = []
    try:
        for i in range(batches):
            env = codec.encode_batch(
                "b", [m.Heartbeat(0, f"{who}{i}.{j}") for j in range(BATCH)], sender=who
            )
            try:
                await stub.Deliver(env, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.append(err.code())
    finally:
        await channel.close()
    return codes


async def test_a_flooding_member_is_limited_while_another_is_served(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    flood = await _deliver(pki, "a", receiver.port, batches=12)
    accepted = flood.count(grpc.StatusCode.OK)
    refused = flood.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert accepted == BURST // BATCH and refused == len(flood) - accepted
    limited = _sample(
        receiver.registry,
        "peerlm_overlay_rejected_messages_total",
        stage="transport",
        reason="rate_limited",
    )
    assert limited == refused
    # Another member has its own bucket: served in full.
    assert await _deliver(pki, "c", receiver.port, batches=2) == [grpc.StatusCode.OK] * 2
    received = _sample(
        receiver.registry, "peerlm_overlay_messages_received_total", kind="HEARTBEAT"
    )
    assert received == (accepted + 2) * BATCH


def test_buckets_refill_at_the_rate_and_forget_the_oldest_sender() -> None:
    now = [0.0]
    buckets = SenderBuckets(rate=10, burst=5, max_senders=2, clock=lambda: now[0])
    assert buckets.take("a", 5) and not buckets.take("a", 1)
    now[0] = 0.3  # three tokens back
    assert not buckets.take("a", 4) and buckets.take("a", 3)
    assert buckets.take("b", 5) and buckets.take("c", 5)  # "a" is forgotten: full again
    assert buckets.take("a", 5)
    with pytest.raises(ValueError):
        SenderBuckets(rate=0, burst=5)


class Pool:
    """A PeerPool speaking as ``a`` that checks every address before dialling it."""

    def __init__(self, pki: OverlayPki) -> None:
        self.registry = new_registry()
        creds = channel_credentials(pki.tls("a"))
        self.pool = PeerPool(
            "a",
            lambda target: create_channel(target, GrpcLimits(), creds),
            DeliveryPolicy(retries=1, backoff_s=0.05),
            OverlayMetrics(self.registry),
            LOG,
            verify_address=CertifiedAddressVerifier(pki.tls("a"), FEDERATION),
        )

    def dropped(self, reason: str) -> float:
        return _sample(self.registry, "peerlm_overlay_messages_dropped_total", reason=reason)


async def test_an_address_not_bound_to_the_named_node_is_never_dialled(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    sender = Pool(pki)
    at_b = f"127.0.0.1:{receiver.port}"
    # A peer-exchange claim "c is at b's address": b's certificate does not name c.
    sender.pool.send("c", at_b, m.Heartbeat(0, "fake"))
    await sender.pool.flush(20)
    assert sender.dropped("unverified_address") == 1
    assert sender.pool.size == 0
    # A claim for an address where nothing listens is not certified either.
    sender.pool.send("d", f"127.0.0.1:{free_port()}", m.Heartbeat(0, "nobody"))
    await sender.pool.flush(20)
    assert sender.dropped("unavailable") == 1
    calls = _sample(
        receiver.registry, "peerlm_grpc_server_requests_total", method="/peerlm.v1.Overlay/Deliver"
    )
    assert calls == 0  # nothing was delivered to b on c's behalf
    # The true claim is certified and delivered.
    sender.pool.send("b", at_b, m.Heartbeat(0, "real"))
    await sender.pool.flush(20)
    assert _sample(sender.registry, "peerlm_overlay_messages_sent_total") == 1
    received = _sample(
        receiver.registry, "peerlm_overlay_messages_received_total", kind="HEARTBEAT"
    )
    assert received == 1
    await sender.pool.close()
