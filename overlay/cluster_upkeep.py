"""A primary's upkeep of its cluster, once per heartbeat tick (SemanticDFL Sec. 3.7).

* **Leases out**: LEASE_RENEW to every other replica.
* **Dropout repair**: replicas silent for a lease, members silent for ``member_timeout`` and
  children silent for ``orphan_after`` are dropped; the descriptor (size, prototype,
  replicas) is refreshed and the parent told with DESCRIPTOR_UPDATE. Only parent and child
  pointers are touched.
* **Backfill**: the primary keeps ``|R_j| = min(r, candidates)``: at level 1 the member
  closest to the prototype, above the children's replicas in order of closeness. Nodes
  found silent are not picked again for ``orphan_after``.
* **Parent link**: heartbeats to the parent's primary (every replica once it is silent);
  a cluster whose parent stays silent for ``orphan_after`` re-attaches itself through the
  root, or through physical neighbours whose parent pointers climb to the current root.
"""

from __future__ import annotations

import numpy as np
from peerlm.overlay.hierarchy import ClusterRole, ordered_replicas
from peerlm.overlay.messages import DescriptorUpdate, Heartbeat, JoinRequest, LeaseRenew, NodeRef
from peerlm.overlay.role_table import RoleTable
from peerlm.overlay.signature import Signature, cosine_to_many, prototype, sparse_cosine

__all__ = ["PrimaryUpkeep"]

_PROTOTYPE_REFRESH_TICKS = 4
_PROTOTYPE_PUSH_BELOW = 0.98


class PrimaryUpkeep:
    """What a primary does for its cluster every tick, and the repairs it shares with the
    cluster links and join placement (replica removal, backfill)."""

    def __init__(self, table: RoleTable) -> None:
        self.table = table
        self.ctx = table.ctx
        self._ticks: dict[str, int] = {}
        self._suspects: dict[str, float] = {}
        self._reattach_sent: dict[str, float] = {}
        self._reattach_tries: dict[str, int] = {}

    def tick(self, role: ClusterRole) -> None:
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
            self.remove_replicas(role, set(silent))
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
                self.remove_replicas(role, set(gone))
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
        self.backfill(role)
        ticks = self._ticks.get(role.cluster_id, 0) + 1
        self._ticks[role.cluster_id] = ticks
        if ticks % _PROTOTYPE_REFRESH_TICKS == 0 or changed:
            self._refresh_prototype(role)
        if role.dirty:
            role.dirty = False
            state = self.table.state_msg(role)
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

    def remove_replicas(self, role: ClusterRole, gone: set[str]) -> None:
        pairs = [
            (r, s)
            for r, s in zip(role.descriptor.replicas, role.descriptor.scores, strict=True)
            if r.node_id not in gone or r.node_id == self.ctx.node_id
        ]
        if len(pairs) != len(role.descriptor.replicas):
            role.bump(replicas=tuple(r for r, _ in pairs), scores=tuple(s for _, s in pairs))
            role.dirty = True
            self.ctx.counters["maintenance.replicas_lost"] += 1

    def backfill(self, role: ClusterRole) -> None:
        want = self.ctx.params.root_replication if role.is_root else self.ctx.params.replication
        ids = set(role.replica_ids())
        added: list[tuple[NodeRef, int]] = []
        now = self.ctx.now
        fresh = self.ctx.params.lease_duration
        if len(ids) >= want:
            # Full: the candidate scan below is O(members) per tick and would pick nobody.
            return
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
            if candidates:
                sigs: list[Signature] = [m.signature for m in candidates if m.signature is not None]
                close = cosine_to_many(role.descriptor.prototype, sigs)
                order = sorted(
                    range(len(candidates)), key=lambda i: (-close[i], candidates[i].ref.node_id)
                )
                for i in order[: want - len(ids)]:
                    added.append((candidates[i].ref, candidates[i].score))
        elif role.children:
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
        state = self.table.state_msg(role)
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
        # The prototype is a pure function of the inputs: when they (by identity) and the
        # descriptor's prototype are those of the last refresh that pushed nothing, this one
        # would push nothing either. Skipping it saves a prototype per cluster every few ticks.
        checked = role.prototype_checked
        if (
            checked is not None
            and checked[1] is role.descriptor.prototype
            and len(checked[0]) == len(sigs)
            and all(a is b for a, b in zip(checked[0], sigs, strict=True))
        ):
            return
        proto = prototype(sigs, int(np.median([s.p for s in sigs])))
        if sparse_cosine(proto, role.descriptor.prototype) < _PROTOTYPE_PUSH_BELOW:
            role.prototype_checked = None
            role.bump(prototype=proto)
            role.dirty = True
        else:
            role.prototype_checked = (tuple(sigs), role.descriptor.prototype)

    def _report_to_parent(self, role: ClusterRole) -> None:
        if role.parent is None:
            return
        last = self.table.reported.get(role.cluster_id)
        d = role.descriptor
        if last is not None and last.version == d.version:
            return
        self.table.reported[role.cluster_id] = d
        msg = DescriptorUpdate(d.epoch, role.parent.cluster_id, d)
        for ref in role.parent.replicas:
            self.ctx.send(ref, msg)

    def _heartbeat_parent(self, role: ClusterRole) -> None:
        params = self.ctx.params
        if role.parent is None:
            return
        cid = role.cluster_id
        last = self.table.parent_ack.setdefault(cid, self.ctx.now)
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
        root = self.table.root_of(role.descriptor.epoch)
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
        entries += sorted(self.table.neighbours().values(), key=lambda r: r.node_id)
        if not entries:
            return
        self.ctx.counters["maintenance.reattach"] += 1
        d = role.descriptor
        req = JoinRequest(d.epoch, self.ctx.ref, d.prototype, None, d.level + 1, False, item=d)
        self.ctx.send(entries[tries % len(entries)], req)
