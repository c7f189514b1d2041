"""What an :class:`~peerlm.overlay.node.OverlayNode` hands back to its host.

``Send`` is an instruction to the transport; the event classes are notifications the host
drains with ``OverlayNode.pop_events()`` (query results for the agent, role changes and
takeovers for logs and metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

from peerlm.overlay.messages import Candidate, Message, SearchStats

__all__ = [
    "BuildFinished",
    "Event",
    "LeaseTakeover",
    "NetworkPChanged",
    "Placed",
    "QueryCompleted",
    "RoleChanged",
    "Send",
]


@dataclass(frozen=True, slots=True)
class Send:
    """Deliver ``msg`` to node ``dst_id`` at ``dst_address`` (best effort; the protocol
    tolerates loss, duplication and reordering)."""

    dst_id: str
    dst_address: str
    msg: Message


@dataclass(frozen=True, slots=True)
class QueryCompleted:
    """A query finished (result arrived, or the soft barrier ``Delta_t`` fired).

    ``results`` are at most K ``(node_id, address, similarity)`` triples, best first.
    ``complete`` is false when the barrier fired or a branch failed; ``stale_used`` counts
    candidates taken from earlier rounds' late replies under the freshness guard.
    """

    qid: str
    round: int
    results: tuple[Candidate, ...]
    complete: bool
    stale_used: int
    tau: float
    stats: SearchStats
    latency: float


@dataclass(frozen=True, slots=True)
class RoleChanged:
    """This node's roles changed; ``roles`` are strings such as ``"initiator@1"`` or
    ``"super-peer@2:<cluster_id>"`` (primary roles are marked ``primary``)."""

    epoch: int
    roles: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LeaseTakeover:
    """This node took over cluster ``cluster_id`` from ``previous_primary``."""

    epoch: int
    cluster_id: str
    level: int
    previous_primary: str
    reason: str


@dataclass(frozen=True, slots=True)
class Placed:
    """This node became a member of leaf cluster ``cluster_id`` (build or join)."""

    epoch: int
    cluster_id: str
    via: str


@dataclass(frozen=True, slots=True)
class BuildFinished:
    """The epoch's root announcement reached this node: the overlay is searchable."""

    epoch: int
    depth: int
    root_id: str


@dataclass(frozen=True, slots=True)
class NetworkPChanged:
    """The network-wide signature cardinality ``P`` announced for ``epoch``."""

    epoch: int
    p: int


Event = QueryCompleted | RoleChanged | LeaseTakeover | Placed | BuildFinished | NetworkPChanged
