"""Top-down join placement (SemanticDFL Sec. 3.7).

JOIN climbs to the root (along parent pointers kept current by maintenance), then at each
level goes to the child whose prototype is most similar to the newcomer's signature, down to
a leaf cluster (or, for a re-attaching cluster, to a cluster one level above it). The
accepting primary answers JOIN_ACCEPT; a re-attached cluster's replicas take it as their new
parent (a joining node's JOIN_ACCEPT is :mod:`peerlm.overlay.membership`'s).
"""

from __future__ import annotations

from dataclasses import replace

from peerlm.overlay.cluster_upkeep import PrimaryUpkeep
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.messages import JoinAccept, JoinRequest, MemberEntry, ParentUpdate
from peerlm.overlay.role_table import RoleTable
from peerlm.overlay.signature import cosine_to_many

__all__ = ["JoinPlacement"]


class JoinPlacement:
    """Routes JOIN requests down the tree and admits them; takes re-attach acceptances."""

    def __init__(self, table: RoleTable, upkeep: PrimaryUpkeep) -> None:
        self.table = table
        self.ctx = table.ctx
        self.roles = table.roles
        self.upkeep = upkeep

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
            root_role = self.table.root_role(msg.epoch)
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
            leaf = self.table.leaf_of(msg.epoch)
            if leaf is not None and leaf.replicas[0].node_id != self.ctx.node_id:
                self.ctx.send(leaf.replicas[0], fwd)
                return
            root = self.table.root_of(msg.epoch)
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
        if not self.table.is_primary(role):
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
        if self.table.is_primary(role):
            self.upkeep.backfill(role)
        root = self.table.root_of(epoch)
        self.ctx.send(
            joiner,
            JoinAccept(epoch, role.descriptor, root, msg.item.cluster_id if msg.item else None),
        )

    def on_join_accept(self, src: str, msg: JoinAccept) -> None:
        """The re-attach of our cluster ``msg.item_id`` was accepted: a new parent."""
        role = self.roles.get(msg.item_id) if msg.item_id is not None else None
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        if src not in [r.node_id for r in msg.cluster.replicas]:
            self.ctx.reject("not_member")
            return
        role.parent = msg.cluster
        self.table.parent_ack[role.cluster_id] = self.ctx.now
