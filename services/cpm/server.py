"""The ``peerlm cpm`` process: configuration, security mode, server, signals, shutdown."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from peerlm.services.cpm.allocator import retain_freed_memory
from peerlm.services.cpm.core import CpmCore
from peerlm.services.cpm.metrics import CpmMetrics
from peerlm.services.cpm.service import CPM_POLICY, CpmService
from peerlm.services.cpm.settings import CpmSettings
from peerlm.services.cpm.store import SqliteCpmStore
from threadpoolctl import threadpool_limits

from peerlm.logs import configure_logging
from peerlm.metrics import serve_metrics
from peerlm.node import NodeContext, Service
from peerlm.pki.identity import Role
from peerlm.process import identity_label, on_stop_signals, run_event_loop, write_port_file
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

__all__ = ["cpm_command", "run_cpm", "serve_cpm"]

SERVICE_NAME = cpm_pb2.DESCRIPTOR.services_by_name["Matchmaker"].full_name


async def serve_cpm(
    settings: CpmSettings,
    stop: asyncio.Event,
    *,
    port_file: Path | None = None,
    log: Any,
) -> None:
    """Run the CPM until ``stop`` is set, then shut down gracefully."""
    # Process-wide and for the process's life (the CPM owns its process): set before the
    # core makes its first BLAS call (restoring the bandit at start).
    threadpool_limits(limits=settings.blas_threads, user_api="blas")
    # Matchmaking's multi-megabyte temporaries are reused instead of page-faulted afresh
    # on every select (see .allocator); a no-op where the C library cannot do it.
    retain_freed_memory()
    ctx = NodeContext.from_settings(settings, role=Role.CPM, log=log)
    metrics = CpmMetrics(ctx.registry)
    store = SqliteCpmStore(settings.db)
    core = CpmCore(settings, store, time.time)
    service = CpmService(
        core,
        metrics,
        log,
        queue_depth=settings.stream_queue_depth,
        signer=ctx.signer,
        reward_window=settings.reward_stream_window,
    )
    server = await ctx.serve(
        [Service(SERVICE_NAME, service, cpm_pb2_grpc.add_MatchmakerServicer_to_server)],
        CPM_POLICY,
        listen=settings.listen,
        # Every agent holds its directive feed: room for all of them (measured: 1,060 honest
        # agents used to exhaust the default 1,024).
        population=settings.max_agents,
    )
    endpoint = None
    if settings.metrics_port is not None:
        endpoint = serve_metrics(ctx.registry, settings.metrics_host, settings.metrics_port)
    service.start()
    await server.serving(True)
    if port_file is not None:
        write_port_file(port_file, server.port)
    log.info(
        "cpm_started",
        listen=settings.listen.rsplit(":", 1)[0] + f":{server.port}",
        security_mode=ctx.mode.value,
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
        await server.serving(False)
        await service.stop()
        await server.stop()
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


def cpm_command(
    *,
    tls: TlsFiles,
    db: Path,
    port_file: Path,
    federation: str,
    metrics_port: int | None = None,
    listen: str = "127.0.0.1:0",
    init: bool = False,
) -> list[str]:
    """The argv of a ``peerlm cpm`` child process that writes its bound port to ``port_file``
    (used by ``peerlm up``, the benchmarks and the tests that start a CPM).

    ``init`` adds ``--init``: the child may create a new federation database.
    """
    args = [
        sys.executable, "-m", "peerlm", "cpm", "--listen", listen,
        "--port-file", str(port_file), "--db", str(db), "--federation", federation,
        "--ca-cert", str(tls.ca_cert), "--cert", str(tls.cert), "--key", str(tls.key),
        "--log-format", "json",
    ]  # fmt: skip
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    if init:
        args.append("--init")
    return args
