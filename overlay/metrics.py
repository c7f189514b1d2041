"""Prometheus metrics of an overlay node process (catalogue in docs/metrics.md).

Transport-side counts (messages sent, received, dropped; refusals before the core) are
recorded where they happen; the core's own view (roles, level, tau, rejections it counted)
is copied in by :meth:`OverlayMetrics.observe_node` from ``OverlayNode.describe()`` and
``OverlayNode.counters``, so nothing here reaches into the core's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peerlm.overlay.events import LeaseTakeover, QueryCompleted
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ROLE_NAMES", "OverlayMetrics"]

#: Values of the ``role`` label of ``peerlm_overlay_role_count`` (one is 1, the others 0).
ROLE_NAMES = ("unplaced", "member", "initiator", "super-peer", "root", "left")

_MAX_REASONS = 128


class OverlayMetrics:
    """All overlay series, registered in one per-process registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.role = Gauge(
            "peerlm_overlay_role_count",
            "1 for the highest role this node holds now (label role), 0 for the others.",
            ["role"],
            registry=registry,
        )
        self.level = Gauge(
            "peerlm_overlay_level_count",
            "Highest hierarchy level at which this node holds a super-peer role (0: none).",
            registry=registry,
        )
        self.roles_held = Gauge(
            "peerlm_overlay_super_peer_roles_count",
            "Cluster roles (replica or primary) this node holds, by level and kind.",
            ["level", "kind"],
            registry=registry,
        )
        self.depth = Gauge(
            "peerlm_overlay_depth_count",
            "Depth of the hierarchy announced for the current epoch (0 before the build).",
            registry=registry,
        )
        self.epoch = Gauge(
            "peerlm_overlay_epoch_count",
            "Overlay epoch this node is in (-1 before the first).",
            registry=registry,
        )
        self.zone_size = Gauge(
            "peerlm_overlay_zone_size_count",
            "Members of the level-1 zone this node initiates (0 when it initiates none).",
            registry=registry,
        )
        self.cluster_members = Gauge(
            "peerlm_overlay_cluster_members_count",
            "Members of the leaf clusters this node serves as a super-peer.",
            registry=registry,
        )
        self.neighbours = Gauge(
            "peerlm_overlay_neighbours_count",
            "Physical overlay neighbours (at most d_max).",
            registry=registry,
        )
        self.tau = Gauge(
            "peerlm_overlay_tau_ratio",
            "The round-level similarity threshold tau^(t) of this node's queries (Sec. 3.5).",
            registry=registry,
        )
        self.query_latency = Histogram(
            "peerlm_overlay_query_latency_seconds",
            "Time from start_query to QueryCompleted (result or soft barrier Delta_t).",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.queries = Counter(
            "peerlm_overlay_queries_total",
            "Queries this node issued, by outcome (complete, partial).",
            ["outcome"],
            registry=registry,
        )
        self.comparisons = Counter(
            "peerlm_overlay_query_comparisons_total",
            "Signature comparisons the overlay made for this node's queries, by kind "
            "(prototype at super-peers, member at leaves); divide by queries for per-query.",
            ["kind"],
            registry=registry,
        )
        self.takeovers = Counter(
            "peerlm_overlay_lease_takeovers_total",
            "Clusters this node took over as primary, by reason (lease expiry, resignation).",
            ["reason"],
            registry=registry,
        )
        self.sent = Counter(
            "peerlm_overlay_messages_sent_total",
            "Protocol messages delivered to another node (acknowledged by its server), by kind.",
            ["kind"],
            registry=registry,
        )
        self.received = Counter(
            "peerlm_overlay_messages_received_total",
            "Protocol messages accepted from other nodes and handed to the core, by kind.",
            ["kind"],
            registry=registry,
        )
        self.dropped = Counter(
            "peerlm_overlay_messages_dropped_total",
            "Outgoing protocol messages given up on, by kind and reason (the final gRPC "
            "status in lower case, refused, queue_full, stale, evicted, unencodable, ...).",
            ["kind", "reason"],
            registry=registry,
        )
        self.retries = Counter(
            "peerlm_overlay_delivery_retries_total",
            "Delivery attempts repeated after a transient failure.",
            registry=registry,
        )
        self.rejected = Counter(
            "peerlm_overlay_rejected_messages_total",
            "Incoming messages refused: stage transport (decoding, identity, certificates; "
            "the call fails) or core (the protocol core ignored it), by reason.",
            ["stage", "reason"],
            registry=registry,
        )
        self.peers = Gauge(
            "peerlm_overlay_client_peers_count",
            "Destinations with an open client channel in the bounded pool.",
            registry=registry,
        )
        self.queued = Gauge(
            "peerlm_overlay_send_queue_count",
            "Outgoing messages waiting in the per-destination queues.",
            registry=registry,
        )
        self.core_errors = Counter(
            "peerlm_overlay_core_errors_total",
            "Exceptions raised by the protocol core (bugs; the input is dropped, the node "
            "keeps running).",
            ["operation"],
            registry=registry,
        )
        for name in ROLE_NAMES:
            self.role.labels(name).set(0)
        self.epoch.set(-1)
        self._core_rejected: dict[str, float] = {}
        self._held: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ events

    def observe_query(self, event: QueryCompleted) -> None:
        self.query_latency.observe(max(0.0, event.latency))
        self.queries.labels("complete" if event.complete else "partial").inc()
        self.comparisons.labels("prototype").inc(event.stats.prototypes)
        self.comparisons.labels("member").inc(event.stats.members)
        self.tau.set(event.tau)

    def observe_takeover(self, event: LeaseTakeover) -> None:
        self.takeovers.labels(event.reason).inc()

    # ------------------------------------------------------------------ core state

    def observe_node(self, description: Mapping[str, Any], counters: Mapping[str, int]) -> None:
        """Copy the core's description and rejection counters into the gauges/counters."""
        role = str(description.get("role") or "unplaced")
        for name in ROLE_NAMES:
            self.role.labels(name).set(1 if name == role else 0)
        self.level.set(_int(description.get("level")))
        self.depth.set(_int(description.get("depth")))
        epoch = description.get("epoch")
        self.epoch.set(-1 if epoch is None else _int(epoch))
        self.zone_size.set(_int(description.get("zone_size")))
        self.neighbours.set(len(description.get("neighbours") or ()))
        tau = description.get("tau")
        if isinstance(tau, int | float):
            self.tau.set(float(tau))
        held: dict[tuple[str, str], int] = {}
        members = 0
        for entry in description.get("roles") or ():
            if not isinstance(entry, Mapping):
                continue
            key = (str(entry.get("level")), "primary" if entry.get("primary") else "replica")
            held[key] = held.get(key, 0) + 1
            if _int(entry.get("level")) == 1:
                members += _int(entry.get("members"))
        for level, kind in self._held - set(held):
            self.roles_held.labels(level, kind).set(0)
        for (level, kind), count in held.items():
            self.roles_held.labels(level, kind).set(count)
        self._held |= set(held)
        self.cluster_members.set(members)
        for name, value in counters.items():
            if not name.startswith("rejected."):
                continue
            reason = name.removeprefix("rejected.")
            if reason not in self._core_rejected and len(self._core_rejected) >= _MAX_REASONS:
                continue  # bounded label set even if the core invents many reasons
            previous = self._core_rejected.get(reason, 0.0)
            if value > previous:
                self.rejected.labels("core", reason).inc(value - previous)
                self._core_rejected[reason] = float(value)


def _int(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    return 0
