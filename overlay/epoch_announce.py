"""The root's EPOCH_ANNOUNCE, relayed down the new tree (SemanticDFL Sec. 3.6).

Each primary forwards an epoch's announce once, to its members (level 1) or to its
children's replicas; an announce that arrives before this node's CLUSTER_STATE is kept
(for the latest two epochs) and forwarded when the role arrives.
"""

from __future__ import annotations

from collections.abc import Callable

from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.messages import EpochAnnounce
from peerlm.overlay.role_table import RoleTable

__all__ = ["AnnounceRelay"]


class AnnounceRelay:
    """Checks, records and forwards EPOCH_ANNOUNCE for the roles this node holds."""

    def __init__(self, table: RoleTable, on_announce: Callable[[EpochAnnounce], None]) -> None:
        self.table = table
        self.ctx = table.ctx
        self.roles = table.roles
        self._on_announce = on_announce
        self._announced: set[tuple[int, str]] = set()
        self._announcements: dict[int, EpochAnnounce] = {}

    def latest(self, epoch: int) -> EpochAnnounce | None:
        """The announce received for ``epoch``, if any."""
        return self._announcements.get(epoch)

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
            if role.descriptor.epoch != msg.epoch or not self.table.is_primary(role):
                continue
            self.forward(role, msg)

    def forward(self, role: ClusterRole, msg: EpochAnnounce) -> None:
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
