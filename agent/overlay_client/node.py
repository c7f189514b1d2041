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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from peerlm.agent.peer.service import PEER_POLICY, PEER_SERVICE_NAME, PeerExchangeService
from peerlm.agent.settings import AgentSettings
from peerlm.overlay import (
    OVERLAY_POLICY,
    DeliveryPolicy,
    NodeRef,
    OverlayHost,
    OverlayHostConfig,
    build_overlay_host,
    certified_vrf_secret,
    describe_bootstrap,
    name_seed,
    parse_bootstrap,
)
from peerlm.overlay import OVERLAY_SERVICE_NAME as SERVICE_NAME

from peerlm.config import parse_host_port
from peerlm.node import NodeContext, NodeServer, Service
from peerlm.pki.ca import vrf_key_path
from peerlm.pki.identity import Role
from peerlm.security.mode import SecurityConfigError, SecurityMode
from peerlm.wire.v1 import peer_pb2_grpc

__all__ = ["AgentOverlay", "serve_agent"]


@dataclass
class AgentOverlay:
    """The overlay side of an agent: its node host, bootstrap and shutdown."""

    host: OverlayHost
    server: NodeServer
    settings: AgentSettings
    ctx: NodeContext
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
            self.ctx,
            timeout=self.settings.overlay.bootstrap_retry_s * 2,
            own_id=self.host.node_id,
            stop=stop,
        )
        if entries and not refs:
            return False
        self.host.join(refs)
        self.bootstrap, self.joined = tuple(refs), True
        self.ctx.log.info("overlay_joined", bootstrap=[f"{r.node_id}@{r.address}" for r in refs])
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
        await self.server.serving(False, [SERVICE_NAME])
        await self.host.stop(self.settings.overlay.leave_grace_s)


def peer_exchange(service: PeerExchangeService) -> Service:
    """The peer-exchange servicer as a :class:`~peerlm.node.Service` to serve."""
    return Service(PEER_SERVICE_NAME, service, peer_pb2_grpc.add_PeerExchangeServicer_to_server)


async def serve_agent(
    ctx: NodeContext,
    service: PeerExchangeService,
    settings: AgentSettings,
    extra: Sequence[tuple[Service, Mapping[str, frozenset[Role]]]] = (),
) -> tuple[NodeServer, AgentOverlay]:
    """Build, bind and start the agent's server with peer exchange *and* the overlay (and
    ``extra`` services, each with its policy: FedWave's and FedProxy's exchanges).

    Returns the server (bound port in ``.port``) and the :class:`AgentOverlay` (host
    started, not joined yet: call :meth:`AgentOverlay.join`).
    """
    if ctx.mode is not SecurityMode.MTLS or ctx.tls is None:
        raise SecurityConfigError(
            "agent overlay: needs mTLS (certified VRF keys); it cannot run in insecure-dev"
        )
    identity = ctx.identity
    if identity.role.value != "agent":
        raise SecurityConfigError(f"agent overlay: certificate role is {identity.role.value!r}")
    path = vrf_key_path(ctx.tls.cert.parent, ctx.tls.cert.stem)
    secret = certified_vrf_secret(path, identity, who="agent overlay", require_certified=True)
    params = settings.overlay.protocol  # validated by OverlayParams when settings loaded
    listen_host, _ = parse_host_port(settings.listen)
    # One policy for both services (per method, no method name shared).
    policy = {**PEER_POLICY, **OVERLAY_POLICY}
    for _, more in extra:
        policy.update(more)
    server = ctx.bind(policy, listen=settings.listen)
    address = settings.advertise or f"{listen_host}:{server.port}"
    stack = build_overlay_host(
        ctx,
        OverlayHostConfig(
            address=address,
            params=params,
            secret=secret,
            seed=name_seed(identity.name) ^ settings.seed,
            delivery=DeliveryPolicy(
                max_batch_bytes=max(64 * 1024, settings.limits.max_message_bytes - 64 * 1024)
            ),
        ),
    )
    server.add(peer_exchange(service))
    server.add(stack.service)
    for svc, _ in extra:
        server.add(svc)
    await server.start()
    await stack.start()
    await server.serving(True)
    ctx.log.info(
        "peer_server_started",
        listen=f"{listen_host}:{server.port}",
        security_mode=ctx.mode.value,
        overlay=True,
        overlay_address=address,
    )
    return server, AgentOverlay(host=stack.host, server=server, settings=settings, ctx=ctx)
