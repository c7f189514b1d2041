"""The links of a cluster to its members, children and parent (SemanticDFL Sec. 3.7).

Inbound upkeep: HEARTBEAT from members (level 1) or child primaries (above), answered with
the current descriptor; HEARTBEAT_ACK from this cluster's parent (level >= 2; a leaf's ack
to its member is :mod:`peerlm.overlay.membership`'s); DESCRIPTOR_UPDATE from children;
SIGNATURE_UPDATE from members; LEAVE from members and replicas.
"""

from __future__ import annotations

from peerlm.overlay.cluster_upkeep import PrimaryUpkeep
from peerlm.overlay.messages import (
    DescriptorUpdate,
    Heartbeat,
    HeartbeatAck,
    Leave,
    MemberEntry,
    SignatureUpdate,
)
from peerlm.overlay.role_table import RoleTable

__all__ = ["ClusterLinks"]


class ClusterLinks:
    """Messages from a cluster's members, children and parent that keep the links alive."""

    def __init__(self, table: RoleTable, upkeep: PrimaryUpkeep) -> None:
        self.table = table
        self.ctx = table.ctx
        self.roles = table.roles
        self.upkeep = upkeep

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

    def on_heartbeat_ack(self, src: str, msg: HeartbeatAck) -> None:
        """A parent (level >= 2) answered the heartbeat of one or more of our clusters."""
        found = False
        for role in self.roles.values():
            if (
                role.parent is not None
                and role.parent.cluster_id == msg.cluster.cluster_id
                and src in [r.node_id for r in msg.cluster.replicas]
            ):
                role.parent = msg.cluster
                self.table.parent_ack[role.cluster_id] = self.ctx.now
                found = True
        if not found:
            self.ctx.reject("unknown_cluster")

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
        if self.table.is_primary(role):
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
        if not self.table.is_primary(role):
            # Stop offering the leaver as a candidate now; the primary syncs the rest.
            return
        if src in role.replica_ids():
            self.upkeep.remove_replicas(role, {src})
        role.refresh_size()
        role.dirty = True
        self.ctx.counters["maintenance.leaves"] += 1
        self.upkeep.backfill(role)
