"""Leases, takeover and hand-over of super-peer roles (SemanticDFL Sec. 3.7).

Every role runs one heartbeat loop. On a primary's tick :class:`~peerlm.overlay.cluster_upkeep.
PrimaryUpkeep` renews the lease (LEASE_RENEW; replicas answer LEASE_ACK) and repairs the
cluster; on a replica's tick the lease is checked:

* **Takeover**: a replica that has not seen a renewal for ``lease_duration`` (plus half a
  lease per rank, so successors act one at a time in ``(VRF, id)`` order) takes over: term
  + 1, itself first, TAKEOVER to parent, children (or members) and the other replicas.
* **Graceful leave**: a leaving primary RESIGNs to its successor, which takes over at once;
  a leaving replica sends LEAVE to the primary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from peerlm.overlay.cluster_upkeep import PrimaryUpkeep
from peerlm.overlay.events import LeaseTakeover
from peerlm.overlay.hierarchy import ClusterRole, ordered_replicas
from peerlm.overlay.messages import LeaseAck, LeaseRenew, Leave, NodeRef, Resign, Takeover
from peerlm.overlay.role_table import RoleTable

__all__ = ["Leases"]


class Leases:
    """The heartbeat loop of every role, lease renewal, takeover and resignation."""

    def __init__(
        self,
        table: RoleTable,
        upkeep: PrimaryUpkeep,
        on_takeover_seen: Callable[[Takeover], None],
    ) -> None:
        self.table = table
        self.ctx = table.ctx
        self.roles = table.roles
        self.upkeep = upkeep
        self._takeover_seen = on_takeover_seen

    def start_loop(self, role: ClusterRole) -> None:
        cid = role.cluster_id
        if cid in self.table.ticking:
            return
        self.table.ticking.add(cid)
        self.ctx.after(self.ctx.jitter(self.ctx.params.heartbeat_interval), lambda: self._tick(cid))

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
        if role is None or not self.table.is_primary(role) or src not in role.replica_ids():
            self.ctx.reject("not_member")
            return
        role.last_seen[src] = self.ctx.now
        if msg.version < role.descriptor.version:
            ref = role.descriptor.replicas[role.replica_ids().index(src)]
            self.ctx.send(ref, self.table.state_msg(role))

    def _tick(self, cluster_id: str) -> None:
        role = self.roles.get(cluster_id)
        if self.ctx.inert or role is None:
            self.table.ticking.discard(cluster_id)
            return
        params = self.ctx.params
        self.ctx.after(params.heartbeat_interval, lambda: self._tick(cluster_id))
        if self.table.is_primary(role):
            self.upkeep.tick(role)
        else:
            self._replica_tick(role)

    def _replica_tick(self, role: ClusterRole) -> None:
        params = self.ctx.params
        ids = role.replica_ids()
        if self.ctx.node_id not in ids:
            self.table.drop(role.cluster_id)
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
        self.table.parent_ack[role.cluster_id] = self.ctx.now
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
        self.upkeep.backfill(role)
        self.table.roles_changed()

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
        self.table.reported[role.cluster_id] = role.descriptor

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
                self.table.drop(d.cluster_id)
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
                self.table.parent_ack[other.cluster_id] = self.ctx.now
            if d.cluster_id in other.children:
                handled = True
                other.children[d.cluster_id] = d
                other.last_seen[d.cluster_id] = self.ctx.now
        leaf = self.table.leaf_of(d.epoch)
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

    def resign_all(self) -> None:
        """Graceful leave: hand every role over before going quiet."""
        for role in list(self.roles.values()):
            if self.table.is_primary(role):
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
        self.table.ticking.clear()
