"""The simulator's and the core's shortcuts give exactly what the plain computation gives.

Each shortcut (they bring N = 10,000 within minutes) must leave a run unchanged bit for
bit: the message sizes, and the primary's skipped prototype refreshes and backfill scans.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from enum import IntEnum
from typing import Any

import numpy as np
import pytest
from peerlm.overlay import cluster_upkeep
from peerlm.overlay.cluster_upkeep import PrimaryUpkeep
from peerlm.overlay.events import Send
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.messages import Heartbeat, Message, NodeRef, PeerExchange, wire_size
from peerlm.overlay.signature import Signature, make_signature, prototype

from tests.overlay_harness import Federation, federation


def _reference_size(value: Any) -> int:
    """The wire-size definition written out plainly (the code before the fast paths)."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, int | float):
        return 8
    if isinstance(value, str):
        return 2 + len(value.encode())
    if isinstance(value, bytes):
        return 2 + len(value)
    if isinstance(value, tuple):
        return 2 + sum(_reference_size(v) for v in value)
    if hasattr(value, "indices") and hasattr(value, "space"):
        return 2 + 20 + len(value.space) + 6 * int(value.p)
    assert dataclasses.is_dataclass(value)
    return 2 + sum(_reference_size(getattr(value, f.name)) for f in dataclasses.fields(value))


def _reference_wire_size(msg: Message) -> int:
    return _reference_size(msg) - 2 + 16


def _recorded_run(seed: int, churn: bool) -> tuple[Federation, list[Message]]:
    fed = federation(40, seed=seed, zone_cap=8)
    sent: list[Message] = []
    deliver = fed.sim.deliver

    def recording(src: str, sends: list[Send]) -> None:
        sent.extend(s.msg for s in sends)
        deliver(src, sends)

    fed.sim.deliver = recording  # type: ignore[method-assign]
    fed.build()
    fed.query_all(5)
    if churn:
        # New signatures (members' entries change), two dropouts (members and maybe
        # replicas go silent), then queries again.
        assert fed.population is not None
        fresh = fed.population.draw(10)
        for nid, member in zip(sorted(fed.sim.alive)[:10], fresh, strict=True):
            fed.sim.call(
                nid, lambda node, m=member: node.set_signature(m.signature, fed.sim.now, m.p_min)
            )
        for nid in sorted(fed.sim.alive)[-2:]:
            fed.sim.kill(nid)
        fed.sim.run_until(fed.sim.now + 8.0)
        fed.query_all(5)
    return fed, sent


def test_wire_size_equals_the_plain_definition_on_every_message_of_a_run() -> None:
    _, sent = _recorded_run(3, churn=True)
    assert len({type(m) for m in sent}) >= 15  # the run exercised most message kinds
    memo: dict[int, tuple[object, int]] = {}
    for msg in sent:
        assert wire_size(msg, memo) == _reference_wire_size(msg) == wire_size(msg)


class _Small(IntEnum):
    ONE = 1


class _Name(str):
    pass


@dataclasses.dataclass
class _Mutable:
    name: str
    count: int


@dataclasses.dataclass(frozen=True)
class _Odd:
    """Values off the exact-type fast paths: subclasses, non-ASCII text, a mutable record."""

    KIND = "ODD"
    level: _Small
    name: _Name
    text: str
    stats: _Mutable
    ratio: float
    blob: bytes
    refs: tuple[NodeRef, ...]


def test_wire_size_of_subclasses_and_non_ascii_text() -> None:
    w = np.linspace(-1, 1, 64)
    sig = make_signature(w, np.abs(w), 8, "space")
    msgs: list[Any] = [
        _Odd(
            _Small.ONE, _Name("n1"), "zoné ✓", _Mutable("x", 3), 0.5, b"abc", (NodeRef("a", "b"),)
        ),
        Heartbeat(0, "cluster-é"),
        PeerExchange(NodeRef("n0", "sim://n0"), (NodeRef("n1", "sim://n1"),) * 3, want_reply=True),
    ]
    for msg in msgs:
        assert wire_size(msg) == _reference_wire_size(msg)
    assert _reference_size(sig) == 2 + len(sig.to_bytes())


def test_unsizable_values_are_refused() -> None:
    with pytest.raises(TypeError, match="no wire size"):
        wire_size(Heartbeat(0, object()))  # type: ignore[arg-type]


def _trace(fed: Federation) -> tuple[list[tuple[float, str, str]], dict[str, int]]:
    events = [(t, n, repr(ev)) for t, n, ev in fed.sim.events]
    return events, dict(fed.sim.kind_bytes)


@pytest.mark.parametrize("churn", [False, True])
def test_skipped_prototype_refreshes_change_nothing(
    monkeypatch: pytest.MonkeyPatch, churn: bool
) -> None:
    computed = Counter[str]()
    run = "fast"

    def counted(sigs: list[Signature], p: int) -> Signature:
        computed[run] += 1
        return prototype(sigs, p)

    monkeypatch.setattr(cluster_upkeep, "prototype", counted)
    fast, _ = _recorded_run(5, churn)
    refresh = PrimaryUpkeep._refresh_prototype

    def always(self: PrimaryUpkeep, role: ClusterRole) -> None:
        role.prototype_checked = None  # forget the memo: every refresh recomputes
        refresh(self, role)

    monkeypatch.setattr(PrimaryUpkeep, "_refresh_prototype", always)
    run = "slow"
    slow, _ = _recorded_run(5, churn)
    # The memo skipped most refreshes, and the runs are the same.
    assert 0 < computed["fast"] < computed["slow"] / 2
    assert _trace(fast) == _trace(slow)
    described = [fast.sim.nodes[n].describe() for n in sorted(fast.sim.alive)]
    assert described == [slow.sim.nodes[n].describe() for n in sorted(slow.sim.alive)]


def _level1_primary(fed: Federation) -> tuple[PrimaryUpkeep, ClusterRole]:
    for nid in sorted(fed.sim.alive):
        node = fed.sim.nodes[nid]
        for role in node.roles.roles.values():
            if role.level == 1 and node.roles.is_primary(role) and len(role.members) > 2:
                return node.roles.upkeep, role
    raise AssertionError("no level-1 primary with members")


def test_a_changed_input_or_descriptor_prototype_refreshes_again() -> None:
    fed = federation(40, seed=2, zone_cap=8)
    fed.build()
    upkeep, role = _level1_primary(fed)
    upkeep._refresh_prototype(role)
    assert role.prototype_checked is not None
    version = role.descriptor.version
    upkeep._refresh_prototype(role)  # same inputs: nothing to push
    assert role.descriptor.version == version
    # The descriptor's prototype replaced by a far one: the refresh pushes the members' own.
    far = next(iter(role.members.values())).signature
    assert far is not None
    flipped = dataclasses.replace(far, values=-far.values)
    role.descriptor = dataclasses.replace(role.descriptor, prototype=flipped)
    upkeep._refresh_prototype(role)
    assert role.descriptor.version == version + 1
    assert role.descriptor.prototype is not flipped
    assert role.prototype_checked is None
    # A member's signature replaced (an equal copy is a new object): recomputed, and equal
    # inputs push nothing.
    upkeep._refresh_prototype(role)
    checked = role.prototype_checked
    assert checked is not None
    nid, entry = next(iter(role.members.items()))
    assert entry.signature is not None
    copy = dataclasses.replace(entry.signature)
    role.members[nid] = dataclasses.replace(entry, signature=copy)
    upkeep._refresh_prototype(role)
    assert role.prototype_checked is not None and role.prototype_checked is not checked
    assert role.prototype_checked[0][0] is copy
    assert role.descriptor.version == version + 1
