"""Who owns each message an overlay node receives: the routing keys and the dispatch table.

Every message kind has exactly one owner, a handler on one component of
:class:`~peerlm.overlay.node.OverlayNode` (zone formation, membership, a role
sub-protocol, search serving, the querier). Three wire kinds carry two different
conversations, told apart by a field of the message itself, never by asking one handler and
then another:

================  ==========================================  ===============================
kind              routing key (the field that decides)        owner
================  ==========================================  ===============================
``QUERY_ACK``     ``QUERY_ACK/root`` (``attempt < 0``)        the querier (its root took the
                                                              query)
                  ``QUERY_ACK/child`` (``attempt >= 0``)      search serving (a child took a
                                                              QUERY_DOWN)
``HEARTBEAT_ACK`` ``HEARTBEAT_ACK/leaf`` (``cluster.level``   membership (the member's leaf)
                  ``== 1``)
                  ``HEARTBEAT_ACK/parent`` (level >= 2)       cluster links (a cluster's
                                                              parent)
``JOIN_ACCEPT``   ``JOIN_ACCEPT/member`` (no ``item_id``)     membership (a node joined)
                  ``JOIN_ACCEPT/cluster`` (``item_id`` set)   join placement (a cluster
                                                              re-attached)
================  ==========================================  ===============================

All other kinds route by their ``KIND``. :class:`Dispatcher` refuses a table with two owners
for one key, and a message whose key has no owner is counted (``rejected.unowned_kind`` and
``unowned.<key>``; the first reaches ``peerlm_overlay_rejected_messages_total{stage="core",
reason="unowned_kind"}``) and dropped. The table is a plain mapping rather than an h11-style
state machine: ownership does not depend on a connection state here (each component checks
its own per-cluster or per-query state), so a state dimension would add nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from peerlm.overlay.messages import MESSAGE_TYPES, HeartbeatAck, JoinAccept, QueryAck

__all__ = ["ROUTING_KEYS", "Dispatcher", "Route", "route_key"]

Handler = Callable[[str, Any], None]
"""``(authenticated sender id, message) -> None``; the handler counts its own rejections."""

_SPLIT_KEYS: dict[str, tuple[str, ...]] = {
    QueryAck.KIND: ("QUERY_ACK/root", "QUERY_ACK/child"),
    HeartbeatAck.KIND: ("HEARTBEAT_ACK/leaf", "HEARTBEAT_ACK/parent"),
    JoinAccept.KIND: ("JOIN_ACCEPT/member", "JOIN_ACCEPT/cluster"),
}

ROUTING_KEYS: frozenset[str] = frozenset(
    key for kind in MESSAGE_TYPES for key in _SPLIT_KEYS.get(kind, (kind,))
)
"""Every routing key a node must own: one per kind, two for the kinds split above."""


def route_key(msg: object) -> str:
    """The routing key of ``msg``: its ``KIND``, or ``KIND/<conversation>`` for the three
    kinds that two components receive (decided by the message's own fields)."""
    if isinstance(msg, QueryAck):
        return "QUERY_ACK/root" if msg.attempt < 0 else "QUERY_ACK/child"
    if isinstance(msg, HeartbeatAck):
        return "HEARTBEAT_ACK/leaf" if msg.cluster.level == 1 else "HEARTBEAT_ACK/parent"
    if isinstance(msg, JoinAccept):
        return "JOIN_ACCEPT/member" if msg.item_id is None else "JOIN_ACCEPT/cluster"
    kind = getattr(type(msg), "KIND", None)
    return kind if isinstance(kind, str) else type(msg).__name__


@dataclass(frozen=True, slots=True)
class Route:
    """One row of the table: a routing key, the component that owns it, its handler."""

    key: str
    owner: str
    handler: Handler


class Dispatcher:
    """Routes each message to its one owner; counts and drops what nobody owns.

    Args:
        routes: the table; two rows with the same key raise ``ValueError``.
        on_unowned: called with the routing key of a message nobody owns (count it).
    """

    def __init__(self, routes: Iterable[Route], on_unowned: Callable[[str], None]) -> None:
        table: dict[str, Route] = {}
        for route in routes:
            if route.key in table:
                raise ValueError(
                    f"{route.key} has two owners: {table[route.key].owner} and {route.owner}"
                )
            table[route.key] = route
        self._table = table
        self._on_unowned = on_unowned

    @property
    def owners(self) -> Mapping[str, str]:
        """Routing key -> owning component (read-only)."""
        return MappingProxyType({key: route.owner for key, route in self._table.items()})

    def dispatch(self, src: str, msg: object) -> bool:
        """Hand ``msg`` from ``src`` to its owner; ``False`` if nobody owns its key."""
        key = route_key(msg)
        route = self._table.get(key)
        if route is None:
            self._on_unowned(key)
            return False
        route.handler(src, msg)
        return True
