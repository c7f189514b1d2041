"""The ``peerlm overlay-node`` process: configuration, keys, server, node host, shutdown.

A dedicated overlay node holds no model. It takes part in the overlay like any node (zone
election and probing, clustering as an initiator, routing) but, without a signature, is
never a member of a leaf cluster and so never a search result (see docs/overlay.md,
"Running overlay nodes"). ``signature_file`` gives it a planted signature instead: a test
and benchmark facility that makes it a full member.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerlm.overlay.host import (
    OverlayHostConfig,
    OverlayStack,
    build_overlay_host,
    certified_vrf_secret,
    name_seed,
    parse_bootstrap,
    resolve_bootstrap,
)
from peerlm.overlay.messages import NodeRef
from peerlm.overlay.service import OVERLAY_POLICY
from peerlm.overlay.settings import OverlaySettings
from peerlm.overlay.signature import Signature, SignatureError
from peerlm.overlay.transport import DeliveryPolicy, OverlayHost
from prometheus_client import CollectorRegistry

from peerlm.config import parse_host_port
from peerlm.logs import configure_logging
from peerlm.metrics import MetricsEndpoint, serve_metrics
from peerlm.node import NodeContext, NodeServer
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.process import identity_label, on_stop_signals, run_event_loop, write_port_file
from peerlm.security.credentials import TlsFiles
from peerlm.security.mode import SecurityConfigError

__all__ = [
    "OverlayRuntime",
    "delivery_policy",
    "load_signature",
    "parse_bootstrap",
    "run_overlay",
    "serve_overlay",
]
# parse_bootstrap lives in peerlm.overlay.host (shared with agents); re-exported here for
# the process's own tests.


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


def _check_identity(settings: OverlaySettings, ctx: NodeContext) -> None:
    """The certificate (or, in insecure-dev, ``name``) must fit an overlay node."""
    identity = ctx.identity
    if ctx.tls is None:
        if settings.name is None:
            raise SecurityConfigError("overlay-node: insecure-dev needs `name` (no certificate)")
        return
    if identity.role not in (Role.OVERLAY, Role.AGENT):
        raise SecurityConfigError(
            f"overlay-node: certificate {ctx.tls.cert} is for role {identity.role.value!r}; an "
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


def _vrf_secret(settings: OverlaySettings, identity: PeerIdentity, tls: TlsFiles | None) -> bytes:
    path = settings.vrf_key
    if path is None:
        if tls is None:
            raise SecurityConfigError("overlay-node: insecure-dev needs `vrf_key`")
        path = tls.cert.with_name(tls.cert.stem + ".vrf.key")
    return certified_vrf_secret(
        path, identity, who="overlay-node", require_certified=tls is not None
    )


def _advertised(settings: OverlaySettings, host: str, port: int) -> str:
    if settings.advertise is not None:
        return settings.advertise
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"overlay-node listens on the wildcard address {host!r}; set `advertise` to the "
            "host:port other nodes dial (its certificate needs a SAN for that host)"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class OverlayRuntime:
    """Everything one overlay node process runs: context, server, node host, metrics.

    :meth:`create` builds and starts it (the server is bound and serving calls, the host's
    timer runs, nothing is joined yet); :meth:`enter` joins through the bootstrap nodes and
    publishes the signature; :meth:`close` leaves gracefully and stops. The process main
    and in-process tests use the same steps.
    """

    settings: OverlaySettings
    ctx: NodeContext
    stack: OverlayStack
    server: NodeServer
    signature: Signature | None
    endpoint: MetricsEndpoint | None = None
    bootstrap: list[NodeRef] = field(default_factory=list)

    @property
    def host(self) -> OverlayHost:
        return self.stack.host

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def log(self) -> Any:
        return self.ctx.log

    @property
    def registry(self) -> CollectorRegistry:
        return self.ctx.registry

    @classmethod
    async def create(cls, settings: OverlaySettings, log: Any) -> OverlayRuntime:
        """Check the configuration and keys, bind and start the server and the host."""
        ctx = NodeContext.from_settings(
            settings, role=Role.OVERLAY, log=log, dev_name=settings.name
        )
        _check_identity(settings, ctx)
        params = settings.protocol
        signature = (
            load_signature(settings.signature_file, params.max_signature_p)
            if settings.signature_file is not None
            else None
        )
        # Bound before the stack is built: the node advertises the port it got.
        server = ctx.bind(OVERLAY_POLICY, listen=settings.listen)
        listen_host, _ = parse_host_port(settings.listen)
        address = _advertised(settings, listen_host, server.port)
        ctx.check_advertised(address)
        stack = build_overlay_host(
            ctx,
            OverlayHostConfig(
                address=address,
                params=params,
                secret=_vrf_secret(settings, ctx.identity, ctx.tls),
                seed=settings.seed if settings.seed is not None else name_seed(ctx.name),
                delivery=delivery_policy(settings),
                key_cache=settings.key_cache,
                event_queue_depth=settings.event_queue_depth,
                metrics_interval_s=settings.metrics_interval_s,
                max_receive_batch=settings.max_receive_batch,
            ),
        )
        server.add(stack.service)
        await server.start()
        endpoint = None
        if settings.metrics_port is not None:
            endpoint = serve_metrics(ctx.registry, settings.metrics_host, settings.metrics_port)
        await stack.start()
        return cls(
            settings=settings,
            ctx=ctx,
            stack=stack,
            server=server,
            signature=signature,
            endpoint=endpoint,
        )

    async def enter(self, stop: asyncio.Event) -> None:
        """Join through the bootstrap nodes, publish the signature, report SERVING."""
        settings = self.settings
        self.bootstrap = await resolve_bootstrap(
            parse_bootstrap(settings.bootstrap, self.host.address),
            self.ctx,
            settings.bootstrap_retry_s,
            stop,
        )
        # join first: a node that starts mid-epoch enters through the tree only on its
        # first call into the core.
        self.host.join(self.bootstrap)
        if self.signature is not None:
            self.host.set_signature(self.signature)
        await self.server.serving(True)
        params = self.host.node.params
        self.log.info(
            "overlay_started",
            listen=settings.listen.rsplit(":", 1)[0] + f":{self.port}",
            address=self.host.address,
            security_mode=self.ctx.mode.value,
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
        await self.server.serving(False)
        await self.host.stop(self.settings.leave_grace_s)
        await self.server.stop()
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
