"""Prometheus metrics plumbing shared by every process.

Each process (and each server in a test) owns its own :class:`CollectorRegistry` instead of
prometheus-client's process-wide default, so two servers in one test process never share
counters. Names follow ``peerlm_<component>_<what>_<unit>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["MetricsEndpoint", "MetricsPortError", "new_registry", "serve_metrics"]


def new_registry() -> CollectorRegistry:
    """A fresh registry for one process or one server instance."""
    return CollectorRegistry(auto_describe=True)


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
