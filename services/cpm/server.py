"""The ``peerlm cpm`` process: configuration, security mode, server, signals, shutdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from peerlm.services.cpm.core import CpmCore
from peerlm.services.cpm.metrics import CpmMetrics
from peerlm.services.cpm.service import CPM_POLICY, CpmService
from peerlm.services.cpm.store import SqliteCpmStore

from peerlm.config import CpmSettings, parse_host_port
from peerlm.logs import configure_logging
from peerlm.metrics import new_registry, serve_metrics
from peerlm.pki.proof import ProofSigner
from peerlm.process import identity_label, on_stop_signals, run_event_loop, write_port_file
from peerlm.rpc import MetricsInterceptor, add_health_and_reflection, create_server, set_serving
from peerlm.security.authz import AuthInterceptor
from peerlm.security.credentials import bind_server, tls_files_from_settings
from peerlm.security.mode import SecurityMode, resolve_security
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

__all__ = ["run_cpm", "serve_cpm"]

SERVICE_NAME = cpm_pb2.DESCRIPTOR.services_by_name["Matchmaker"].full_name


async def serve_cpm(
    settings: CpmSettings,
    stop: asyncio.Event,
    *,
    port_file: Path | None = None,
    log: Any,
) -> None:
    """Run the CPM until ``stop`` is set, then shut down gracefully."""
    host, _ = parse_host_port(settings.listen)
    tls = tls_files_from_settings(settings.tls)
    mode = resolve_security(
        insecure_dev=settings.insecure_dev, listen_host=host, tls=tls, component="cpm", logger=log
    )
    registry = new_registry()
    metrics = CpmMetrics(registry)
    store = SqliteCpmStore(settings.db)
    core = CpmCore(settings, store, time.time)
    server = create_server(
        settings.limits,
        [
            MetricsInterceptor(registry, "cpm", settings.limits),
            AuthInterceptor(
                CPM_POLICY,
                federation=settings.federation,
                mode=mode,
                registry=registry,
                component="cpm",
            ),
        ],
    )
    signer = None
    if tls is not None and mode is SecurityMode.MTLS:
        bundle = tls.load()
        signer = ProofSigner.from_pem(bundle.cert, bundle.key)
    service = CpmService(core, metrics, log, queue_depth=settings.stream_queue_depth, signer=signer)
    cpm_pb2_grpc.add_MatchmakerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    health = add_health_and_reflection(server, [SERVICE_NAME])
    bound = bind_server(server, settings.listen, mode, tls)
    endpoint = None
    if settings.metrics_port is not None:
        endpoint = serve_metrics(registry, settings.metrics_host, settings.metrics_port)
    await server.start()
    service.start()
    await set_serving(health, [SERVICE_NAME], True)
    if port_file is not None:
        write_port_file(port_file, bound)
    log.info(
        "cpm_started",
        listen=f"{host}:{bound}",
        security_mode=mode.value,
        db=str(settings.db),
        metrics_port=endpoint.port if endpoint else None,
        bandit_updates=core.matchmaker.n_updates,
        matchmaking_round=core.matchmaking_round,
        open_directives=core.open_count,
    )
    try:
        await stop.wait()
    finally:
        log.info("cpm_stopping")
        await set_serving(health, [SERVICE_NAME], False)
        await service.stop()
        await server.stop(settings.limits.shutdown_grace_s)
        service.close()
        store.close()
        if endpoint is not None:
            endpoint.close()
        log.info("cpm_stopped")


def run_cpm(settings: CpmSettings, *, port_file: Path | None = None) -> None:
    """Blocking entry point: uvloop where available, SIGTERM/SIGINT stop gracefully."""
    log = configure_logging(
        "cpm", identity_label(settings, "cpm"), settings.log_format, settings.log_level
    )

    async def main() -> None:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        await serve_cpm(settings, stop, port_file=port_file, log=log)

    run_event_loop(main)
