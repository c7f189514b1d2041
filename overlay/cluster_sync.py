"""Replica state sync: CLUSTER_STATE from a cluster's primary (or its zone initiator at the
build) and PARENT_UPDATE from a new parent (SemanticDFL Sec. 3.6-3.7).

A CLUSTER_STATE naming this node among the replicas creates or replaces its role (never with
an older term or version) and arms the role's heartbeat loop; a PARENT_UPDATE that overtakes
the CLUSTER_STATE it belongs with is kept for one lease.
"""

from __future__ import annotations

from peerlm.overlay.epoch_announce import AnnounceRelay
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.leases import Leases
from peerlm.overlay.messages import ClusterState, ParentUpdate
from peerlm.overlay.role_table import RoleTable

__all__ = ["ClusterSync"]


class ClusterSync:
    """Creates and refreshes roles from CLUSTER_STATE; sets parents from PARENT_UPDATE."""

    def __init__(self, table: RoleTable, leases: Leases, announce: AnnounceRelay) -> None:
        self.table = table
        self.ctx = table.ctx
        self.roles = table.roles
        self.leases = leases
        self.announce = announce
        self._early_parents: dict[str, tuple[str, ParentUpdate, float]] = {}

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
        self.leases.start_loop(role)
        if current is None:
            self.table.roles_changed()
        announce = self.announce.latest(d.epoch)
        if announce is not None and self.table.is_primary(role):
            if announce.root.cluster_id == d.cluster_id:
                role.is_root = True
            self.announce.forward(role, announce)

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
        self.table.parent_ack[role.cluster_id] = self.ctx.now
