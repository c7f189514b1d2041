"""The overlay core's dispatch table: one owner per message kind, unowned kinds counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
from peerlm.overlay.dispatch import ROUTING_KEYS, Dispatcher, Route, route_key
from peerlm.overlay.messages import (
    MESSAGE_TYPES,
    ClusterDescriptor,
    Heartbeat,
    HeartbeatAck,
    JoinAccept,
    NodeRef,
    QueryAck,
)
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.signature import make_signature


@dataclass(frozen=True, slots=True)
class _Bogus:
    """A kind the node does not know (as if a newer peer sent it)."""

    KIND: ClassVar[str] = "BOGUS"
    qid: str


def _node() -> OverlayNode:
    return OverlayNode("a", "addr", OverlayParams(genesis_time=0.0), b"\x01" * 32)


def _descriptor(level: int) -> ClusterDescriptor:
    w = np.linspace(-1, 1, 32)
    sig = make_signature(w, np.abs(w), 4, "s")
    return ClusterDescriptor(
        f"0.{level}.b.0", level, "b", sig, (NodeRef("b", "x"),), (1,), 3, f"0.{level}.b", 0
    )


def test_every_message_kind_has_exactly_one_owner() -> None:
    owners = _node().message_owners
    assert set(owners) == ROUTING_KEYS
    for kind in MESSAGE_TYPES:
        keys = [key for key in ROUTING_KEYS if key.split("/")[0] == kind]
        assert keys, f"{kind} has no routing key"
        # A split kind goes to different components, never twice to the same one.
        assert len({owners[key] for key in keys}) == len(keys)


def test_split_kinds_are_decided_by_the_message_alone() -> None:
    assert route_key(QueryAck("q", "c", -1)) == "QUERY_ACK/root"
    assert route_key(QueryAck("q", "c", 0)) == "QUERY_ACK/child"
    assert route_key(HeartbeatAck(0, _descriptor(1))) == "HEARTBEAT_ACK/leaf"
    assert route_key(HeartbeatAck(0, _descriptor(2))) == "HEARTBEAT_ACK/parent"
    assert route_key(JoinAccept(0, _descriptor(1), None)) == "JOIN_ACCEPT/member"
    assert route_key(JoinAccept(0, _descriptor(2), None, "0.1.c.0")) == "JOIN_ACCEPT/cluster"
    assert route_key(Heartbeat(0, "c")) == "HEARTBEAT"
    owners = _node().message_owners
    assert owners["QUERY_ACK/root"] == "querier"
    assert owners["QUERY_ACK/child"] == "search"
    assert owners["HEARTBEAT_ACK/leaf"] == "membership"
    assert owners["HEARTBEAT_ACK/parent"] == "roles.links"
    assert owners["JOIN_ACCEPT/member"] == "membership"
    assert owners["JOIN_ACCEPT/cluster"] == "roles.placement"


def test_a_second_owner_for_one_key_is_refused() -> None:
    def handler(src: str, msg: Any) -> None:
        pass

    with pytest.raises(ValueError, match="HEARTBEAT has two owners: links and search"):
        Dispatcher(
            [Route("HEARTBEAT", "links", handler), Route("HEARTBEAT", "search", handler)], print
        )


def test_dispatcher_drops_and_reports_an_unowned_key() -> None:
    seen: list[tuple[str, object]] = []
    unowned: list[str] = []
    dispatcher = Dispatcher(
        [Route("HEARTBEAT", "links", lambda src, msg: seen.append((src, msg)))], unowned.append
    )
    assert dispatcher.dispatch("b", Heartbeat(0, "c")) is True
    assert dispatcher.dispatch("b", QueryAck("q", "c", -1)) is False
    assert seen == [("b", Heartbeat(0, "c"))]
    assert unowned == ["QUERY_ACK/root"]


def test_a_node_counts_and_drops_an_unowned_kind() -> None:
    node = _node()
    before = node.describe()
    assert node.on_message("b", _Bogus("q"), 0.5) == []
    assert node.counters["rejected.unowned_kind"] == 1
    assert node.counters["unowned.BOGUS"] == 1
    assert node.counters["rejected_kind.BOGUS"] == 1
    assert node.describe() == before


def test_each_half_of_a_split_kind_rejects_in_its_owner() -> None:
    node = _node()
    # A child's ack for a query this node never sent down: search serving rejects it.
    node.on_message("b", QueryAck("q", "c", 0), 0.5)
    assert node.counters["rejected.unknown_query"] == 1
    # A root's ack for a query this node never asked: the querier ignores it silently.
    node.on_message("b", QueryAck("q", "c", -1), 0.5)
    assert node.counters["rejected"] == 1
    # A parent's ack (level 2) for a cluster this node holds no role in.
    node.on_message("b", HeartbeatAck(0, _descriptor(2)), 0.5)
    # A cluster re-attach accepted for a cluster this node does not hold.
    node.on_message("b", JoinAccept(0, _descriptor(2), None, "0.1.c.0"), 0.5)
    assert node.counters["rejected.unknown_cluster"] == 2
    assert node.counters["rejected"] == 3
