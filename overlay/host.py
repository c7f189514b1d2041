"""The one builder of a running overlay node: keys, core, delivery pool, host and service.

A dedicated overlay node (``peerlm overlay-node``, :mod:`peerlm.overlay.main`) and an
agent that is an overlay node (:mod:`peerlm.agent.overlay_client.node`) run the same stack::

    KeyDirectory -> OverlayNode -> PeerPool -> OverlayHost -> OverlayService

:func:`build_overlay_host` assembles it from the process's
:class:`~peerlm.node.NodeContext` (identity, certificate, security mode, registry, logger
and the one channel factory) and the few things that differ between the two
(:class:`OverlayHostConfig`). Serving the returned servicer is the caller's: the agent
serves it next to peer exchange on one port. The VRF key check and the bootstrap helpers
both processes use live here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from peerlm.overlay import vrf
from peerlm.overlay.codec import CodecLimits
from peerlm.overlay.dialcheck import CertifiedAddressVerifier
from peerlm.overlay.messages import NodeRef
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.service import SERVICE_NAME, OverlayService
from peerlm.overlay.transport import (
    DeliveryPolicy,
    KeyDirectory,
    OverlayClock,
    OverlayHost,
    PeerPool,
)

from peerlm.node import NodeContext, Service
from peerlm.pki.identity import PeerIdentity, load_vrf_secret
from peerlm.security.authz import describe_rpc_error
from peerlm.security.mode import SecurityConfigError, SecurityMode
from peerlm.wire.v1 import overlay_pb2, overlay_pb2_grpc

__all__ = [
    "OverlayHostConfig",
    "OverlayStack",
    "build_overlay_host",
    "certified_vrf_secret",
    "describe_bootstrap",
    "name_seed",
    "parse_bootstrap",
    "resolve_bootstrap",
]


@dataclass(frozen=True)
class OverlayHostConfig:
    """What differs between overlay nodes of one process kind: where peers reach the node,
    the protocol parameters, the VRF secret, the RNG seed and the delivery and queue bounds.
    """

    address: str
    params: OverlayParams
    secret: bytes
    seed: int
    delivery: DeliveryPolicy = field(default_factory=DeliveryPolicy)
    key_cache: int = 4096
    event_queue_depth: int = 1024
    metrics_interval_s: float = 1.0
    max_receive_batch: int | None = None


@dataclass
class OverlayStack:
    """A built overlay node: its host (started by :meth:`start`), servicer, keys, metrics."""

    host: OverlayHost
    service: Service
    keys: KeyDirectory | None
    metrics: OverlayMetrics

    async def start(self) -> None:
        """Start the host's timer and delivery (the server must already answer calls)."""
        await self.host.start()


def name_seed(name: str) -> int:
    """A node's default RNG seed: stable per name, different across names."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def build_overlay_host(ctx: NodeContext, config: OverlayHostConfig) -> OverlayStack:
    """Assemble the overlay stack of one node on ``ctx`` (not started yet).

    Under mTLS the key directory checks every VRF key against the federation CA, and this
    node's own key must be the one its certificate certifies, and an address a peer names is
    dialled only after the server there showed that node's certificate. In insecure-dev
    there are no certificates, so the core trusts the key in each ticket (logged as a
    warning).
    """
    identity = ctx.identity
    keys: KeyDirectory | None = None
    if ctx.mode is SecurityMode.MTLS:
        assert ctx.tls is not None and identity.vrf_public_key is not None
        bundle = ctx.tls.load()
        keys = KeyDirectory(
            federation=ctx.federation,
            ca_certificate=x509.load_pem_x509_certificate(bundle.ca_cert),
            own=(
                identity.name,
                identity.vrf_public_key,
                bundle.certificate.public_bytes(Encoding.DER),
            ),
            capacity=config.key_cache,
        )
    else:
        ctx.log.warning("overlay_vrf_keys_unverified", reason="insecure-dev has no certificates")
    metrics = OverlayMetrics(ctx.registry)
    node = OverlayNode(
        identity.name,
        config.address,
        config.params,
        config.secret,
        rng=config.seed,
        key_resolver=keys.resolve if keys is not None else None,
    )
    pool = PeerPool(
        identity.name,
        ctx.channel_factory(),
        config.delivery,
        metrics,
        ctx.log,
        certificate_for=keys.certificate if keys is not None else None,
        metadata=ctx.dev_metadata(),
        tls_failures=ctx.tls_failures,
        # Under mTLS an address learnt from a peer is dialled only once the server there has
        # shown the named node's certificate (insecure-dev has no certificates to show).
        verify_address=(
            CertifiedAddressVerifier(ctx.tls, ctx.federation)
            if ctx.mode is SecurityMode.MTLS and ctx.tls is not None
            else None
        ),
    )
    host = OverlayHost(
        node,
        pool,
        metrics,
        ctx.log,
        clock=OverlayClock(),
        event_queue_depth=config.event_queue_depth,
        metrics_interval_s=config.metrics_interval_s,
    )
    batch = {} if config.max_receive_batch is None else {"max_batch": config.max_receive_batch}
    limits = CodecLimits.from_params(config.params, **batch)
    service = OverlayService(host, keys, limits, metrics, ctx.log)
    return OverlayStack(
        host=host,
        service=Service(SERVICE_NAME, service, overlay_pb2_grpc.add_OverlayServicer_to_server),
        keys=keys,
        metrics=metrics,
    )


def certified_vrf_secret(
    path: Path, identity: PeerIdentity, *, who: str, require_certified: bool
) -> bytes:
    """Load the ECVRF secret at ``path`` and check it is the key the certificate certifies.

    ``require_certified``: a certificate without a certified VRF key is refused (always under
    mTLS; insecure-dev has no certificate to check against)."""
    try:
        secret = load_vrf_secret(path)
    except (OSError, ValueError) as err:
        raise SecurityConfigError(f"{who}: {err}") from None
    if identity.vrf_public_key is not None and vrf.public_key(secret) != identity.vrf_public_key:
        raise SecurityConfigError(
            f"{who}: VRF key {path} does not match the VRF public key certified in "
            "the certificate; use the .vrf.key issued together with that certificate"
        )
    if require_certified and identity.vrf_public_key is None:
        raise SecurityConfigError(
            f"{who}: the certificate certifies no VRF key; reissue it with "
            f"`peerlm ca issue --role {identity.role.value}` (it writes <name>.vrf.key)"
        )
    return secret


def parse_bootstrap(
    entries: tuple[str, ...], own_address: str | None = None
) -> list[tuple[str | None, str]]:
    """``name@host:port`` or ``host:port`` entries as ``(name or None, target)``.

    An entry equal to ``own_address`` (the node's advertised address) is dropped: one
    bootstrap list can then serve every node, the first included, which could otherwise
    wait for itself (e.g. a Kubernetes pod whose DNS name resolves only once it is ready).
    """
    out: list[tuple[str | None, str]] = []
    for entry in entries:
        name, _, target = entry.rpartition("@")
        if target != own_address:
            out.append((name or None, target))
    return out


async def describe_bootstrap(
    entries: list[tuple[str | None, str]],
    ctx: NodeContext,
    *,
    timeout: float,
    own_id: str | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[list[NodeRef], set[str]]:
    """One pass over the bootstrap entries: ask each address for its node id with
    ``Describe``. Returns the nodes to join through and the targets that answered. A named
    entry whose node reports another id is skipped (a stale or mistyped configuration), and
    so is this node's own address in a shared list (``own_id``)."""
    refs: list[NodeRef] = []
    answered: set[str] = set()
    log = ctx.log
    for name, target in entries:
        if stop is not None and stop.is_set():
            break
        try:
            async with ctx.dial(target) as peer:
                stub = overlay_pb2_grpc.OverlayStub(peer.channel)  # type: ignore[no-untyped-call]
                desc = await stub.Describe(
                    overlay_pb2.DescribeRequest(), timeout=timeout, metadata=peer.metadata or None
                )
        except grpc.aio.AioRpcError as err:
            log.info("overlay_bootstrap_unreachable", target=target, error=describe_rpc_error(err))
            continue
        answered.add(target)
        if own_id is not None and desc.node_id == own_id:
            continue
        if name is not None and desc.node_id != name:
            log.warning(
                "overlay_bootstrap_mismatch", target=target, expected=name, got=desc.node_id
            )
            continue
        refs.append(NodeRef(desc.node_id, target))
    return refs, answered


async def resolve_bootstrap(
    entries: list[tuple[str | None, str]],
    ctx: NodeContext,
    retry_s: float,
    stop: asyncio.Event,
) -> list[NodeRef]:
    """Pass over the bootstrap addresses until at least one answers (or ``stop``). Joining
    only through nodes that answered keeps the first neighbour exchange from being lost to a
    node that is still starting."""
    refs: list[NodeRef] = []
    pending = list(entries)
    while pending and not stop.is_set():
        found, answered = await describe_bootstrap(pending, ctx, timeout=retry_s * 2)
        refs += found
        pending = [(name, target) for name, target in pending if target not in answered]
        if refs:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_s)
    return refs
