"""Super-peer roles and their upkeep (SemanticDFL Sec. 3.7).

A node holds a :class:`~peerlm.overlay.hierarchy.ClusterRole` for every cluster whose
replica set ``R_j`` it is in. The primary (``replicas[0]``) holds a lease it renews every
``heartbeat_interval`` with LEASE_RENEW; replicas answer LEASE_ACK. Members (level 1) and
child primaries (above) send HEARTBEATs to the primary and get the current descriptor back.

* **Takeover**: a replica that has not seen a renewal for ``lease_duration`` (plus half a
  lease per rank, so successors act one at a time in ``(VRF, id)`` order) takes over: term
  + 1, itself first, TAKEOVER to parent, children (or members) and the other replicas.
* **Backfill**: the primary keeps ``|R_j| = min(r, candidates)``: at level 1 the member
  closest to the prototype, above the children's replicas in order of closeness.
* **Dropout repair**: members, replicas or children silent for two leases are dropped; the
  descriptor (size, prototype, replicas) is refreshed and the parent told with
  DESCRIPTOR_UPDATE. Only parent and child pointers are touched.
* **Join placement** (top-down): JOIN climbs to the root, then at each level goes to the
  child whose prototype is most similar to the newcomer's signature, down to a leaf cluster
  (or, for a re-attaching cluster, to a cluster one level above it).
* **Graceful leave**: a leaving primary RESIGNs to its successor, which takes over at once;
  a leaving member or replica sends LEAVE to the primary.
* A cluster whose parent stops answering re-attaches itself through the root; if the root is
  gone it waits for the next epoch's rebuild.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
from peerlm.overlay.context import NodeContext
from peerlm.overlay.events import LeaseTakeover
from peerlm.overlay.hierarchy import ClusterRole, ordered_replicas
from peerlm.overlay.messages import (
    ClusterDescriptor,
    ClusterState,
    DescriptorUpdate,
    EpochAnnounce,
    Heartbeat,
    HeartbeatAck,
    JoinAccept,
    JoinRequest,
    LeaseAck,
    LeaseRenew,
    Leave,
    MemberEntry,
    NodeRef,
    ParentUpdate,
    Resign,
    SignatureUpdate,
    Takeover,
)
from peerlm.overlay.signature import Signature, cosine_to_many, prototype, sparse_cosine

__all__ = ["Roles"]

_PROTOTYPE_REFRESH_TICKS = 4
_PROTOTYPE_PUSH_BELOW = 0.98


class Roles:
    """All super-peer roles of one node and their maintenance."""

    def __init__(
        self,
        ctx: NodeContext,
        on_roles_changed: Callable[[], None],
        on_announce: Callable[[EpochAnnounce], None],
        root_of: Callable[[int], ClusterDescriptor | None],
        leaf_of: Callable[[int], ClusterDescriptor | None],
        on_takeover_seen: Callable[[Takeover], None],
        neighbours: Callable[[], dict[str, NodeRef]] = dict,
    ) -> None:
        self.ctx = ctx
        self._neighbours = neighbours
        self.roles: dict[str, ClusterRole] = {}
        self._roles_changed = on_roles_changed
        self._on_announce = on_announce
        self._root_of = root_of
        self._leaf_of = leaf_of
        self._takeover_seen = on_takeover_seen
        self._announced: set[tuple[int, str]] = set()
        self._loops: set[str] = set()
        self._ticks: dict[str, int] = {}
        self._parent_ack: dict[str, float] = {}
        self._reported: dict[str, ClusterDescriptor] = {}
        self._reattach_sent: dict[str, float] = {}
        self._early_parents: dict[str, tuple[str, ParentUpdate, float]] = {}
        self._reattach_tries: dict[str, int] = {}
        self._announcements: dict[int, EpochAnnounce] = {}
        self._suspects: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers
    def get(self, cluster_id: str) -> ClusterRole | None:
        return self.roles.get(cluster_id)

    def is_primary(self, role: ClusterRole) -> bool:
        return role.primary_id() == self.ctx.node_id

    def root_role(self, epoch: int) -> ClusterRole | None:
        for role in self.roles.values():
            if role.is_root and role.descriptor.epoch == epoch:
                return role
        return None

    def forget_before(self, epoch: int) -> None:
        for cid in [c for c, r in self.roles.items() if r.descriptor.epoch < epoch]:
            self._drop(cid)

    def _drop(self, cluster_id: str) -> None:
        self.roles.pop(cluster_id, None)
        self._loops.discard(cluster_id)
        self._roles_changed()

    def _start_loop(self, role: ClusterRole) -> None:
        cid = role.cluster_id
        if cid in self._loops:
            return
        self._loops.add(cid)
        self.ctx.after(self.ctx.jitter(self.ctx.params.heartbeat_interval), lambda: self._tick(cid))

    def describe(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for role in sorted(self.roles.values(), key=lambda r: (r.level, r.cluster_id)):
            out.append(
                {
                    "cluster": role.cluster_id,
                    "level": role.level,
                    "primary": self.is_primary(role),
                    "root": role.is_root,
                    "size": role.descriptor.size,
                    "replicas": role.replica_ids(),
                    "parent": role.parent.cluster_id if role.parent else None,
                    "children": sorted(role.children) if role.level > 1 else [],
                    "members": len(role.members),
                    "term": role.term,
                }
            )
        return out

    # ------------------------------------------------------------------ state sync
    def _state_msg(self, role: ClusterRole) -> ClusterState:
        root = self._root_of(role.descriptor.epoch)
        return ClusterState(
            role.descriptor.epoch,
            role.descriptor,
            tuple(role.children.values()),
            tuple(role.members.values()),
            role.parent,
            role.term,
            root=root,
        )

    def on_cluster_state(self, src: str, msg: ClusterState) -> None:
        d = msg.descriptor
        limit = self.ctx.params.max_items_per_message
        if len(msg.children) > limit or len(msg.members) > limit or not d.replicas:
            self.ctx.reject("bad_field")
            return
        if len(d.scores) != len(d.replicas) or d.level < 1:
            self.ctx.reject("bad_field")
            return
        if self.ctx.node_id not in [r.node_id for r in d.replicas]:
            self.ctx.reject("not_member")
            return
        current = self.roles.get(d.cluster_id)
        initiator = d.zone_id.split(".", 2)[-1] if d.zone_id.count(".") >= 2 else ""
        allowed = {initiator, *(r.node_id for r in d.replicas)}
        if current is not None:
            allowed |= set(current.replica_ids())
        if src not in allowed:
            self.ctx.reject("not_member")
            return
        if current is not None and (
            msg.term < current.term
            or (msg.term == current.term and d.version < current.descriptor.version)
        ):
            self.ctx.reject("stale")
            return
        role = ClusterRole(
            descriptor=d,
            term=msg.term,
            members={m.ref.node_id: m for m in msg.members},
            children={c.cluster_id: c for c in msg.children},
            parent=msg.parent if msg.parent is not None else (current.parent if current else None),
            is_root=current.is_root if current else False,
        )
        if msg.root is not None and msg.root.cluster_id == d.cluster_id:
            role.is_root = True
        role.lease_renewed = self.ctx.now
        now = self.ctx.now
        role.last_seen = {nid: now for nid in [*role.members, *role.children, *role.replica_ids()]}
        if current is not None:
            role.last_seen.update(
                {k: v for k, v in current.last_seen.items() if k in role.last_seen}
            )
        self.roles[d.cluster_id] = role
        early = self._early_parents.pop(d.cluster_id, None)
        if early is not None and self.ctx.now - early[2] <= self.ctx.params.lease_duration:
            self.on_parent_update(early[0], early[1])
        self._start_loop(role)
        if current is None:
            self._roles_changed()
        announce = self._announcements.get(d.epoch)
        if announce is not None and self.is_primary(role):
            if announce.root.cluster_id == d.cluster_id:
                role.is_root = True
            self.forward_announce(role, announce)

    def on_parent_update(self, src: str, msg: ParentUpdate) -> None:
        role = self.roles.get(msg.child_id)
        if role is None:
            # It may have overtaken the CLUSTER_STATE it belongs with: keep it briefly.
            if len(self._early_parents) < self.ctx.params.max_items_per_message:
                self._early_parents[msg.child_id] = (src, msg, self.ctx.now)
            else:
                self.ctx.reject("unknown_cluster")
            return
        p = msg.parent
        initiator = p.zone_id.split(".", 2)[-1] if p.zone_id.count(".") >= 2 else ""
        if p.level != role.level + 1 or src not in {initiator, *(r.node_id for r in p.replicas)}:
            self.ctx.reject("not_member")
            return
        role.parent = p
        self._parent_ack[role.cluster_id] = self.ctx.now

    # ------------------------------------------------------------------ root announce
    def on_epoch_announce(self, src: str, msg: EpochAnnounce) -> None:
        if msg.seed != self.ctx.seed(msg.epoch):
            self.ctx.reject("bad_seed")
            return
        root_role = self.roles.get(msg.root.cluster_id)
        if root_role is not None:
            root_role.is_root = True
            root_role.parent = None
        self._on_announce(msg)
        self._announcements[msg.epoch] = msg
        for e in [e for e in self._announcements if e < msg.epoch - 1]:
            del self._announcements[e]
        for role in list(self.roles.values()):
            if role.descriptor.epoch != msg.epoch or not self.is_primary(role):
                continue
            self.forward_announce(role, msg)

    def forward_announce(self, role: ClusterRole, msg: EpochAnnounce) -> None:
        key = (msg.epoch, role.cluster_id)
        if key in self._announced:
            return
        self._announced.add(key)
        if role.level == 1:
            for m in role.members.values():
                self.ctx.send(m.ref, msg)
        else:
            for child in role.children.values():
                for ref in child.replicas:
                    self.ctx.send(ref, msg)

    # ------------------------------------------------------------------ leases
    def on_lease_renew(self, src: str, msg: LeaseRenew) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        if src not in role.replica_ids() and src not in [r.node_id for r in msg.replicas]:
            self.ctx.reject("not_member")
            return
        if msg.term < role.term or (msg.term == role.term and src != role.primary_id()):
            self.ctx.reject("stale")
            return
        if msg.term > role.term:
            # A takeover we missed: follow the new primary until its state arrives.
            role.term = msg.term
            role.descriptor = replace(
                role.descriptor,
                replicas=msg.replicas,
                scores=self._scores_for(role, msg.replicas),
            )
        role.lease_renewed = self.ctx.now
        primary = role.descriptor.replicas[0]
        self.ctx.send(
            primary, LeaseAck(msg.epoch, msg.cluster_id, role.term, role.descriptor.version)
        )

    def _scores_for(self, role: ClusterRole, refs: tuple[NodeRef, ...]) -> tuple[int, ...]:
        known = dict(zip(role.replica_ids(), role.descriptor.scores, strict=True))
        for m in role.members.values():
            known.setdefault(m.ref.node_id, m.score)
        return tuple(known.get(r.node_id, 0) for r in refs)

    def on_lease_ack(self, src: str, msg: LeaseAck) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None or not self.is_primary(role) or src not in role.replica_ids():
            self.ctx.reject("not_member")
            return
        role.last_seen[src] = self.ctx.now
        if msg.version < role.descriptor.version:
            ref = role.descriptor.replicas[role.replica_ids().index(src)]
            self.ctx.send(ref, self._state_msg(role))

    def _tick(self, cluster_id: str) -> None:
        role = self.roles.get(cluster_id)
        if self.ctx.inert or role is None:
            self._loops.discard(cluster_id)
            return
        params = self.ctx.params
        self.ctx.after(params.heartbeat_interval, lambda: self._tick(cluster_id))
        if self.is_primary(role):
            self._primary_tick(role)
        else:
            self._replica_tick(role)

    def _replica_tick(self, role: ClusterRole) -> None:
        params = self.ctx.params
        ids = role.replica_ids()
        if self.ctx.node_id not in ids:
            self._drop(role.cluster_id)
            return
        rank = ids.index(self.ctx.node_id)
        wait = params.lease_duration + (rank - 1) * params.lease_duration / 2
        if self.ctx.now - role.lease_renewed > wait:
            self.take_over(role, reason="lease_expired")

    def take_over(self, role: ClusterRole, reason: str) -> None:
        ids = role.replica_ids()
        me = ids.index(self.ctx.node_id)
        previous = ids[0]
        keep = list(zip(role.descriptor.replicas, role.descriptor.scores, strict=True))[me:]
        rest_refs, rest_scores = ordered_replicas(
            [r for r, _ in keep[1:]], [s for _, s in keep[1:]]
        )
        dead = set(ids[:me])
        for nid in dead:
            role.members.pop(nid, None)
        role.term += 1
        role.bump(replicas=(keep[0][0], *rest_refs), scores=(keep[0][1], *rest_scores))
        self._parent_ack[role.cluster_id] = self.ctx.now
        role.refresh_size()
        role.lease_renewed = self.ctx.now
        # Members and children heartbeated the old primary: give them a fresh grace period.
        now = self.ctx.now
        for nid in [*role.members, *role.children, *role.replica_ids()]:
            role.last_seen[nid] = now
        self.ctx.counters["maintenance.takeovers"] += 1
        self.ctx.emit(
            LeaseTakeover(role.descriptor.epoch, role.cluster_id, role.level, previous, reason)
        )
        self._notify_takeover(role, previous)
        self._backfill(role)
        self._roles_changed()

    def _notify_takeover(self, role: ClusterRole, previous: str) -> None:
        msg = Takeover(role.descriptor.epoch, role.descriptor, role.term, previous)
        targets: dict[str, NodeRef] = {}
        for ref in role.descriptor.replicas[1:]:
            targets[ref.node_id] = ref
        if role.parent is not None:
            for ref in role.parent.replicas:
                targets[ref.node_id] = ref
        if role.level == 1:
            for m in role.members.values():
                targets[m.ref.node_id] = m.ref
        else:
            for child in role.children.values():
                for ref in child.replicas:
                    targets[ref.node_id] = ref
        targets.pop(self.ctx.node_id, None)
        for ref in targets.values():
            self.ctx.send(ref, msg)
        self._reported[role.cluster_id] = role.descriptor

    def on_takeover(self, src: str, msg: Takeover) -> None:
        d = msg.cluster
        if not d.replicas or d.replicas[0].node_id != src:
            self.ctx.reject("not_member")
            return
        handled = False
        role = self.roles.get(d.cluster_id)
        if role is not None and msg.term > role.term:
            handled = True
            if self.ctx.node_id not in [r.node_id for r in d.replicas]:
                self._drop(d.cluster_id)
            else:
                role.term = msg.term
                role.descriptor = d
                role.lease_renewed = self.ctx.now
                for nid in list(role.members):
                    if nid == msg.previous_primary:
                        del role.members[nid]
        for other in self.roles.values():
            if other.parent is not None and other.parent.cluster_id == d.cluster_id:
                handled = True
                other.parent = d
                self._parent_ack[other.cluster_id] = self.ctx.now
            if d.cluster_id in other.children:
                handled = True
                other.children[d.cluster_id] = d
                other.last_seen[d.cluster_id] = self.ctx.now
        leaf = self._leaf_of(d.epoch)
        if leaf is not None and leaf.cluster_id == d.cluster_id:
            handled = True
        self._takeover_seen(msg)
        if not handled:
            self.ctx.reject("unknown_cluster")

    def on_resign(self, src: str, msg: Resign) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None or role.primary_id() != src or msg.term != role.term:
            self.ctx.reject("not_member")
            return
        self.take_over(role, reason="resigned")

    # ------------------------------------------------------------------ primary upkeep
    def _primary_tick(self, role: ClusterRole) -> None:
        params = self.ctx.params
        now = self.ctx.now
        epoch = role.descriptor.epoch
        others = role.descriptor.replicas[1:]
        for ref in others:
            self.ctx.send(
                ref,
                LeaseRenew(
                    epoch,
                    role.cluster_id,
                    role.term,
                    role.descriptor.version,
                    role.descriptor.replicas,
                ),
            )
        dead_after = params.orphan_after
        changed = False
        # Replicas silent for a lease are replaced.
        silent = [
            r.node_id
            for r in others
            if now - role.last_seen.get(r.node_id, now) > params.lease_duration
        ]
        if silent:
            self._suspect(set(silent))
            self._remove_replicas(role, set(silent))
            changed = True
        if role.level == 1:
            gone = [
                nid
                for nid in role.members
                if nid != self.ctx.node_id
                and now - role.last_seen.get(nid, now) > params.member_timeout
            ]
            for nid in gone:
                del role.members[nid]
                self.ctx.counters["maintenance.member_dropouts"] += 1
            if gone:
                self._remove_replicas(role, set(gone))
                changed = True
        else:
            gone = [cid for cid in role.children if now - role.last_seen.get(cid, now) > dead_after]
            for cid in gone:
                del role.children[cid]
                self.ctx.counters["maintenance.child_dropouts"] += 1
            changed = changed or bool(gone)
        if changed:
            role.refresh_size()
            role.dirty = True
        self._backfill(role)
        ticks = self._ticks.get(role.cluster_id, 0) + 1
        self._ticks[role.cluster_id] = ticks
        if ticks % _PROTOTYPE_REFRESH_TICKS == 0 or changed:
            self._refresh_prototype(role)
        if role.dirty:
            role.dirty = False
            state = self._state_msg(role)
            for ref in role.descriptor.replicas[1:]:
                self.ctx.send(ref, state)
        self._report_to_parent(role)
        self._heartbeat_parent(role)

    def _suspect(self, gone: set[str]) -> None:
        """Remember nodes found silent, so backfill does not pick them again for a while."""
        until = self.ctx.now + self.ctx.params.orphan_after
        for nid in gone:
            self._suspects[nid] = until
        for nid in [n for n, t in self._suspects.items() if t < self.ctx.now]:
            del self._suspects[nid]

    def _remove_replicas(self, role: ClusterRole, gone: set[str]) -> None:
        pairs = [
            (r, s)
            for r, s in zip(role.descriptor.replicas, role.descriptor.scores, strict=True)
            if r.node_id not in gone or r.node_id == self.ctx.node_id
        ]
        if len(pairs) != len(role.descriptor.replicas):
            role.bump(replicas=tuple(r for r, _ in pairs), scores=tuple(s for _, s in pairs))
            role.dirty = True
            self.ctx.counters["maintenance.replicas_lost"] += 1

    def _backfill(self, role: ClusterRole) -> None:
        want = self.ctx.params.root_replication if role.is_root else self.ctx.params.replication
        ids = set(role.replica_ids())
        added: list[tuple[NodeRef, int]] = []
        now = self.ctx.now
        fresh = self.ctx.params.lease_duration
        if role.level == 1:
            # Only members heard from recently: never re-promote a silent (dead) one.
            candidates = [
                m
                for nid, m in role.members.items()
                if nid not in ids
                and m.signature is not None
                and now - role.last_seen.get(nid, -fresh - 1.0) <= fresh
                and nid not in self._suspects
            ]
            if len(ids) < want and candidates:
                sigs: list[Signature] = [m.signature for m in candidates if m.signature is not None]
                close = cosine_to_many(role.descriptor.prototype, sigs)
                order = sorted(
                    range(len(candidates)), key=lambda i: (-close[i], candidates[i].ref.node_id)
                )
                for i in order[: want - len(ids)]:
                    added.append((candidates[i].ref, candidates[i].score))
        elif len(ids) < want and role.children:
            children = list(role.children.values())
            close = cosine_to_many(role.descriptor.prototype, [c.prototype for c in children])
            order = sorted(range(len(children)), key=lambda i: (-close[i], children[i].cluster_id))
            depth = max(len(c.replicas) for c in children)
            for rank in range(depth):
                for i in order:
                    child = children[i]
                    if rank < len(child.replicas):
                        ref = child.replicas[rank]
                        if (
                            ref.node_id not in ids
                            and ref.node_id not in self._suspects
                            and len(ids) + len(added) < want
                            and all(a.node_id != ref.node_id for a, _ in added)
                        ):
                            added.append((ref, child.scores[rank]))
        if not added:
            return
        primary = (role.descriptor.replicas[0], role.descriptor.scores[0])
        rest = list(zip(role.descriptor.replicas[1:], role.descriptor.scores[1:], strict=True))
        rest.extend(added)
        refs, scores = ordered_replicas([r for r, _ in rest], [s for _, s in rest])
        role.bump(replicas=(primary[0], *refs), scores=(primary[1], *scores))
        for ref, _ in added:
            role.last_seen.setdefault(ref.node_id, now)
            if role.level > 1:
                role.last_seen[ref.node_id] = now
        role.dirty = True
        self.ctx.counters["maintenance.backfills"] += len(added)
        state = self._state_msg(role)
        for ref, _ in added:
            self.ctx.send(ref, state)

    def _refresh_prototype(self, role: ClusterRole) -> None:
        sigs: list[Signature]
        if role.level == 1:
            sigs = [m.signature for m in role.members.values() if m.signature is not None]
        else:
            sigs = [c.prototype for c in role.children.values()]
        if not sigs:
            return
        proto = prototype(sigs, int(np.median([s.p for s in sigs])))
        if sparse_cosine(proto, role.descriptor.prototype) < _PROTOTYPE_PUSH_BELOW:
            role.bump(prototype=proto)
            role.dirty = True

    def _report_to_parent(self, role: ClusterRole) -> None:
        if role.parent is None:
            return
        last = self._reported.get(role.cluster_id)
        d = role.descriptor
        if last is not None and last.version == d.version:
            return
        self._reported[role.cluster_id] = d
        msg = DescriptorUpdate(d.epoch, role.parent.cluster_id, d)
        for ref in role.parent.replicas:
            self.ctx.send(ref, msg)

    def _heartbeat_parent(self, role: ClusterRole) -> None:
        params = self.ctx.params
        if role.parent is None:
            return
        cid = role.cluster_id
        last = self._parent_ack.setdefault(cid, self.ctx.now)
        silent = self.ctx.now - last
        hb = Heartbeat(role.descriptor.epoch, role.parent.cluster_id)
        if silent <= params.lease_duration:
            self.ctx.send(role.parent.replicas[0], hb)
            return
        # The parent's primary is silent: ask every replica (whichever is primary now
        # answers with the current descriptor); after orphan_after also re-attach.
        for ref in role.parent.replicas:
            self.ctx.send(ref, hb)
        if silent > params.orphan_after:
            self._reattach(role)

    def _reattach(self, role: ClusterRole) -> None:
        """The parent cluster is gone: ask the root to place this cluster again, through
        the cached root's replicas and, since churn may have replaced all of those, through
        physical neighbours, whose own parent pointers climb to the current root."""
        root = self._root_of(role.descriptor.epoch)
        cid = role.cluster_id
        if (
            root is not None
            and role.parent is not None
            and root.cluster_id == role.parent.cluster_id
        ):
            root = None  # our parent *was* the root: only a neighbour's path can help
        last = self._reattach_sent.get(cid)
        if last is not None and self.ctx.now - last < self.ctx.params.join_retry:
            return
        self._reattach_sent[cid] = self.ctx.now
        tries = self._reattach_tries.get(cid, 0)
        self._reattach_tries[cid] = tries + 1
        entries = list(root.replicas) if root is not None else []
        entries += sorted(self._neighbours().values(), key=lambda r: r.node_id)
        if not entries:
            return
        self.ctx.counters["maintenance.reattach"] += 1
        d = role.descriptor
        req = JoinRequest(d.epoch, self.ctx.ref, d.prototype, None, d.level + 1, False, item=d)
        self.ctx.send(entries[tries % len(entries)], req)

    # ------------------------------------------------------------------ inbound upkeep
    def on_heartbeat(self, src: str, msg: Heartbeat) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        if role.level == 1:
            if src not in role.members:
                self.ctx.reject("not_member")
                return
            role.last_seen[src] = self.ctx.now
            ref = role.members[src].ref
        else:
            child = next(
                (c for c in role.children.values() if src in [r.node_id for r in c.replicas]),
                None,
            )
            if child is None:
                self.ctx.reject("not_member")
                return
            role.last_seen[child.cluster_id] = self.ctx.now
            ref = next(r for r in child.replicas if r.node_id == src)
        self.ctx.send(ref, HeartbeatAck(msg.epoch, role.descriptor))

    def on_heartbeat_ack(self, src: str, msg: HeartbeatAck) -> bool:
        """A parent answered one of our clusters' heartbeats (``False``: not ours)."""
        found = False
        for role in self.roles.values():
            if (
                role.parent is not None
                and role.parent.cluster_id == msg.cluster.cluster_id
                and src in [r.node_id for r in msg.cluster.replicas]
            ):
                role.parent = msg.cluster
                self._parent_ack[role.cluster_id] = self.ctx.now
                found = True
        return found

    def on_descriptor_update(self, src: str, msg: DescriptorUpdate) -> None:
        role = self.roles.get(msg.parent_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        child = msg.child
        old = role.children.get(child.cluster_id)
        senders = {r.node_id for r in child.replicas}
        if old is not None:
            senders |= {r.node_id for r in old.replicas}
        if old is None or src not in senders or child.level != role.level - 1:
            self.ctx.reject("not_member")
            return
        if msg.removed:
            del role.children[child.cluster_id]
        elif child.version >= old.version:
            role.children[child.cluster_id] = child
            role.last_seen[child.cluster_id] = self.ctx.now
        role.refresh_size()
        if self.is_primary(role):
            role.dirty = True

    def on_signature_update(self, src: str, msg: SignatureUpdate) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None or role.level != 1:
            self.ctx.reject("unknown_cluster")
            return
        member = role.members.get(src)
        if member is None:
            self.ctx.reject("not_member")
            return
        if msg.signature.p > self.ctx.params.max_signature_p:
            self.ctx.reject("bad_field")
            return
        if msg.round < member.round:
            return
        role.members[src] = MemberEntry(member.ref, msg.signature, member.score, msg.round)
        role.last_seen[src] = self.ctx.now

    def on_leave(self, src: str, msg: Leave) -> None:
        role = self.roles.get(msg.cluster_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        if src not in role.members and src not in role.replica_ids():
            self.ctx.reject("not_member")
            return
        if src == role.primary_id():
            # A primary hands over with RESIGN, not LEAVE.
            self.ctx.reject("not_member")
            return
        role.members.pop(src, None)
        if not self.is_primary(role):
            # Stop offering the leaver as a candidate now; the primary syncs the rest.
            return
        if src in role.replica_ids():
            self._remove_replicas(role, {src})
        role.refresh_size()
        role.dirty = True
        self.ctx.counters["maintenance.leaves"] += 1
        self._backfill(role)

    # ------------------------------------------------------------------ join placement
    def on_join(self, src: str, msg: JoinRequest) -> None:
        params = self.ctx.params
        if msg.hops > 4 * params.max_levels + 8 or msg.signature.p > params.max_signature_p:
            self.ctx.reject("bad_field")
            return
        if not 1 <= msg.target_level <= params.max_levels + 1:
            self.ctx.reject("bad_field")
            return
        if msg.item is None and msg.target_level != 1:
            self.ctx.reject("bad_field")
            return
        if msg.item is None and msg.joiner.node_id != src and not msg.descending and msg.hops == 0:
            self.ctx.reject("bad_field")
            return
        fwd = replace(msg, hops=msg.hops + 1)
        if not msg.descending:
            # Climb the parent pointers (kept current by maintenance) rather than trust a
            # cached root descriptor that churn may have outdated.
            root_role = self.root_role(msg.epoch)
            if root_role is not None:
                self._place(root_role, fwd)
                return
            tops = [
                r
                for r in self.roles.values()
                if r.descriptor.epoch == msg.epoch and r.parent is not None
            ]
            if tops:
                top = max(tops, key=lambda r: (r.level, r.cluster_id))
                assert top.parent is not None
                self.ctx.send(top.parent.replicas[0], fwd)
                return
            leaf = self._leaf_of(msg.epoch)
            if leaf is not None and leaf.replicas[0].node_id != self.ctx.node_id:
                self.ctx.send(leaf.replicas[0], fwd)
                return
            root = self._root_of(msg.epoch)
            if root is not None:
                self.ctx.send(root.replicas[msg.hops % len(root.replicas)], fwd)
                return
            self.ctx.reject("join_unroutable")
            return
        role = self.roles.get(msg.cluster_id or "")
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        self._place(role, fwd)

    def _place(self, role: ClusterRole, msg: JoinRequest) -> None:
        if not self.is_primary(role):
            # A stale pointer led here: only the primary changes a cluster.
            self.ctx.send(role.descriptor.replicas[0], msg)
            return
        if role.level <= msg.target_level:
            self._admit(role, msg)
            return
        children = list(role.children.values())
        if msg.item is not None:
            children = [c for c in children if c.cluster_id != msg.item.cluster_id]
        if not children:
            self._admit(role, msg)
            return
        scores = cosine_to_many(msg.signature, [c.prototype for c in children])
        best = max(range(len(children)), key=lambda i: (scores[i], -i))
        child = children[best]
        self.ctx.counters["maintenance.join_forwards"] += 1
        self.ctx.send(child.replicas[0], replace(msg, descending=True, cluster_id=child.cluster_id))

    def _admit(self, role: ClusterRole, msg: JoinRequest) -> None:
        epoch = role.descriptor.epoch
        joiner = msg.joiner
        if msg.item is None:
            if role.level != 1:
                self.ctx.reject("bad_field")
                return
            if msg.ticket is None:
                self.ctx.reject("bad_ticket")
                return
            score = self.ctx.verify_ticket(msg.ticket, epoch, joiner.node_id)
            if score is None:
                self.ctx.reject("bad_ticket")
                return
            role.members[joiner.node_id] = MemberEntry(joiner, msg.signature, score)
            role.last_seen[joiner.node_id] = self.ctx.now
            self.ctx.counters["maintenance.joins"] += 1
        else:
            item = msg.item
            if item.level != role.level - 1:
                self.ctx.reject("bad_field")
                return
            role.children[item.cluster_id] = item
            role.last_seen[item.cluster_id] = self.ctx.now
            for ref in item.replicas:
                self.ctx.send(ref, ParentUpdate(epoch, item.cluster_id, role.descriptor))
            self.ctx.counters["maintenance.reattached"] += 1
        role.refresh_size()
        role.dirty = True
        if self.is_primary(role):
            self._backfill(role)
        root = self._root_of(epoch)
        self.ctx.send(
            joiner,
            JoinAccept(epoch, role.descriptor, root, msg.item.cluster_id if msg.item else None),
        )

    def on_join_accept_item(self, src: str, msg: JoinAccept) -> bool:
        """A re-attach of one of our clusters was accepted (``False``: not for a cluster)."""
        if msg.item_id is None:
            return False
        role = self.roles.get(msg.item_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return True
        if src not in [r.node_id for r in msg.cluster.replicas]:
            self.ctx.reject("not_member")
            return True
        role.parent = msg.cluster
        self._parent_ack[role.cluster_id] = self.ctx.now
        return True

    # ------------------------------------------------------------------ leaving
    def resign_all(self) -> None:
        """Graceful leave: hand every role over before going quiet."""
        for role in list(self.roles.values()):
            if self.is_primary(role):
                if len(role.descriptor.replicas) > 1:
                    self.ctx.send(
                        role.descriptor.replicas[1],
                        Resign(role.descriptor.epoch, role.cluster_id, role.term),
                    )
            else:
                self.ctx.send(
                    role.descriptor.replicas[0], Leave(role.descriptor.epoch, role.cluster_id)
                )
        self.roles.clear()
        self._loops.clear()
