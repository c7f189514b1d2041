"""Zone formation (SemanticDFL Sec. 3.3.1, App. B.2, Alg. 2-3), one level at a time.

Per epoch ``e`` and level ``l`` every participant (all peers at level 1; the level-``(l-1)``
zone initiators above) runs on a fixed schedule (``OverlayParams.level_phases``):

1. **Election** (Alg. 2). Each participant floods its VRF ticket ``sigma_p =
   VRF_p(seed(e))`` at most ``R`` hops over the level's graph (the physical neighbour graph
   at level 1, the zone-adjacency graph above). A relay forwards a ticket only if no ticket
   it already forwarded is both lower and fewer hops away, so every node learns the minimum
   ``(sigma, id)`` of its ``R``-hop ball with ``O(R |E|)`` messages. A node whose own ticket
   is that minimum becomes an initiator.
2. **Probe wave** (Alg. 3). Initiators flood a PROBE with TTL ``R``; a NOT_ASSIGNED peer
   adopts the first valid probe, REGISTERs with its initiator and forwards while TTL > 0; an
   assigned peer sends NEIGHBOR notices to both initiators (zone adjacency, the next
   level's graph).
3. **Borders and orphans** (our addition). Once the wave is over every assigned participant
   tells its graph neighbours its zone (ZONE_INFO). A neighbour in another zone then sends
   NEIGHBOR notices to both initiators, so every border edge is reported (probes alone miss
   borders where both waves ran out of TTL, and a zone with no known neighbour would wrongly
   conclude it is the whole network). A peer no probe reached (its ball's minimum was not an
   initiator) registers with the best zone it hears of (fewest hops, then lowest VRF),
   asking its neighbours again in later passes; after ``orphan_passes`` passes with no
   answer it seeds a zone of its own. The paper leaves such peers to the next epoch.
4. **Split** after the diameter timeout: a zone over ``S_Z`` is cut deterministically in BFS
   order (probe hops, then registration order) into ``ceil(n / S_Z)`` balanced chunks; the
   initiator keeps the first, and each other chunk goes to its lowest-VRF member, which
   re-probes those members as a new zone. (The paper hands the whole remainder to the next
   lowest VRF, which splits again; cutting all chunks at once needs one hand-off instead of
   a chain of ``n / S_Z``.) Registrations that arrive after the split are accepted only while
   the zone is below ``S_Z``.
5. **SigProbe** collects what the initiator clusters: signatures at level 1, the
   participants' level-``(l-1)`` cluster descriptors above.
6. **Clustering and publication** (:mod:`peerlm.overlay.hierarchy`): descriptors ``CD_j`` go
   to each replica set (CLUSTER_STATE), members learn their leaf cluster (MEMBER_ASSIGN),
   children learn their parent (PARENT_UPDATE). An initiator whose zone has no adjacent zone
   at this level is alone: its clusters are the whole network's, so it closes the hierarchy
   (a root over at most ``S_Z`` clusters, or one more level) and sends EPOCH_ANNOUNCE to the
   root's replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from peerlm.overlay.context import NodeContext
from peerlm.overlay.events import RoleChanged
from peerlm.overlay.hierarchy import (
    FormedCluster,
    form_inner_clusters,
    form_leaf_clusters,
    form_root,
    zone_id_of,
)
from peerlm.overlay.messages import (
    ClusterDescriptor,
    ClusterState,
    ElectionTicket,
    EpochAnnounce,
    MemberAssign,
    MemberEntry,
    Neighbor,
    NodeRef,
    ParentUpdate,
    Probe,
    Register,
    SigProbe,
    SigReply,
    Split,
    VrfTicket,
    ZoneInfo,
    ZoneInfoRequest,
    ZoneMember,
)
from peerlm.overlay.signature import network_p

__all__ = ["ZoneFormation", "ZoneLevel", "balanced_chunks", "bfs_order", "sample_order_stats"]

Key = tuple[int, str]
_P_SAMPLE = 256


def bfs_order(
    members: Sequence[ZoneMember], seq: dict[str, int], initiator: str
) -> list[ZoneMember]:
    """Zone members in BFS order: the initiator, then by probe hops, then registration order."""
    return sorted(
        members,
        key=lambda m: (m.ref.node_id != initiator, m.hops, seq.get(m.ref.node_id, 0)),
    )


def balanced_chunks(items: Sequence[ZoneMember], cap: int) -> list[list[ZoneMember]]:
    """Cut ``items`` (in order) into ``ceil(n / cap)`` consecutive chunks of near-equal size."""
    n = len(items)
    if n <= cap:
        return [list(items)]
    parts = math.ceil(n / cap)
    base, extra = divmod(n, parts)
    chunks: list[list[ZoneMember]] = []
    start = 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        chunks.append(list(items[start : start + size]))
        start += size
    return chunks


def sample_order_stats(values: Sequence[int], limit: int = _P_SAMPLE) -> tuple[int, ...]:
    """At most ``limit`` evenly spaced order statistics of ``values`` (bounded P_min reports)."""
    ordered = sorted(values)
    if len(ordered) <= limit:
        return tuple(ordered)
    step = (len(ordered) - 1) / (limit - 1)
    return tuple(ordered[round(i * step)] for i in range(limit))


@dataclass(slots=True)
class ZoneLevel:
    """One node's state in the zone formation of one (epoch, level)."""

    epoch: int
    level: int
    graph: dict[str, NodeRef]
    my_key: Key
    best: Key
    forwarded: list[tuple[Key, int]] = field(default_factory=list)
    initiator: NodeRef | None = None
    initiator_ticket: VrfTicket | None = None
    initiator_key: Key | None = None
    hops: int = 0
    is_initiator: bool = False
    notified: set[str] = field(default_factory=set)
    # initiator side
    zone_id: str = ""
    members: dict[str, ZoneMember] = field(default_factory=dict)
    member_scores: dict[str, int] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)
    adjacent: dict[str, NodeRef] = field(default_factory=dict)
    split_done: bool = False
    finalized: bool = False
    replies: dict[str, SigReply] = field(default_factory=dict)
    # orphan side
    answers: list[tuple[int, Key, NodeRef, VrfTicket]] = field(default_factory=list)
    # output of this level (as initiator): the clusters formed, the P_min sample
    formed: tuple[ClusterDescriptor, ...] = ()
    p_mins: tuple[int, ...] = ()
    closed: bool = False


class ZoneFormation:
    """The zone-formation component of a node (all epochs and levels)."""

    def __init__(
        self,
        ctx: NodeContext,
        neighbours: Callable[[], dict[str, NodeRef]],
        on_roles_changed: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self._neighbours = neighbours
        self._roles_changed = on_roles_changed
        self.levels: dict[tuple[int, int], ZoneLevel] = {}
        self.clustering_methods: list[str] = []

    # ------------------------------------------------------------------ schedule
    def schedule_epoch(self, epoch: int) -> None:
        """Arm the level-1 timers of ``epoch``'s build."""
        self.ctx.at(self.ctx.params.level_start(epoch, 1), lambda: self._begin(epoch, 1, None))

    def _begin(self, epoch: int, level: int, graph: dict[str, NodeRef] | None) -> None:
        if self.ctx.inert:
            return
        zl = self._ensure(epoch, level, graph)
        if zl is None:
            return
        params = self.ctx.params
        start = params.level_start(epoch, level)
        phases = params.level_phases
        self._broadcast(zl, ElectionTicket(epoch, level, self.ctx.ticket(epoch), 1), exclude=())
        self.ctx.at(start + phases["probe"], lambda: self._probe_phase(zl))
        for i in range(params.orphan_passes):
            at = start + phases["orphan"] + 2 * params.hop_time * i
            self.ctx.at(at, lambda i=i: self._orphan_pass(zl, i))  # type: ignore[misc]
        self.ctx.at(start + phases["split"], lambda: self._split_phase(zl))
        self.ctx.at(start + phases["sigprobe"], lambda: self._sigprobe_phase(zl))
        self.ctx.at(start + phases["cluster"], lambda: self._cluster_phase(zl))

    def _ensure(
        self, epoch: int, level: int, graph: dict[str, NodeRef] | None = None
    ) -> ZoneLevel | None:
        """The state of (epoch, level), created if this node takes part in it."""
        zl = self.levels.get((epoch, level))
        if zl is not None:
            return zl
        if level == 1:
            graph = dict(self._neighbours()) if graph is None else graph
        else:
            below = self.levels.get((epoch, level - 1))
            if below is None or not below.is_initiator or below.closed:
                return None
            if graph is None:
                graph = dict(below.adjacent)
        if epoch < self.ctx.params.epoch_of(self.ctx.now) - 1:
            return None
        key = (self.ctx.score(epoch), self.ctx.node_id)
        zl = ZoneLevel(epoch, level, graph, key, key, forwarded=[(key, 0)])
        self.levels[(epoch, level)] = zl
        return zl

    def _broadcast(
        self, zl: ZoneLevel, msg: ElectionTicket | Probe, exclude: Sequence[str]
    ) -> None:
        for nid, ref in zl.graph.items():
            if nid not in exclude:
                self.ctx.send(ref, msg)

    def level_state(self, epoch: int, level: int) -> ZoneLevel | None:
        return self.levels.get((epoch, level))

    def forget_before(self, epoch: int) -> None:
        for key in [k for k in self.levels if k[0] < epoch]:
            del self.levels[key]

    # ------------------------------------------------------------------ election
    def on_election(self, src: str, msg: ElectionTicket) -> None:
        zl = self._ensure(msg.epoch, msg.level)
        if zl is None:
            self.ctx.reject("not_participant")
            return
        if not 1 <= msg.hops <= self.ctx.params.ttl_radius:
            self.ctx.reject("bad_field")
            return
        score = self.ctx.verify_ticket(msg.ticket, msg.epoch)
        if score is None:
            self.ctx.reject("bad_ticket")
            return
        key = (score, msg.ticket.node_id)
        zl.best = min(zl.best, key)
        if msg.hops >= self.ctx.params.ttl_radius:
            return
        if any(k <= key and h <= msg.hops for k, h in zl.forwarded):
            return
        zl.forwarded.append((key, msg.hops))
        relay = ElectionTicket(msg.epoch, msg.level, msg.ticket, msg.hops + 1)
        self._broadcast(zl, relay, exclude=(src, msg.ticket.node_id))

    # ------------------------------------------------------------------ probe wave
    def _become_initiator(self, zl: ZoneLevel) -> None:
        zl.is_initiator = True
        zl.initiator = self.ctx.ref
        zl.initiator_ticket = self.ctx.ticket(zl.epoch)
        zl.initiator_key = zl.my_key
        zl.hops = 0
        zl.zone_id = zone_id_of(zl.epoch, zl.level, self.ctx.node_id)
        zl.members = {self.ctx.node_id: ZoneMember(self.ctx.ref, zl.initiator_ticket, 0)}
        zl.member_scores = {self.ctx.node_id: zl.my_key[0]}
        zl.seq = {self.ctx.node_id: 0}
        self.ctx.counters["zone.initiator"] += 1
        self._roles_changed()

    def _probe_phase(self, zl: ZoneLevel) -> None:
        if self.ctx.inert or zl.initiator is not None or zl.best != zl.my_key:
            return
        self._become_initiator(zl)
        ttl = self.ctx.params.ttl_radius - 1
        probe = Probe(zl.epoch, zl.level, self.ctx.ref, self.ctx.ticket(zl.epoch), ttl, 1)
        self._broadcast(zl, probe, exclude=())

    def on_probe(self, src: str, msg: Probe) -> None:
        zl = self._ensure(msg.epoch, msg.level)
        if zl is None:
            self.ctx.reject("not_participant")
            return
        if msg.ttl < 0 or msg.hops < 1 or msg.ttl >= self.ctx.params.ttl_radius:
            self.ctx.reject("bad_field")
            return
        score = self.ctx.verify_ticket(msg.ticket, msg.epoch, msg.initiator.node_id)
        if score is None:
            self.ctx.reject("bad_ticket")
            return
        key = (score, msg.initiator.node_id)
        if msg.handed_by is not None:
            self._on_handed_probe(src, zl, msg, key)
            return
        if zl.initiator is None:
            zl.initiator, zl.initiator_ticket, zl.initiator_key = msg.initiator, msg.ticket, key
            zl.hops = msg.hops
            self.ctx.send(
                msg.initiator,
                Register(msg.epoch, msg.level, self.ctx.ref, self.ctx.ticket(msg.epoch), msg.hops),
            )
            if msg.ttl > 0:
                relay = Probe(
                    msg.epoch, msg.level, msg.initiator, msg.ticket, msg.ttl - 1, msg.hops + 1
                )
                self._broadcast(zl, relay, exclude=(src, msg.initiator.node_id))
            return
        self._border(zl, msg.initiator, msg.ticket)

    def _on_handed_probe(self, src: str, zl: ZoneLevel, msg: Probe, key: Key) -> None:
        if src != msg.initiator.node_id:
            self.ctx.reject("not_member")
            return
        if zl.initiator is None or zl.initiator.node_id != msg.handed_by or zl.is_initiator:
            self.ctx.reject("not_member")
            return
        zl.initiator, zl.initiator_ticket, zl.initiator_key = msg.initiator, msg.ticket, key

    def on_register(self, src: str, msg: Register) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None or not zl.is_initiator:
            self.ctx.reject("not_initiator")
            return
        if msg.member.node_id != src or msg.hops < 1:
            self.ctx.reject("bad_field")
            return
        score = self.ctx.verify_ticket(msg.ticket, msg.epoch, src)
        if score is None:
            self.ctx.reject("bad_ticket")
            return
        if src in zl.members:
            return
        if zl.finalized or (zl.split_done and len(zl.members) >= self.ctx.params.zone_cap):
            self.ctx.reject("zone_closed")
            return
        zl.members[src] = ZoneMember(msg.member, msg.ticket, msg.hops)
        zl.member_scores[src] = score
        zl.seq[src] = len(zl.seq)

    def on_neighbor(self, src: str, msg: Neighbor) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None or not zl.is_initiator:
            self.ctx.reject("not_initiator")
            return
        if self.ctx.verify_ticket(msg.ticket, msg.epoch, msg.initiator.node_id) is None:
            self.ctx.reject("bad_ticket")
            return
        if msg.initiator.node_id != self.ctx.node_id:
            zl.adjacent[msg.initiator.node_id] = msg.initiator

    # ------------------------------------------------------------------ orphans
    def _announce_zone(self, zl: ZoneLevel) -> None:
        """Tell the level's graph neighbours which zone we are in: orphans adopt from it,
        and a neighbour in another zone reports the border (probes alone miss borders
        where both waves ran out of TTL)."""
        if zl.initiator is None or zl.initiator_ticket is None:
            return
        info = ZoneInfo(zl.epoch, zl.level, zl.initiator, zl.initiator_ticket, zl.hops)
        for ref in zl.graph.values():
            self.ctx.send(ref, info)

    def _orphan_pass(self, zl: ZoneLevel, index: int) -> None:
        if self.ctx.inert:
            return
        if zl.initiator is not None:
            if index == 0:
                self._announce_zone(zl)
            return
        if zl.answers:
            hops, key, ref, ticket = min(zl.answers, key=lambda a: (a[0], a[1]))
            zl.initiator, zl.initiator_ticket, zl.initiator_key = ref, ticket, key
            zl.hops = hops + 1
            self.ctx.counters["zone.orphan_adopted"] += 1
            self.ctx.send(
                ref, Register(zl.epoch, zl.level, self.ctx.ref, self.ctx.ticket(zl.epoch), zl.hops)
            )
            self._announce_zone(zl)
            return
        if index == self.ctx.params.orphan_passes - 1:
            self.ctx.counters["zone.orphan_seeded"] += 1
            self._become_initiator(zl)
            self._announce_zone(zl)
            return
        for ref in zl.graph.values():
            self.ctx.send(ref, ZoneInfoRequest(zl.epoch, zl.level))

    def on_zone_info_request(self, src: str, msg: ZoneInfoRequest) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None:
            self.ctx.reject("not_participant")
            return
        ref = zl.graph.get(src)
        if ref is None:
            self.ctx.reject("not_neighbour")
            return
        self.ctx.send(
            ref, ZoneInfo(msg.epoch, msg.level, zl.initiator, zl.initiator_ticket, zl.hops)
        )

    def on_zone_info(self, src: str, msg: ZoneInfo) -> None:
        zl = self._ensure(msg.epoch, msg.level)
        if zl is None:
            self.ctx.reject("not_participant")
            return
        if msg.initiator is None or msg.ticket is None:
            return
        score = self.ctx.verify_ticket(msg.ticket, msg.epoch, msg.initiator.node_id)
        if score is None:
            self.ctx.reject("bad_ticket")
            return
        if zl.initiator is None:
            zl.answers.append((msg.hops, (score, msg.initiator.node_id), msg.initiator, msg.ticket))
            return
        self._border(zl, msg.initiator, msg.ticket)

    def _border(self, zl: ZoneLevel, other: NodeRef, other_ticket: VrfTicket) -> None:
        """We (in zone ``zl.initiator``) border zone ``other``: tell both initiators."""
        if zl.initiator is None or zl.initiator_ticket is None:
            return
        if other.node_id == zl.initiator.node_id or other.node_id in zl.notified:
            return
        zl.notified.add(other.node_id)
        self.ctx.send(zl.initiator, Neighbor(zl.epoch, zl.level, other, other_ticket))
        self.ctx.send(other, Neighbor(zl.epoch, zl.level, zl.initiator, zl.initiator_ticket))

    # ------------------------------------------------------------------ split
    def _split_phase(self, zl: ZoneLevel) -> None:
        if self.ctx.inert or not zl.is_initiator:
            return
        zl.split_done = True
        cap = self.ctx.params.zone_cap
        if len(zl.members) <= cap:
            return
        ordered = bfs_order(list(zl.members.values()), zl.seq, self.ctx.node_id)
        chunks = balanced_chunks(ordered, cap)
        self.ctx.counters["zone.splits"] += len(chunks) - 1
        for chunk in chunks[1:]:
            head = min(chunk, key=lambda m: (zl.member_scores[m.ref.node_id], m.ref.node_id))
            self.ctx.send(head.ref, Split(zl.epoch, zl.level, tuple(chunk), (self.ctx.ref,)))
            for m in chunk:
                del zl.members[m.ref.node_id]
            zl.adjacent[head.ref.node_id] = head.ref

    def on_split(self, src: str, msg: Split) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None or zl.initiator is None or zl.initiator.node_id != src or zl.is_initiator:
            self.ctx.reject("not_member")
            return
        if not msg.members or len(msg.members) > self.ctx.params.zone_cap:
            self.ctx.reject("bad_field")
            return
        ids = [m.ref.node_id for m in msg.members]
        if self.ctx.node_id not in ids or len(set(ids)) != len(ids):
            self.ctx.reject("bad_field")
            return
        scores: dict[str, int] = {}
        for m in msg.members:
            score = self.ctx.verify_ticket(m.ticket, msg.epoch, m.ref.node_id)
            if score is None:
                self.ctx.reject("bad_ticket")
                return
            scores[m.ref.node_id] = score
        self._become_initiator(zl)
        zl.split_done = True
        for i, m in enumerate(msg.members):
            zl.members[m.ref.node_id] = m
            zl.member_scores[m.ref.node_id] = scores[m.ref.node_id]
            zl.seq[m.ref.node_id] = i
        for ref in msg.neighbours:
            if ref.node_id != self.ctx.node_id:
                zl.adjacent[ref.node_id] = ref
        handed = Probe(
            zl.epoch, zl.level, self.ctx.ref, self.ctx.ticket(zl.epoch), 0, 1, handed_by=src
        )
        for m in msg.members:
            if m.ref.node_id != self.ctx.node_id:
                self.ctx.send(m.ref, handed)

    # ------------------------------------------------------------------ SigProbe
    def _sigprobe_phase(self, zl: ZoneLevel) -> None:
        if self.ctx.inert or not zl.is_initiator:
            return
        zl.finalized = True
        for nid, m in zl.members.items():
            if nid != self.ctx.node_id:
                self.ctx.send(m.ref, SigProbe(zl.epoch, zl.level, zl.zone_id))

    def _my_reply(self, zl: ZoneLevel, zone_id: str) -> SigReply:
        if zl.level == 1:
            p = (self.ctx.p_min,) if self.ctx.p_min is not None else ()
            return SigReply(zl.epoch, 1, zone_id, signature=self.ctx.signature, p_mins=p)
        below = self.levels.get((zl.epoch, zl.level - 1))
        items = below.formed if below is not None else ()
        p_mins = below.p_mins if below is not None else ()
        return SigReply(zl.epoch, zl.level, zone_id, items=items, p_mins=p_mins)

    def on_sig_probe(self, src: str, msg: SigProbe) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None or zl.initiator is None or zl.initiator.node_id != src:
            self.ctx.reject("not_member")
            return
        if msg.zone_id != zone_id_of(msg.epoch, msg.level, src):
            self.ctx.reject("bad_field")
            return
        self.ctx.send(zl.initiator, self._my_reply(zl, msg.zone_id))

    def on_sig_reply(self, src: str, msg: SigReply) -> None:
        zl = self.levels.get((msg.epoch, msg.level))
        if zl is None or not zl.is_initiator or msg.zone_id != zl.zone_id:
            self.ctx.reject("not_initiator")
            return
        if src not in zl.members:
            self.ctx.reject("not_member")
            return
        limit = self.ctx.params.max_items_per_message
        if len(msg.items) > limit or len(msg.p_mins) > limit:
            self.ctx.reject("bad_field")
            return
        if msg.level == 1 and msg.items:
            self.ctx.reject("bad_field")
            return
        if any(item.level != msg.level - 1 or item.epoch != msg.epoch for item in msg.items):
            self.ctx.reject("bad_field")
            return
        zl.replies[src] = msg

    # ------------------------------------------------------------------ clustering
    def _cluster_phase(self, zl: ZoneLevel) -> None:
        if self.ctx.inert or not zl.is_initiator:
            return
        zl.replies[self.ctx.node_id] = self._my_reply(zl, zl.zone_id)
        p_all: list[int] = []
        for reply in zl.replies.values():
            p_all.extend(reply.p_mins)
        zl.p_mins = sample_order_stats(p_all)
        params = self.ctx.params
        alone = not zl.adjacent
        formed: list[FormedCluster]
        if zl.level == 1:
            entries = [
                MemberEntry(zl.members[nid].ref, reply.signature, zl.member_scores[nid])
                for nid, reply in sorted(zl.replies.items())
                if reply.signature is not None and nid in zl.members
            ]
            formed, clustering = form_leaf_clusters(zl.epoch, zl.zone_id, entries, params)
        else:
            items: dict[str, ClusterDescriptor] = {}
            for nid in sorted(zl.replies):
                if nid in zl.members:
                    for item in zl.replies[nid].items:
                        items.setdefault(item.cluster_id, item)
            force = alone and len(items) > params.zone_cap
            formed, clustering = form_inner_clusters(
                zl.epoch, zl.level, zl.zone_id, list(items.values()), params, force_reduction=force
            )
        self.clustering_methods.append(clustering.method)
        self.ctx.counters[f"cluster.{clustering.method.split('(')[0]}"] += 1
        zl.formed = tuple(f.descriptor for f in formed)
        if not formed:
            zl.closed = True
            return
        top: FormedCluster | None = None
        if (
            alone
            and len(formed) > 1
            and (len(formed) <= params.zone_cap or zl.level + 1 >= params.max_levels)
        ):
            top = form_root(
                zl.epoch,
                zl.level + 1,
                zone_id_of(zl.epoch, zl.level + 1, self.ctx.node_id),
                zl.formed,
                params,
            )
        lone_root = alone and len(formed) == 1
        for f in formed:
            self._publish(f, top.descriptor if top is not None else None, is_root=lone_root)
        if not alone and zl.level < params.max_levels:
            next_level = zl.level + 1
            self.ctx.at(
                params.level_start(zl.epoch, next_level),
                lambda: self._begin(zl.epoch, next_level, dict(zl.adjacent)),
            )
            return
        zl.closed = True
        if len(formed) == 1:
            root = formed[0].descriptor
            root_level = zl.level
        elif top is not None:
            self._publish(top, None, is_root=True)
            root = top.descriptor
            root_level = zl.level + 1
        else:
            # Alone with too many clusters: one more level over our own clusters.
            zl.closed = False
            next_level = zl.level + 1
            self.ctx.at(
                params.level_start(zl.epoch, next_level),
                lambda: self._begin(zl.epoch, next_level, {}),
            )
            return
        net_p = network_p(list(zl.p_mins), params.p_quantile, params.p_max) if zl.p_mins else None
        announce = EpochAnnounce(zl.epoch, self.ctx.seed(zl.epoch), root, root_level, net_p)
        self.ctx.counters["zone.root_formed"] += 1
        for ref in root.replicas:
            self.ctx.send(ref, announce)

    def _publish(
        self, formed: FormedCluster, parent: ClusterDescriptor | None, *, is_root: bool
    ) -> None:
        """CLUSTER_STATE to the replicas (with the parent when it is already known), and
        MEMBER_ASSIGN to members or PARENT_UPDATE to the children's replicas."""
        d = formed.descriptor
        state = ClusterState(
            d.epoch, d, formed.children, formed.members, parent, 1, d if is_root else None
        )
        for ref in d.replicas:
            self.ctx.send(ref, state)
        if d.level == 1:
            for m in formed.members:
                self.ctx.send(m.ref, MemberAssign(d.epoch, d))
        else:
            for child in formed.children:
                for ref in child.replicas:
                    self.ctx.send(ref, ParentUpdate(d.epoch, child.cluster_id, d))

    # ------------------------------------------------------------------ status
    def roles(self, epoch: int) -> list[str]:
        return [
            f"initiator@{level}"
            for (e, level), zl in sorted(self.levels.items())
            if e == epoch and zl.is_initiator
        ]

    def emit_roles(self, epoch: int, extra: list[str]) -> None:
        self.ctx.emit(RoleChanged(epoch, tuple(self.roles(epoch) + extra)))
