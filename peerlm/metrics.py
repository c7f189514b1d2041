"""Prometheus metrics plumbing shared by every process.

Each process (and each server in a test) owns its own :class:`CollectorRegistry` instead of
prometheus-client's process-wide default, so two servers in one test process never share
counters. Names follow ``peerlm_<component>_<what>_<unit>``.

Every registry also carries the standard process metrics (``process_*``: memory, CPU,
open files; ``python_info``) and ``peerlm_build_info{version}``, so any process's
``/metrics`` says what runs and what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

__all__ = [
    "MetricsEndpoint",
    "MetricsPortError",
    "get_collector",
    "get_counter",
    "new_registry",
    "serve_metrics",
]

C = TypeVar("C")


def new_registry() -> CollectorRegistry:
    """A fresh registry for one process or one server instance, with the process and
    build-info metrics registered."""
    from peerlm import __version__

    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("peerlm_build", "The peerlm version this process runs", registry=registry).info(
        {"version": __version__}
    )
    return registry


def get_collector(
    kind: type[C],
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    labels: Sequence[str] = (),
    **kwargs: Any,
) -> C:
    """The ``kind`` (Counter, Gauge, ...) metric ``name`` of ``registry``, created on first use.

    Plain functions that run once per exchange (and several interceptors sharing one
    registry) record into the process's one registry, and prometheus-client refuses to
    register a name twice: the second caller gets the first one's metric.
    """
    try:
        make: Any = kind  # prometheus-client's metric classes share this constructor
        created: C = make(name, documentation, list(labels), registry=registry, **kwargs)
        return created
    except ValueError:
        # prometheus-client has no public lookup by name; this private map is what its own
        # unregister uses. A counter is stored under its name without ``_total`` too.
        found = getattr(registry, "_names_to_collectors", {}).get(name)
        if isinstance(found, kind):
            return found
        raise


def get_counter(
    registry: CollectorRegistry, name: str, documentation: str, labels: Sequence[str] = ()
) -> Counter:
    """A counter in ``registry``, reused if this process registered it before."""
    return get_collector(Counter, registry, name, documentation, labels)


class MetricsPortError(OSError):
    """The metrics port could not be bound; the message names the address."""


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP endpoint."""

    host: str
    port: int
    _server: object

    def close(self) -> None:
        shutdown = getattr(self._server, "shutdown", None)
        if shutdown is not None:
            shutdown()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port; the chosen one is in the returned endpoint. A port that
    cannot be bound (another process holds it) raises :class:`MetricsPortError` naming it.
    """
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise MetricsPortError(
            err.errno,
            f"cannot serve metrics on {host}:{port}: {err.strerror or err} "
            "(is another process using this metrics port? choose another one)",
        ) from err
    return MetricsEndpoint(host=host, port=server.server_address[1], _server=server)
