"""The delivery pool against real overlay nodes in this process (mTLS on loopback).

A receiving node is a full :class:`OverlayRuntime` (server, host, core); the sender is a
:class:`PeerPool` with its own certificate. Protocol messages the receiver's core does not
expect (a heartbeat from a stranger) are fine here: what is checked is that they arrive,
are retried, dropped and counted as the delivery policy says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from peerlm.overlay import OverlaySettings
from peerlm.overlay import messages as m
from peerlm.overlay.main import OverlayRuntime
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.transport import DeliveryPolicy, PeerPool
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits, load_settings
from peerlm.metrics import new_registry
from peerlm.rpc import create_channel
from peerlm.security.credentials import channel_credentials
from peerlm.security.mode import SecurityConfigError
from tests.overlay_process_harness import FEDERATION, OverlayPki, free_port

pytestmark = pytest.mark.integration

LOG = structlog.get_logger("test")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> OverlayPki:
    return OverlayPki.create(tmp_path_factory.mktemp("pki"), ["a", "b", "c"])


def _settings(pki: OverlayPki, who: str, port: int = 0, **extra: Any) -> OverlaySettings:
    tls = pki.tls(who)
    overrides: dict[str, Any] = {
        "federation": FEDERATION,
        "listen": f"127.0.0.1:{port}",
        "tls.ca_cert": tls.ca_cert,
        "tls.cert": tls.cert,
        "tls.key": tls.key,
        "leave_grace_s": 0.2,
        "protocol.epoch_period": 3600.0,
        "protocol.genesis_time": time.time() + 3000,
    }
    overrides.update(extra)
    return load_settings(OverlaySettings, None, overrides)


async def _node(pki: OverlayPki, name: str, port: int = 0) -> OverlayRuntime:
    runtime = await OverlayRuntime.create(_settings(pki, name, port), LOG)
    await runtime.enter(asyncio.Event())
    return runtime


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    total = 0.0
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class Sender:
    """A PeerPool speaking as ``a``, with its own metrics."""

    def __init__(self, pki: OverlayPki, policy: DeliveryPolicy) -> None:
        self.registry = new_registry()
        self.metrics = OverlayMetrics(self.registry)
        creds = channel_credentials(pki.tls("a"))
        self.pool = PeerPool(
            "a",
            lambda target: create_channel(target, GrpcLimits(), creds),
            policy,
            self.metrics,
            LOG,
        )

    def sent(self) -> float:
        return _sample(self.registry, "peerlm_overlay_messages_sent_total")

    def dropped(self, reason: str) -> float:
        return _sample(self.registry, "peerlm_overlay_messages_dropped_total", reason=reason)


@pytest.fixture
async def receiver(pki: OverlayPki) -> AsyncIterator[OverlayRuntime]:
    runtime = await _node(pki, "b")
    yield runtime
    await runtime.close()


def _received(runtime: OverlayRuntime) -> float:
    return _sample(runtime.registry, "peerlm_overlay_messages_received_total", kind="HEARTBEAT")


async def _until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_messages_are_delivered_in_batches(pki: OverlayPki, receiver: OverlayRuntime) -> None:
    sender = Sender(pki, DeliveryPolicy(max_batch=4))
    target = f"127.0.0.1:{receiver.port}"
    for i in range(10):
        sender.pool.send("b", target, m.Heartbeat(0, f"c{i}"))
    await sender.pool.flush(20)
    assert sender.sent() == 10
    await _until(lambda: _received(receiver) == 10)
    calls = _sample(
        receiver.registry,
        "peerlm_grpc_server_requests_total",
        method="/peerlm.v1.Overlay/Deliver",
        code="OK",
    )
    assert 3 <= calls <= 10  # batches of at most 4
    await sender.pool.close()


async def test_byte_budget_splits_batches(pki: OverlayPki, receiver: OverlayRuntime) -> None:
    sender = Sender(pki, DeliveryPolicy(max_batch=64, max_batch_bytes=200))
    target = f"127.0.0.1:{receiver.port}"
    for i in range(6):
        sender.pool.send("b", target, m.Heartbeat(0, "x" * 60 + str(i)))
    sender.pool.send("b", target, m.Heartbeat(0, "y" * 250))  # alone over the budget
    await sender.pool.flush(20)
    assert sender.sent() == 6
    assert sender.dropped("oversized") == 1
    await sender.pool.close()


async def test_a_late_node_gets_its_messages_after_retries(pki: OverlayPki) -> None:
    port = free_port()
    sender = Sender(pki, DeliveryPolicy(retries=8, backoff_s=0.1, timeout_s=1.0))
    sender.pool.send("c", f"127.0.0.1:{port}", m.Heartbeat(0, "early"))
    await _until(lambda: _sample(sender.registry, "peerlm_overlay_delivery_retries_total") >= 1)
    late = await _node(pki, "c", port)
    try:
        await sender.pool.flush(30)
        assert sender.sent() == 1
        assert _received(late) == 1
    finally:
        await late.close()
        await sender.pool.close()


async def test_an_unreachable_node_costs_bounded_retries_then_drops(pki: OverlayPki) -> None:
    sender = Sender(pki, DeliveryPolicy(retries=2, backoff_s=0.01, queue_depth=3))
    target = f"127.0.0.1:{free_port()}"
    for i in range(5):
        sender.pool.send("c", target, m.Heartbeat(0, f"c{i}"))
    assert sender.dropped("queue_full") == 2
    await sender.pool.flush(30)
    assert sender.dropped("unavailable") == 3
    assert sender.pool.queued == 0
    assert _sample(sender.registry, "peerlm_overlay_delivery_retries_total") >= 2
    await sender.pool.close()


async def test_stale_messages_are_not_sent_late(pki: OverlayPki) -> None:
    sender = Sender(pki, DeliveryPolicy(retries=3, backoff_s=0.3, max_age_s=0.1))
    target = f"127.0.0.1:{free_port()}"
    sender.pool.send("c", target, m.Heartbeat(0, "first"))
    # The worker is now busy retrying the first; the second waits past its age limit.
    await _until(lambda: _sample(sender.registry, "peerlm_overlay_delivery_retries_total") >= 1)
    sender.pool.send("c", target, m.Heartbeat(0, "second"))
    await sender.pool.flush(30)
    assert sender.dropped("stale") == 1
    assert sender.dropped("unavailable") == 1
    await sender.pool.close()


async def test_a_batch_for_another_node_is_refused_and_counted(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    sender = Sender(pki, DeliveryPolicy())
    sender.pool.send("c", f"127.0.0.1:{receiver.port}", m.Heartbeat(0, "x"))  # b listens there
    await sender.pool.flush(20)
    assert sender.dropped("failed_precondition") == 1
    refused = _sample(
        receiver.registry,
        "peerlm_overlay_rejected_messages_total",
        stage="transport",
        reason="wrong_recipient",
    )
    assert refused == 1
    assert _received(receiver) == 0
    await sender.pool.close()


async def test_a_moved_node_is_dialled_at_its_new_address(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    sender = Sender(pki, DeliveryPolicy(retries=20, backoff_s=0.2))
    sender.pool.send("b", f"127.0.0.1:{free_port()}", m.Heartbeat(0, "old-address"))
    await _until(lambda: _sample(sender.registry, "peerlm_overlay_delivery_retries_total") >= 1)
    sender.pool.send("b", f"127.0.0.1:{receiver.port}", m.Heartbeat(0, "new-address"))
    await sender.pool.flush(20)
    await _until(lambda: _received(receiver) >= 1)
    assert sender.pool.size == 1
    await sender.pool.close()


async def test_the_pool_keeps_at_most_max_peers_channels(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    sender = Sender(pki, DeliveryPolicy(max_peers=1))
    target = f"127.0.0.1:{receiver.port}"
    sender.pool.send("b", target, m.Heartbeat(0, "one"))
    await sender.pool.flush(20)
    sender.pool.send("c", f"127.0.0.1:{free_port()}", m.Heartbeat(0, "two"))
    assert sender.pool.size == 1
    await sender.pool.close()
    assert sender.sent() == 1


async def test_describe_and_ping_through_the_runtime(
    pki: OverlayPki, receiver: OverlayRuntime
) -> None:
    from peerlm.wire.v1 import overlay_pb2

    ch, stub = pki.stub(f"127.0.0.1:{receiver.port}", "a")
    desc = await stub.Describe(overlay_pb2.DescribeRequest(), timeout=10)
    assert desc.node_id == "b" and desc.address == f"127.0.0.1:{receiver.port}"
    assert desc.role == "unplaced" and not desc.has_signature
    pong = await stub.Ping(overlay_pb2.PingRequest(sent_unix_nanos=7), timeout=10)
    assert pong.sent_unix_nanos == 7 and pong.responder.name == "b"
    await ch.close(None)


async def test_start_refuses_a_name_that_is_not_the_certificate(pki: OverlayPki) -> None:
    with pytest.raises(SecurityConfigError, match="differs from the certificate"):
        await OverlayRuntime.create(_settings(pki, "b", name="c"), LOG)


async def test_start_refuses_another_nodes_vrf_key(pki: OverlayPki) -> None:
    settings = _settings(pki, "b", vrf_key=pki.root / "c.vrf.key")
    with pytest.raises(SecurityConfigError, match="does not match the VRF public key"):
        await OverlayRuntime.create(settings, LOG)


async def test_start_refuses_a_bad_signature_file(pki: OverlayPki, tmp_path: Path) -> None:
    bad = tmp_path / "sig.bin"
    bad.write_bytes(b"PSIG not really")
    with pytest.raises(ValueError, match="not a valid signature"):
        await OverlayRuntime.create(_settings(pki, "b", signature_file=bad), LOG)
