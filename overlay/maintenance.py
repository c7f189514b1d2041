"""Super-peer roles and their upkeep (SemanticDFL Sec. 3.7), one module per sub-protocol.

A node holds a :class:`~peerlm.overlay.hierarchy.ClusterRole` for every cluster whose
replica set ``R_j`` it is in. :class:`Roles` assembles the parts that keep those roles
alive; each owns its messages (the node's dispatch table, :mod:`peerlm.overlay.dispatch`,
names the owner of every kind):

=========================================  ==================================================
:mod:`~peerlm.overlay.role_table`          the roles held and the bookkeeping shared below
:mod:`~peerlm.overlay.cluster_sync`        CLUSTER_STATE, PARENT_UPDATE (replica state sync)
:mod:`~peerlm.overlay.epoch_announce`      EPOCH_ANNOUNCE relayed down the tree
:mod:`~peerlm.overlay.leases`              the heartbeat loop, LEASE_RENEW/LEASE_ACK, TAKEOVER,
                                           RESIGN, hand-over on leave
:mod:`~peerlm.overlay.cluster_upkeep`      a primary's tick: dropout repair, backfill,
                                           prototype refresh, parent heartbeat, re-attach
:mod:`~peerlm.overlay.cluster_links`       HEARTBEAT, a parent's HEARTBEAT_ACK,
                                           DESCRIPTOR_UPDATE, SIGNATURE_UPDATE, LEAVE
:mod:`~peerlm.overlay.join_placement`      JOIN (top-down placement), a cluster's JOIN_ACCEPT
=========================================  ==================================================

A cluster whose parent stops answering re-attaches itself through the root; if the root is
gone it waits for the next epoch's rebuild.
"""

from __future__ import annotations

from collections.abc import Callable

from peerlm.overlay.cluster_links import ClusterLinks
from peerlm.overlay.cluster_sync import ClusterSync
from peerlm.overlay.cluster_upkeep import PrimaryUpkeep
from peerlm.overlay.context import NodeContext
from peerlm.overlay.epoch_announce import AnnounceRelay
from peerlm.overlay.join_placement import JoinPlacement
from peerlm.overlay.leases import Leases
from peerlm.overlay.messages import ClusterDescriptor, EpochAnnounce, NodeRef, Takeover
from peerlm.overlay.role_table import RoleTable

__all__ = ["Roles"]


class Roles:
    """All super-peer roles of one node, and the sub-protocols that maintain them.

    The message handlers live on the parts (``sync``, ``announce``, ``leases``, ``upkeep``,
    ``links``, ``placement``); this class only wires them together and offers the node the
    few whole-table operations it needs.
    """

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
        self.table = RoleTable(ctx, on_roles_changed, root_of, leaf_of, neighbours)
        self.upkeep = PrimaryUpkeep(self.table)
        self.leases = Leases(self.table, self.upkeep, on_takeover_seen)
        self.announce = AnnounceRelay(self.table, on_announce)
        self.sync = ClusterSync(self.table, self.leases, self.announce)
        self.links = ClusterLinks(self.table, self.upkeep)
        self.placement = JoinPlacement(self.table, self.upkeep)
        self.roles = self.table.roles
        self.get = self.table.get
        self.is_primary = self.table.is_primary
        self.root_role = self.table.root_role
        self.forget_before = self.table.forget_before
        self.describe = self.table.describe

    def resign_all(self) -> None:
        """Graceful leave: hand every role over before going quiet."""
        self.leases.resign_all()
