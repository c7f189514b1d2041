"""The ``peerlm overlay-node`` process: configuration, keys, server, node host, shutdown.

A dedicated overlay node holds no model. It takes part in the overlay like any node (zone
election and probing, clustering as an initiator, routing) but, without a signature, is
never a member of a leaf cluster and so never a search result (see docs/overlay.md,
"Running overlay nodes"). ``signature_file`` gives it a planted signature instead: a test
and benchmark facility that makes it a full member.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from peerlm.overlay import vrf
from peerlm.overlay.codec import CodecLimits
from peerlm.overlay.messages import NodeRef
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.service import OVERLAY_POLICY, SERVICE_NAME, OverlayService
from peerlm.overlay.signature import Signature, SignatureError
from peerlm.overlay.transport import (
    DeliveryPolicy,
    KeyDirectory,
    OverlayClock,
    OverlayHost,
    PeerPool,
)
from prometheus_client import CollectorRegistry

from peerlm.config import OverlaySettings, parse_host_port
from peerlm.logs import configure_logging
from peerlm.metrics import MetricsEndpoint, new_registry, serve_metrics
from peerlm.pki.identity import (
    PeerIdentity,
    Role,
    identity_from_certificate_pem,
    load_vrf_secret,
)
from peerlm.process import identity_label, on_stop_signals, run_event_loop, write_port_file
from peerlm.rpc import (
    MetricsInterceptor,
    add_health_and_reflection,
    create_channel,
    create_server,
    set_serving,
)
from peerlm.security.authz import (
    DEV_IDENTITY_METADATA_KEY,
    AuthInterceptor,
    TlsFailureCounter,
    describe_rpc_error,
)
from peerlm.security.credentials import (
    TlsFiles,
    bind_server,
    channel_credentials,
    tls_files_from_settings,
)
from peerlm.security.mode import (
    SecurityConfigError,
    SecurityMode,
    is_loopback_target,
    resolve_security,
)
from peerlm.wire.v1 import overlay_pb2, overlay_pb2_grpc

__all__ = [
    "OverlayRuntime",
    "delivery_policy",
    "load_signature",
    "parse_bootstrap",
    "run_overlay",
    "serve_overlay",
]


def load_signature(path: Path, max_p: int) -> Signature:
    """Read a ``Signature.to_bytes()`` file (the ``signature_file`` setting)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read signature file {path}: {err.strerror or err}") from None
    try:
        return Signature.from_bytes(data, max_p=max_p)
    except SignatureError as err:
        raise ValueError(f"signature file {path} is not a valid signature: {err}") from None


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


def _own_identity(settings: OverlaySettings, tls: TlsFiles | None) -> PeerIdentity:
    if tls is None:
        if settings.name is None:
            raise SecurityConfigError("overlay-node: insecure-dev needs `name` (no certificate)")
        return PeerIdentity(settings.federation, Role.OVERLAY, settings.name)
    identity = identity_from_certificate_pem(tls.cert.read_bytes())
    if identity.role not in (Role.OVERLAY, Role.AGENT):
        raise SecurityConfigError(
            f"overlay-node: certificate {tls.cert} is for role {identity.role.value!r}; an "
            "overlay node needs an overlay (or agent) certificate"
        )
    if settings.name is not None and settings.name != identity.name:
        raise SecurityConfigError(
            f"overlay-node: name {settings.name!r} differs from the certificate's name "
            f"{identity.name!r}; the certificate is the identity (drop `name` or fix it)"
        )
    if identity.federation != settings.federation:
        raise SecurityConfigError(
            f"overlay-node: certificate is for federation {identity.federation!r}, the "
            f"settings say {settings.federation!r}"
        )
    return identity


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


def _vrf_secret(settings: OverlaySettings, identity: PeerIdentity, tls: TlsFiles | None) -> bytes:
    path = settings.vrf_key
    if path is None:
        if tls is None:
            raise SecurityConfigError("overlay-node: insecure-dev needs `vrf_key`")
        path = tls.cert.with_name(tls.cert.stem + ".vrf.key")
    return certified_vrf_secret(
        path, identity, who="overlay-node", require_certified=tls is not None
    )


def _params(settings: OverlaySettings) -> OverlayParams:
    try:
        return OverlayParams(**settings.protocol.overrides())
    except ValueError as err:
        raise ValueError(f"overlay protocol settings: {err}") from None


def _advertised(settings: OverlaySettings, host: str, port: int) -> str:
    if settings.advertise is not None:
        return settings.advertise
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"overlay-node listens on the wildcard address {host!r}; set `advertise` to the "
            "host:port other nodes dial (its certificate needs a SAN for that host)"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def describe_bootstrap(
    entries: list[tuple[str | None, str]],
    dial: Any,
    *,
    timeout: float,
    log: Any,
    metadata: tuple[tuple[str, str], ...] = (),
    own_id: str | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[list[NodeRef], set[str]]:
    """One pass over the bootstrap entries: ask each address for its node id with
    ``Describe``. Returns the nodes to join through and the targets that answered. A named
    entry whose node reports another id is skipped (a stale or mistyped configuration), and
    so is this node's own address in a shared list (``own_id``)."""
    refs: list[NodeRef] = []
    answered: set[str] = set()
    for name, target in entries:
        if stop is not None and stop.is_set():
            break
        channel = dial(target)
        try:
            stub = overlay_pb2_grpc.OverlayStub(channel)  # type: ignore[no-untyped-call]
            desc = await stub.Describe(
                overlay_pb2.DescribeRequest(), timeout=timeout, metadata=metadata or None
            )
        except grpc.aio.AioRpcError as err:
            log.info("overlay_bootstrap_unreachable", target=target, error=describe_rpc_error(err))
            continue
        finally:
            await channel.close(None)
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


async def _resolve_bootstrap(
    entries: list[tuple[str | None, str]],
    dial: Any,
    metadata: tuple[tuple[str, str], ...],
    retry_s: float,
    stop: asyncio.Event,
    log: Any,
) -> list[NodeRef]:
    """Pass over the bootstrap addresses until at least one answers (or ``stop``). Joining
    only through nodes that answered keeps the first neighbour exchange from being lost to a
    node that is still starting."""
    refs: list[NodeRef] = []
    pending = list(entries)
    while pending and not stop.is_set():
        found, answered = await describe_bootstrap(
            pending, dial, timeout=retry_s * 2, log=log, metadata=metadata
        )
        refs += found
        pending = [(name, target) for name, target in pending if target not in answered]
        if refs:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_s)
    return refs


@dataclass
class OverlayRuntime:
    """Everything one overlay node process runs: server, node host, keys, metrics.

    :meth:`create` builds and starts it (the server is bound and serving calls, the host's
    timer runs, nothing is joined yet); :meth:`enter` joins through the bootstrap nodes and
    publishes the signature; :meth:`close` leaves gracefully and stops. The process main
    and in-process tests use the same steps.
    """

    settings: OverlaySettings
    log: Any
    host: OverlayHost
    server: grpc.aio.Server
    health: Any
    registry: CollectorRegistry
    metrics: OverlayMetrics
    keys: KeyDirectory | None
    mode: SecurityMode
    port: int
    dial: Callable[[str], grpc.aio.Channel]
    metadata: tuple[tuple[str, str], ...]
    signature: Signature | None
    endpoint: MetricsEndpoint | None = None
    bootstrap: list[NodeRef] = field(default_factory=list)

    @classmethod
    async def create(cls, settings: OverlaySettings, log: Any) -> OverlayRuntime:
        """Check the configuration and keys, bind and start the server and the host."""
        listen_host, _ = parse_host_port(settings.listen)
        tls = tls_files_from_settings(settings.tls)
        mode = resolve_security(
            insecure_dev=settings.insecure_dev,
            listen_host=listen_host,
            tls=tls,
            component="overlay",
            logger=log,
        )
        identity = _own_identity(settings, tls)
        secret = _vrf_secret(settings, identity, tls)
        params = _params(settings)
        signature = (
            load_signature(settings.signature_file, params.max_signature_p)
            if settings.signature_file is not None
            else None
        )
        registry = new_registry()
        metrics = OverlayMetrics(registry)
        server = create_server(
            settings.limits,
            [
                MetricsInterceptor(registry, "overlay", settings.limits),
                AuthInterceptor(
                    OVERLAY_POLICY,
                    federation=settings.federation,
                    mode=mode,
                    registry=registry,
                    component="overlay",
                ),
            ],
        )
        port = bind_server(server, settings.listen, mode, tls)
        address = _advertised(settings, listen_host, port)

        keys: KeyDirectory | None = None
        credentials: grpc.ChannelCredentials | None = None
        metadata: tuple[tuple[str, str], ...] = ()
        if mode is SecurityMode.MTLS:
            assert tls is not None and identity.vrf_public_key is not None
            bundle = tls.load()
            keys = KeyDirectory(
                federation=settings.federation,
                ca_certificate=x509.load_pem_x509_certificate(bundle.ca_cert),
                own=(
                    identity.name,
                    identity.vrf_public_key,
                    bundle.certificate.public_bytes(Encoding.DER),
                ),
                capacity=settings.key_cache,
            )
            credentials = channel_credentials(tls)
        else:
            # No certificates, so no certified keys: the core trusts the key in each ticket.
            log.warning("overlay_vrf_keys_unverified", reason="insecure-dev has no certificates")
            metadata = ((DEV_IDENTITY_METADATA_KEY, identity.spiffe_uri),)

        def dial(target: str) -> grpc.aio.Channel:
            if credentials is None and not is_loopback_target(target):
                raise SecurityConfigError(
                    f"insecure-dev may only dial loopback targets, not {target}"
                )
            return create_channel(target, settings.limits, credentials)

        seed = settings.seed
        if seed is None:
            seed = int.from_bytes(hashlib.sha256(identity.name.encode()).digest()[:8], "big")
        node = OverlayNode(
            identity.name,
            address,
            params,
            secret,
            rng=seed,
            key_resolver=keys.resolve if keys is not None else None,
        )
        pool = PeerPool(
            identity.name,
            dial,
            delivery_policy(settings),
            metrics,
            log,
            certificate_for=keys.certificate if keys is not None else None,
            metadata=metadata,
            tls_failures=TlsFailureCounter(registry, "overlay"),
        )
        host = OverlayHost(
            node,
            pool,
            metrics,
            log,
            clock=OverlayClock(),
            event_queue_depth=settings.event_queue_depth,
            metrics_interval_s=settings.metrics_interval_s,
        )
        limits = CodecLimits.from_params(params, max_batch=settings.max_receive_batch)
        service = OverlayService(host, keys, limits, metrics, log)
        overlay_pb2_grpc.add_OverlayServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        health = add_health_and_reflection(server, [SERVICE_NAME])
        endpoint = None
        if settings.metrics_port is not None:
            endpoint = serve_metrics(registry, settings.metrics_host, settings.metrics_port)
        await server.start()
        await host.start()
        return cls(
            settings=settings,
            log=log,
            host=host,
            server=server,
            health=health,
            registry=registry,
            metrics=metrics,
            keys=keys,
            mode=mode,
            port=port,
            dial=dial,
            metadata=metadata,
            signature=signature,
            endpoint=endpoint,
        )

    async def enter(self, stop: asyncio.Event) -> None:
        """Join through the bootstrap nodes, publish the signature, report SERVING."""
        settings = self.settings
        self.bootstrap = await _resolve_bootstrap(
            parse_bootstrap(settings.bootstrap, self.host.address),
            self.dial,
            self.metadata,
            settings.bootstrap_retry_s,
            stop,
            self.log,
        )
        # join first: a node that starts mid-epoch enters through the tree only on its
        # first call into the core.
        self.host.join(self.bootstrap)
        if self.signature is not None:
            self.host.set_signature(self.signature)
        await set_serving(self.health, [SERVICE_NAME], True)
        params = self.host.node.params
        self.log.info(
            "overlay_started",
            listen=settings.listen.rsplit(":", 1)[0] + f":{self.port}",
            address=self.host.address,
            security_mode=self.mode.value,
            bootstrap=[f"{r.node_id}@{r.address}" for r in self.bootstrap],
            has_signature=self.signature is not None,
            metrics_port=self.endpoint.port if self.endpoint else None,
            epoch_period=params.epoch_period,
            genesis_time=params.genesis_time,
            next_epoch=max(0, params.epoch_of(self.host.now()) + 1),
        )

    async def close(self) -> None:
        """Leave gracefully, then stop the server and the metrics endpoint."""
        self.log.info("overlay_stopping")
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.host.stop(self.settings.leave_grace_s)
        await self.server.stop(self.settings.limits.shutdown_grace_s)
        if self.endpoint is not None:
            self.endpoint.close()
        self.log.info("overlay_stopped")


def delivery_policy(settings: OverlaySettings) -> DeliveryPolicy:
    """The delivery bounds of ``settings`` (a batch stays below the gRPC message limit)."""
    return DeliveryPolicy(
        max_peers=settings.max_peers,
        queue_depth=settings.send_queue_depth,
        max_batch=settings.max_batch,
        max_batch_bytes=max(64 * 1024, settings.limits.max_message_bytes - 64 * 1024),
        timeout_s=settings.deliver_timeout_s,
        retries=settings.deliver_retries,
        backoff_s=settings.retry_backoff_s,
        max_age_s=settings.send_max_age_s,
    )


async def serve_overlay(
    settings: OverlaySettings,
    stop: asyncio.Event,
    *,
    port_file: Path | None = None,
    log: Any,
) -> None:
    """Run one overlay node until ``stop`` is set, then leave gracefully and shut down."""
    runtime = await OverlayRuntime.create(settings, log)
    try:
        await runtime.enter(stop)
        if port_file is not None:
            write_port_file(port_file, runtime.port)
        await stop.wait()
    finally:
        await runtime.close()


def run_overlay(settings: OverlaySettings, *, port_file: Path | None = None) -> None:
    """Blocking entry point: uvloop where available, SIGTERM/SIGINT leave gracefully."""
    log = configure_logging(
        "overlay",
        identity_label(settings, "overlay", settings.name),
        settings.log_format,
        settings.log_level,
    )

    async def main() -> None:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        await serve_overlay(settings, stop, port_file=port_file, log=log)

    run_event_loop(main)
