"""The agent as an overlay node: one gRPC server for peer exchange and the overlay.

"Every agent is an overlay node" (DESIGN.md): with ``overlay.enabled`` the agent's
peer-exchange server also serves ``peerlm.v1.Overlay``, under one certificate and one port.
That is a deliberate choice over a second port: an overlay search answers
``(node id, address, similarity)``, and with one server that address is exactly where the
neighbour's ``PeerExchange.PullAdapter`` is, so no second directory maps overlay addresses
to peer-exchange addresses. The authorisation policy is the union of the two services'
(both are per method, and no method name is shared).

The node's VRF key is the ``<name>.vrf.key`` issued with the agent's certificate; it must
match the key the certificate certifies (as for ``peerlm overlay-node``). The overlay needs
mTLS: in the insecure-dev mode there are no certified VRF keys, so enabling the overlay
there is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from peerlm.agent.peer_service import PEER_POLICY, PEER_SERVICE_NAME, PeerExchangeService
from peerlm.overlay.codec import CodecLimits
from peerlm.overlay.main import certified_vrf_secret, describe_bootstrap, parse_bootstrap
from peerlm.overlay.messages import NodeRef
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.service import OVERLAY_POLICY, SERVICE_NAME, OverlayService
from peerlm.overlay.transport import (
    DeliveryPolicy,
    KeyDirectory,
    OverlayClock,
    OverlayHost,
    PeerPool,
)
from prometheus_client import CollectorRegistry

from peerlm.config import AgentSettings, parse_host_port
from peerlm.pki.ca import vrf_key_path
from peerlm.pki.identity import PeerIdentity
from peerlm.rpc import (
    MetricsInterceptor,
    add_health_and_reflection,
    create_channel,
    create_server,
    set_serving,
)
from peerlm.security.authz import AuthInterceptor, TlsFailureCounter
from peerlm.security.credentials import TlsFiles, bind_server, channel_credentials
from peerlm.security.mode import SecurityConfigError, SecurityMode
from peerlm.wire.v1 import overlay_pb2_grpc, peer_pb2_grpc

__all__ = ["AgentOverlay", "serve_agent"]


@dataclass
class AgentOverlay:
    """The overlay side of an agent: its node host, bootstrap and shutdown."""

    host: OverlayHost
    health: Any
    settings: AgentSettings
    dial: Any
    log: Any
    bootstrap: tuple[NodeRef, ...] = ()
    joined: bool = False

    async def join(self, stop: asyncio.Event) -> bool:
        """Resolve the bootstrap nodes (``Describe``) and join through those that answer.

        Tries each address once per call; returns whether the node joined. With no
        bootstrap entries this agent is the first node and counts as joined.
        """
        if self.joined:
            return True
        entries = parse_bootstrap(self.settings.overlay.bootstrap, self.host.address)
        refs, _ = await describe_bootstrap(
            entries,
            self.dial,
            timeout=self.settings.overlay.bootstrap_retry_s * 2,
            log=self.log,
            own_id=self.host.node_id,
            stop=stop,
        )
        if entries and not refs:
            return False
        self.host.join(refs)
        self.bootstrap, self.joined = tuple(refs), True
        self.log.info("overlay_joined", bootstrap=[f"{r.node_id}@{r.address}" for r in refs])
        return True

    async def wait_ready(self, stop: asyncio.Event, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the node can search (the epoch's root is known).

        Polls the core's description: readiness has no single event (a build, a top-down
        join and a take-over all make a node ready), and a quarter second is far below a
        round's length.
        """
        deadline = time.monotonic() + timeout
        while not self.host.describe().get("ready"):
            if stop.is_set() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        return True

    async def close(self) -> None:
        """Leave the overlay gracefully (the server is stopped by the daemon)."""
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.host.stop(self.settings.overlay.leave_grace_s)


def _vrf_secret(identity: PeerIdentity, tls: TlsFiles) -> bytes:
    path = vrf_key_path(tls.cert.parent, tls.cert.stem)
    return certified_vrf_secret(path, identity, who="agent overlay", require_certified=True)


async def serve_agent(
    service: PeerExchangeService,
    *,
    settings: AgentSettings,
    identity: PeerIdentity,
    tls: TlsFiles | None,
    mode: SecurityMode,
    registry: CollectorRegistry,
    log: Any,
) -> tuple[grpc.aio.Server, int, AgentOverlay]:
    """Build, bind and start the agent's server with peer exchange *and* the overlay.

    Returns the server, its bound port and the :class:`AgentOverlay` (host started, not
    joined yet: call :meth:`AgentOverlay.join`).
    """
    if mode is not SecurityMode.MTLS or tls is None:
        raise SecurityConfigError(
            "agent overlay: needs mTLS (certified VRF keys); it cannot run in insecure-dev"
        )
    if identity.role.value != "agent":
        raise SecurityConfigError(f"agent overlay: certificate role is {identity.role.value!r}")
    secret = _vrf_secret(identity, tls)
    try:
        params = OverlayParams(**settings.overlay.protocol.overrides())
    except ValueError as err:
        raise ValueError(f"overlay protocol settings: {err}") from None
    listen_host, _ = parse_host_port(settings.listen)
    server = create_server(
        settings.limits,
        [
            MetricsInterceptor(registry, "agent", settings.limits),
            AuthInterceptor(
                {**PEER_POLICY, **OVERLAY_POLICY},
                federation=settings.federation,
                mode=mode,
                registry=registry,
                component="agent",
            ),
        ],
    )
    peer_pb2_grpc.add_PeerExchangeServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    port = bind_server(server, settings.listen, mode, tls)
    address = settings.advertise or f"{listen_host}:{port}"

    assert identity.vrf_public_key is not None
    bundle = tls.load()
    keys = KeyDirectory(
        federation=settings.federation,
        ca_certificate=x509.load_pem_x509_certificate(bundle.ca_cert),
        own=(identity.name, identity.vrf_public_key, bundle.certificate.public_bytes(Encoding.DER)),
    )
    credentials = channel_credentials(tls)

    def dial(target: str) -> grpc.aio.Channel:
        return create_channel(target, settings.limits, credentials)

    metrics = OverlayMetrics(registry)
    seed = int.from_bytes(hashlib.sha256(identity.name.encode()).digest()[:8], "big")
    node = OverlayNode(
        identity.name, address, params, secret, rng=seed ^ settings.seed, key_resolver=keys.resolve
    )
    policy = DeliveryPolicy(
        max_batch_bytes=max(64 * 1024, settings.limits.max_message_bytes - 64 * 1024)
    )
    pool = PeerPool(
        identity.name,
        dial,
        policy,
        metrics,
        log,
        certificate_for=keys.certificate,
        tls_failures=TlsFailureCounter(registry, "agent"),
    )
    host = OverlayHost(node, pool, metrics, log, clock=OverlayClock())
    limits = CodecLimits.from_params(params)
    overlay_pb2_grpc.add_OverlayServicer_to_server(  # type: ignore[no-untyped-call]
        OverlayService(host, keys, limits, metrics, log), server
    )
    health = add_health_and_reflection(server, [PEER_SERVICE_NAME, SERVICE_NAME])
    await server.start()
    await host.start()
    await set_serving(health, [PEER_SERVICE_NAME, SERVICE_NAME], True)
    log.info(
        "peer_server_started",
        listen=f"{listen_host}:{port}",
        security_mode=mode.value,
        overlay=True,
        overlay_address=address,
    )
    return (
        server,
        port,
        AgentOverlay(host=host, health=health, settings=settings, dial=dial, log=log),
    )
