"""The sans-IO node: determinism, API errors, and rejection of invalid input."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from peerlm.overlay import vrf
from peerlm.overlay.events import QueryCompleted
from peerlm.overlay.messages import (
    MESSAGE_TYPES,
    ElectionTicket,
    Heartbeat,
    NodeRef,
    QueryDown,
    Register,
    SignatureUpdate,
    SigReply,
    VrfTicket,
    signature_wire_size,
    wire_size,
)
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.signature import make_signature

from tests.overlay_harness import Federation, federation


def _run(seed: int) -> tuple[list[tuple[float, str, str]], Federation]:
    fed = federation(40, seed=seed, zone_cap=8)
    fed.build()
    fed.query_all(5)
    fed.query_all(5)
    trace = [(round(t, 9), n, repr(ev)) for t, n, ev in fed.sim.events]
    return trace, fed


def test_same_seed_same_run() -> None:
    first, fed_a = _run(11)
    second, fed_b = _run(11)
    assert first == second
    assert fed_a.sim.kind_messages == fed_b.sim.kind_messages
    other, _ = _run(12)
    assert other != first


def _leaf(fed: Federation) -> tuple[str, str, str]:
    """(cluster id, its primary, another member)."""
    for cid, nid in sorted(fed.primaries().items()):
        role = fed.sim.nodes[nid].roles.roles[cid]
        plain = [m for m in sorted(role.members) if m != nid]
        if role.level == 1 and plain:
            return cid, nid, plain[0]
    raise AssertionError("no leaf with two members")


def _snapshot(node: OverlayNode) -> object:
    return (
        dict(node.describe()),
        copy.deepcopy(
            {
                cid: (r.descriptor, sorted(r.members), sorted(r.children), r.term)
                for cid, r in node.roles.roles.items()
            }
        ),
        {k: (z.initiator, z.best, sorted(z.members)) for k, z in node.zones.levels.items()},
    )


def _assert_rejected(node: OverlayNode, src: str, msg: object, reason: str, now: float) -> None:
    before = _snapshot(node)
    count = node.counters[f"rejected.{reason}"]
    sends = node.on_message(src, msg, now)  # type: ignore[arg-type]
    assert sends == []
    assert node.counters[f"rejected.{reason}"] == count + 1, dict(node.counters)
    assert _snapshot(node) == before


def test_invalid_messages_are_rejected_without_a_trace() -> None:
    fed = federation(40, seed=13, zone_cap=8)
    fed.build()
    cid, primary_id, member = _leaf(fed)
    node = fed.sim.nodes[primary_id]
    now = fed.sim.now
    # wrong epoch
    _assert_rejected(node, member, Heartbeat(9, cid), "wrong_epoch", now)
    # message from a node that is not a member of the cluster
    outsider = next(n for n in sorted(fed.sim.nodes) if n not in node.roles.roles[cid].members)
    _assert_rejected(node, outsider, Heartbeat(0, cid), "not_member", now)
    sig = fed.members[outsider].signature
    _assert_rejected(node, outsider, SignatureUpdate(0, cid, sig, 5), "not_member", now)
    # forged VRF proof: a flipped byte, and a key that is not the sender's
    honest = fed.sim.nodes[member].ctx.ticket(0)
    forged = VrfTicket(
        honest.node_id, honest.public_key, bytes([honest.proof[0] ^ 1]) + honest.proof[1:]
    )
    _assert_rejected(node, member, ElectionTicket(0, 1, forged, 1), "bad_ticket", now)
    stranger_key = vrf.public_key(b"\x07" * 32)
    stolen = VrfTicket(member, stranger_key, vrf.prove(b"\x07" * 32, fed.params.epoch_seed(0)))
    _assert_rejected(node, member, ElectionTicket(0, 1, stolen, 1), "bad_ticket", now)
    # a registration sent to a node that is not an initiator at that level
    non_initiator = next(
        n
        for n in sorted(fed.sim.nodes)
        if not fed.sim.nodes[n].zones.level_state(0, 1).is_initiator  # type: ignore[union-attr]
    )
    target = fed.sim.nodes[non_initiator]
    register = Register(0, 1, NodeRef(member, "x"), honest, 1)
    _assert_rejected(target, member, register, "not_initiator", now)
    # a SigReply to a zone the sender is not in
    _assert_rejected(target, member, SigReply(0, 1, "0.1.nobody"), "not_initiator", now)
    # malformed query fields
    down = QueryDown("q", 0, cid, member, sig, 0, 0.5, 0, NodeRef(member, "x"), 1.0)
    _assert_rejected(node, member, down, "bad_field", now)
    down = dataclasses.replace(down, k=5, reply_to=NodeRef("someone-else", "x"))
    _assert_rejected(node, member, down, "bad_field", now)


def test_api_errors() -> None:
    params = OverlayParams(genesis_time=1000.0)  # no build within this test
    with pytest.raises(ValueError):
        OverlayNode("a", "addr", params, b"short")
    with pytest.raises(ValueError):
        OverlayNode("", "addr", params, b"\x01" * 32)
    with pytest.raises(ValueError):
        OverlayParams(zone_cap=1)
    node = OverlayNode("a", "addr", params, b"\x01" * 32)
    with pytest.raises(ValueError):
        node.start_query(3, 0.0)
    w = np.linspace(-1, 1, 64)
    node.set_signature(make_signature(w, np.abs(w), 8, "s"), 0.0)
    with pytest.raises(ValueError):
        node.start_query(0, 0.0)
    with pytest.raises(ValueError):
        node.on_tick(-1.0)
    qid, _ = node.start_query(3, 0.1)
    # Without any overlay the soft barrier still answers, incomplete and empty.
    node.on_tick(0.1 + params.query_timeout)
    done = [ev for ev in node.pop_events() if isinstance(ev, QueryCompleted)]
    assert [(ev.qid, ev.complete, ev.results) for ev in done] == [(qid, False, ())]
    node.leave(10.0)
    assert node.describe()["role"] == "left"
    assert node.on_message("b", Heartbeat(0, "c"), 10.1) == []
    assert node.counters["rejected.inert"] == 1


def test_message_catalogue_and_sizes() -> None:
    assert len(MESSAGE_TYPES) == len({cls.KIND for cls in MESSAGE_TYPES.values()})
    w = np.linspace(-1, 1, 100)
    sig = make_signature(w, np.abs(w), 10, "space")
    assert signature_wire_size(sig) == len(sig.to_bytes())
    small = wire_size(Heartbeat(0, "c"))
    big = wire_size(SignatureUpdate(0, "c", sig, 1))
    assert 0 < small < big
    assert big - small >= len(sig.to_bytes())


def test_describe_reports_zone_sizes_and_readiness() -> None:
    fed = federation(40, seed=5, zone_cap=8)
    before = fed.sim.nodes[next(iter(fed.sim.alive))].describe()
    assert before["ready"] is False and before["zone_size"] == 0
    fed.build()
    described = [fed.sim.nodes[n].describe() for n in fed.sim.alive]
    assert all(d["ready"] for d in described)
    initiators = [d for d in described if 1 in d["initiator_levels"]]
    # Every node lies in exactly one level-1 zone; only its initiator reports the size.
    assert sum(d["zone_size"] for d in initiators) == len(described)
    assert all(d["zone_size"] == 0 for d in described if d not in initiators)


def test_every_node_learns_the_network_p_with_the_epoch() -> None:
    fed = federation(40, seed=6, zone_cap=8)
    fed.build()
    announced = {fed.sim.nodes[n].describe()["network_p"] for n in fed.sim.alive}
    assert len(announced) == 1
    (p,) = announced
    assert isinstance(p, int) and p >= 1


def test_an_unplaced_initiator_still_reports_its_zone() -> None:
    """A node without a signature is never placed but may be elected to lead a zone."""
    fed = federation(30, seed=7, zone_cap=6)
    fed.build()
    leaders = [n for n in fed.sim.alive if 1 in fed.sim.nodes[n].describe()["initiator_levels"]]
    victim = leaders[0]
    node = fed.sim.nodes[victim]
    node.membership.views.clear()  # as if it had never been placed
    described = node.describe()
    assert described["zone_size"] >= 1
    assert described["epoch"] == 0 and described["ready"] is False
