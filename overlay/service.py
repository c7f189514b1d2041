"""The overlay's gRPC adapter: authorised batches in, validated messages to the host.

Everything that decides lives in the protocol core; this module authenticates the sender
(the certificate name from :func:`~peerlm.security.authz.current_identity`), decodes and
validates with :mod:`peerlm.overlay.codec`, binds VRF keys from certificates
(:class:`~peerlm.overlay.transport.KeyDirectory`), and maps refusals to gRPC status codes
with a metric (``peerlm_overlay_rejected_messages_total{stage="transport"}``), as the CPM
does. A refused batch changes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import grpc
from peerlm.overlay import codec
from peerlm.overlay.events import QueryCompleted
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.ratelimit import SenderBuckets
from peerlm.overlay.transport import CertificateRefused, KeyDirectory, OverlayHost

from peerlm.grpc_types import ServicerContext
from peerlm.pki.identity import Role
from peerlm.security.authz import current_identity
from peerlm.wire.v1 import common_pb2, overlay_pb2, overlay_pb2_grpc

__all__ = ["OVERLAY_POLICY", "SERVICE_NAME", "OverlayService"]

SERVICE_NAME = overlay_pb2.DESCRIPTOR.services_by_name["Overlay"].full_name
_SERVICE = f"/{SERVICE_NAME}/"

#: Which certificate roles may call which method. Anything not listed is denied.
OVERLAY_POLICY: dict[str, frozenset[Role]] = {
    _SERVICE + "Ping": frozenset({Role.AGENT, Role.OVERLAY}),
    _SERVICE + "Deliver": frozenset({Role.AGENT, Role.OVERLAY}),
    _SERVICE + "Describe": frozenset({Role.ADMIN, Role.OVERLAY, Role.AGENT}),
    _SERVICE + "Search": frozenset({Role.ADMIN}),
}


class OverlayService(overlay_pb2_grpc.OverlayServicer):
    """Implements ``peerlm.v1.Overlay`` for one :class:`OverlayHost`."""

    def __init__(
        self,
        host: OverlayHost,
        keys: KeyDirectory | None,
        limits: codec.CodecLimits,
        metrics: OverlayMetrics,
        log: Any,
    ) -> None:
        self._host = host
        self._keys = keys
        self._limits = limits
        self._m = metrics
        self._log = log
        params = host.node.params
        self._buckets = SenderBuckets(params.deliver_rate, params.deliver_burst)

    async def _refuse(
        self, context: ServicerContext, code: grpc.StatusCode, reason: str, detail: str
    ) -> None:
        self._m.rejected.labels("transport", reason).inc()
        self._log.warning("overlay_refused", reason=reason, peer=context.peer(), detail=detail)
        await context.abort(code, detail)

    async def Ping(
        self, request: overlay_pb2.PingRequest, context: ServicerContext
    ) -> overlay_pb2.PingResponse:
        return overlay_pb2.PingResponse(
            sent_unix_nanos=request.sent_unix_nanos,
            responder=common_pb2.PeerAddress(name=self._host.node_id, endpoint=self._host.address),
        )

    async def Deliver(
        self, request: overlay_pb2.OverlayEnvelope, context: ServicerContext
    ) -> overlay_pb2.DeliverAck:
        caller = current_identity()
        if request.recipient != self._host.node_id:
            await self._refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "wrong_recipient",
                f"this is node {self._host.node_id!r}, not {request.recipient!r} "
                "(a stale address?)",
            )
        # Before decoding, which is the expensive part a flood would buy. A batch costs one
        # token per message; a refused one spends nothing and changes nothing. Not logged
        # per batch (a flood would flood the log); the counter says it.
        cost = min(len(request.messages), self._limits.max_batch)
        if not self._buckets.take(caller.name, cost):
            self._m.rejected.labels("transport", "rate_limited").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{caller.name} exceeds the Deliver rate limit of this node "
                f"({self._buckets.rate:g} messages/s, bursts of {self._buckets.burst:g}); "
                "retry later",
            )
        try:
            decoded = codec.decode_batch(request, self._limits, sender=caller.name)
        except codec.CodecError as err:
            await self._refuse(context, grpc.StatusCode[err.status], err.reason, err.detail)
            raise AssertionError("unreachable") from None  # abort raises
        if self._keys is not None:
            pems = list(context.auth_context().get("x509_pem_cert", ()))
            self._keys.learn_authenticated(caller, pems[0] if pems else None)
            try:
                for item in decoded:
                    for node_id, der in item.certificates.items():
                        self._keys.admit(node_id, der)
            except CertificateRefused as err:
                await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, err.reason, str(err))
        accepted = self._host.deliver(caller.name, [item.message for item in decoded])
        return overlay_pb2.DeliverAck(accepted=accepted)

    async def Describe(
        self, request: overlay_pb2.DescribeRequest, context: ServicerContext
    ) -> overlay_pb2.NodeDescription:
        return node_description(self._host.describe(), self._host.node.counters)

    async def Search(
        self, request: overlay_pb2.SearchRequest, context: ServicerContext
    ) -> overlay_pb2.SearchResponse:
        k = int(request.k)
        max_k = self._host.node.params.max_k
        if not 1 <= k <= max_k:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "bad_k", f"k must lie in [1, {max_k}]"
            )
        if not self._host.has_signature:
            await self._refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "no_signature",
                "this node publishes no signature, so it has nothing to search with",
            )
        try:
            done = await self._host.search(k)
        except ValueError as err:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "refused", str(err))
            raise AssertionError("unreachable") from None
        except TimeoutError:
            await self._refuse(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", "the search did not finish"
            )
            raise AssertionError("unreachable") from None
        return search_response(done)


def search_response(done: QueryCompleted) -> overlay_pb2.SearchResponse:
    """A :class:`QueryCompleted` as ``peerlm.v1.SearchResponse``."""
    stats = overlay_pb2.SearchStats(
        prototypes=done.stats.prototypes,
        members=done.stats.members,
        accepted=done.stats.accepted,
        visited=done.stats.visited,
        failed_branches=done.stats.failed_branches,
        samples=[s for s in done.stats.samples if math.isfinite(s)],
    )
    return overlay_pb2.SearchResponse(
        candidates=[
            overlay_pb2.Candidate(node_id=c.node_id, address=c.address, similarity=c.similarity)
            for c in done.results
        ],
        complete=done.complete,
        tau=done.tau,
        stats=stats,
        latency_seconds=done.latency,
        qid=done.qid,
    )


_TYPED = {
    "node_id",
    "address",
    "role",
    "roles",
    "level",
    "zone",
    "cluster",
    "parent",
    "children",
    "tau",
    "epoch",
    "depth",
    "has_signature",
    "zone_size",
    "root",
}


def _count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, list | tuple | set | frozenset | dict):
        return len(value)
    return 1


def node_description(
    described: Mapping[str, Any], counters: Mapping[str, int]
) -> overlay_pb2.NodeDescription:
    """``OverlayNode.describe()`` (plus the host's facts) as ``peerlm.v1.NodeDescription``."""
    out = overlay_pb2.NodeDescription(
        node_id=str(described.get("node_id") or ""),
        address=str(described.get("address") or ""),
        role=str(described.get("role") or ""),
        level=max(0, int(described.get("level") or 0)),
        zone_id=str(described.get("zone") or ""),
        cluster_id=str(described.get("cluster") or ""),
        parent_count=_count(described.get("parent")),
        children_count=_count(described.get("children")),
        epoch=int(described["epoch"]) if described.get("epoch") is not None else -1,
        depth=max(0, int(described.get("depth") or 0)),
        has_signature=bool(described.get("has_signature")),
        zone_size=max(0, int(described.get("zone_size") or 0)),
        parent_id=str(described.get("parent") or ""),
        root_id=str(described.get("root") or ""),
    )
    for role in described.get("roles") or ():
        out.roles.append(json.dumps(role, sort_keys=True, default=str))
    tau = described.get("tau")
    if isinstance(tau, int | float) and math.isfinite(tau):
        out.tau = float(tau)
    for key, value in counters.items():
        if value > 0:
            out.counters[key] = int(value)
    for key, value in described.items():
        if key not in _TYPED:
            out.details[key] = json.dumps(value, sort_keys=True, default=str)
    return out
