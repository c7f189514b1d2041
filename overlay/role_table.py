"""The super-peer roles one node holds, and the bookkeeping its sub-protocols share.

A node holds a :class:`~peerlm.overlay.hierarchy.ClusterRole` for every cluster whose
replica set ``R_j`` it is in. The sub-protocols that keep those roles alive (state sync,
leases, primary upkeep, cluster links, join placement, the root announce; see
:mod:`peerlm.overlay.maintenance`) all read and write this one table, so the few facts
more than one of them needs live here and nowhere else:

* ``roles``: cluster id -> role;
* ``ticking``: clusters whose heartbeat loop is armed (:mod:`peerlm.overlay.leases`);
* ``parent_ack``: when each cluster last heard from its parent (a heartbeat ack, a parent
  update, a takeover or a re-attach accepted);
* ``reported``: the descriptor version each cluster last reported to its parent.
"""

from __future__ import annotations

from collections.abc import Callable

from peerlm.overlay.context import NodeContext
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.messages import ClusterDescriptor, ClusterState, NodeRef

__all__ = ["RoleTable"]


class RoleTable:
    """The roles of one node, keyed by cluster id, with their shared bookkeeping.

    Args:
        ctx: the node's context.
        on_roles_changed: called whenever a role is added or dropped.
        root_of: the root descriptor this node knows for an epoch.
        leaf_of: this node's own leaf cluster in an epoch.
        neighbours: the node's physical neighbours (re-attach entry points).
    """

    def __init__(
        self,
        ctx: NodeContext,
        on_roles_changed: Callable[[], None],
        root_of: Callable[[int], ClusterDescriptor | None],
        leaf_of: Callable[[int], ClusterDescriptor | None],
        neighbours: Callable[[], dict[str, NodeRef]] = dict,
    ) -> None:
        self.ctx = ctx
        self.roles: dict[str, ClusterRole] = {}
        self.ticking: set[str] = set()
        self.parent_ack: dict[str, float] = {}
        self.reported: dict[str, ClusterDescriptor] = {}
        self.roles_changed = on_roles_changed
        self.root_of = root_of
        self.leaf_of = leaf_of
        self.neighbours = neighbours

    def get(self, cluster_id: str) -> ClusterRole | None:
        """The role for ``cluster_id``, if this node holds one."""
        return self.roles.get(cluster_id)

    def is_primary(self, role: ClusterRole) -> bool:
        """Whether this node is ``role``'s primary (``replicas[0]``)."""
        return role.primary_id() == self.ctx.node_id

    def root_role(self, epoch: int) -> ClusterRole | None:
        """The root cluster's role of ``epoch``, if this node holds it."""
        for role in self.roles.values():
            if role.is_root and role.descriptor.epoch == epoch:
                return role
        return None

    def forget_before(self, epoch: int) -> None:
        """Drop the roles of epochs before ``epoch`` (the next epoch's tree is announced)."""
        for cid in [c for c, r in self.roles.items() if r.descriptor.epoch < epoch]:
            self.drop(cid)

    def drop(self, cluster_id: str) -> None:
        """Stop holding ``cluster_id``'s role; its heartbeat loop ends at its next tick."""
        self.roles.pop(cluster_id, None)
        self.ticking.discard(cluster_id)
        self.roles_changed()

    def state_msg(self, role: ClusterRole) -> ClusterState:
        """The CLUSTER_STATE a primary sends its replicas (the whole role)."""
        root = self.root_of(role.descriptor.epoch)
        return ClusterState(
            role.descriptor.epoch,
            role.descriptor,
            tuple(role.children.values()),
            tuple(role.members.values()),
            role.parent,
            role.term,
            root=root,
        )

    def describe(self) -> list[dict[str, object]]:
        """One row per role, ordered by (level, cluster id), for ``OverlayNode.describe``."""
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
