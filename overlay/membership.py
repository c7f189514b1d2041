"""A peer's own place in the overlay: its leaf cluster, the root, joining and liveness.

Per epoch a node records the leaf cluster it belongs to (MEMBER_ASSIGN after the build, or
JOIN_ACCEPT after a join), the root descriptor and depth (EPOCH_ANNOUNCE) and the
network-wide ``P``. While placed it sends a HEARTBEAT to its leaf primary every
``heartbeat_interval`` and pushes each new signature to the leaf replicas. When the leaf
stops answering it tries the next replica; when none answers it re-joins.

A node that is not placed once level 1 of the build is over (a lost message, a late
registration, no signature yet), or that arrives after the build, joins top-down through
the root (or through a neighbour that knows the way), retrying every ``join_retry``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from peerlm.overlay.context import NodeContext
from peerlm.overlay.events import BuildFinished, NetworkPChanged, Placed
from peerlm.overlay.messages import (
    ClusterDescriptor,
    EpochAnnounce,
    Heartbeat,
    HeartbeatAck,
    JoinAccept,
    JoinRequest,
    Leave,
    MemberAssign,
    NodeRef,
    SignatureUpdate,
    Takeover,
)

__all__ = ["Membership"]


@dataclass(slots=True)
class _EpochView:
    leaf: ClusterDescriptor | None = None
    root: ClusterDescriptor | None = None
    depth: int = 0
    network_p: int | None = None
    last_ack: float = 0.0
    replica_try: int = 0


class Membership:
    """Leaf membership, root knowledge, heartbeats and joins of one node."""

    def __init__(self, ctx: NodeContext, neighbours: Callable[[], dict[str, NodeRef]]) -> None:
        self.ctx = ctx
        self._neighbours = neighbours
        self.views: dict[int, _EpochView] = {}
        self._loop = False
        self._joining: int | None = None
        self._join_attempts = 0
        self._placed_round: dict[int, int] = {}

    # ------------------------------------------------------------------ views
    def view(self, epoch: int) -> _EpochView:
        if epoch not in self.views:
            self.views[epoch] = _EpochView()
        return self.views[epoch]

    def leaf(self, epoch: int) -> ClusterDescriptor | None:
        v = self.views.get(epoch)
        return v.leaf if v else None

    def root(self, epoch: int) -> ClusterDescriptor | None:
        v = self.views.get(epoch)
        return v.root if v else None

    def active_epoch(self) -> int | None:
        """The newest epoch whose overlay this node can query (root known)."""
        ready = [e for e, v in self.views.items() if v.root is not None]
        return max(ready) if ready else None

    def placed_epoch(self) -> int | None:
        placed = [e for e, v in self.views.items() if v.leaf is not None]
        return max(placed) if placed else None

    def forget_before(self, epoch: int) -> None:
        for e in [e for e in self.views if e < epoch]:
            del self.views[e]

    # ------------------------------------------------------------------ placement
    def _place(self, epoch: int, leaf: ClusterDescriptor, via: str) -> None:
        v = self.view(epoch)
        changed = v.leaf is None or v.leaf.cluster_id != leaf.cluster_id
        v.leaf = leaf
        v.last_ack = self.ctx.now
        v.replica_try = 0
        if self._joining == epoch:
            self._joining = None
        if changed:
            self.ctx.emit(Placed(epoch, leaf.cluster_id, via))
            self.ctx.counters[f"member.placed_{via}"] += 1
            # The build's SigProbe or the JOIN carried the current signature already.
            self._placed_round[epoch] = self.ctx.signature_round
        self._start_loop()

    def on_member_assign(self, src: str, msg: MemberAssign) -> None:
        d = msg.cluster
        initiator = d.zone_id.split(".", 2)[-1] if d.zone_id.count(".") >= 2 else ""
        if d.level != 1 or src != initiator or not d.replicas:
            self.ctx.reject("not_member")
            return
        self._place(msg.epoch, d, "build")

    def on_join_accept(self, src: str, msg: JoinAccept) -> None:
        d = msg.cluster
        if d.level != 1 or src not in [r.node_id for r in d.replicas]:
            self.ctx.reject("not_member")
            return
        if msg.root is not None:
            self.view(msg.epoch).root = msg.root
        self._place(msg.epoch, d, "join")

    def on_epoch_announce(self, msg: EpochAnnounce) -> None:
        v = self.view(msg.epoch)
        first = v.root is None
        v.root = msg.root
        v.depth = msg.depth
        if first:
            self.ctx.emit(BuildFinished(msg.epoch, msg.depth, msg.root.replicas[0].node_id))
            if msg.network_p is not None:
                v.network_p = msg.network_p
                self.ctx.emit(NetworkPChanged(msg.epoch, msg.network_p))

    def on_heartbeat_ack(self, src: str, msg: HeartbeatAck) -> None:
        v = self.views.get(msg.epoch)
        if v is None or v.leaf is None or v.leaf.cluster_id != msg.cluster.cluster_id:
            self.ctx.reject("unknown_cluster")
            return
        if src not in [r.node_id for r in msg.cluster.replicas]:
            self.ctx.reject("not_member")
            return
        v.leaf = msg.cluster
        v.last_ack = self.ctx.now
        v.replica_try = 0

    def on_takeover(self, msg: Takeover) -> None:
        d = msg.cluster
        for v in self.views.values():
            if v.leaf is not None and v.leaf.cluster_id == d.cluster_id:
                v.leaf = d
                v.last_ack = self.ctx.now
                v.replica_try = 0
            if v.root is not None and v.root.cluster_id == d.cluster_id:
                v.root = d

    def note_root(self, epoch: int, root: ClusterDescriptor | None) -> None:
        if root is not None and epoch in self.views:
            self.views[epoch].root = root

    # ------------------------------------------------------------------ liveness
    def _start_loop(self) -> None:
        if self._loop:
            return
        self._loop = True
        self.ctx.after(self.ctx.jitter(self.ctx.params.heartbeat_interval), self._tick)

    def _tick(self) -> None:
        if self.ctx.inert:
            self._loop = False
            return
        params = self.ctx.params
        self.ctx.after(params.heartbeat_interval, self._tick)
        epoch = self.placed_epoch()
        if epoch is None:
            return
        v = self.views[epoch]
        assert v.leaf is not None
        silent = self.ctx.now - v.last_ack
        if silent > params.orphan_after:
            # No replica of our leaf answers: re-join.
            self.ctx.counters["member.leaf_lost"] += 1
            v.leaf = None
            self.start_join(epoch)
            return
        hb = Heartbeat(epoch, v.leaf.cluster_id)
        if silent <= params.lease_duration:
            self.ctx.send(v.leaf.replicas[0], hb)
            return
        # The primary is silent: ask every replica; whichever is primary now answers.
        for ref in v.leaf.replicas:
            self.ctx.send(ref, hb)

    def _push_signature(self, epoch: int) -> None:
        leaf = self.leaf(epoch)
        sig = self.ctx.signature
        if leaf is None or sig is None:
            return
        msg = SignatureUpdate(epoch, leaf.cluster_id, sig, self.ctx.signature_round, self.ctx.p_min)
        for ref in leaf.replicas:
            self.ctx.send(ref, msg)

    def signature_changed(self) -> None:
        for epoch, v in self.views.items():
            if v.leaf is not None and self.ctx.signature_round > self._placed_round.get(epoch, 0):
                self._push_signature(epoch)

    # ------------------------------------------------------------------ joining
    def check_placed(self, epoch: int) -> None:
        """After level 1 of ``epoch``'s build: join if the build did not place us."""
        if self.ctx.inert or self.leaf(epoch) is not None:
            return
        self.ctx.counters["member.unplaced_after_build"] += 1
        self.start_join(epoch)

    def start_join(self, epoch: int) -> None:
        if self._joining is not None and self._joining >= epoch:
            return
        self._joining = epoch
        self._join_attempts = 0
        self._try_join(epoch)

    def _try_join(self, epoch: int) -> None:
        if self.ctx.inert or self._joining != epoch or self.leaf(epoch) is not None:
            return
        self.ctx.after(self.ctx.params.join_retry, lambda: self._try_join(epoch))
        sig = self.ctx.signature
        if sig is None:
            return
        self._join_attempts += 1
        self.ctx.counters["member.join_attempts"] += 1
        req = JoinRequest(epoch, self.ctx.ref, sig, self.ctx.ticket(epoch), 1, False)
        root = self.root(epoch)
        if root is not None:
            target = root.replicas[self._join_attempts % len(root.replicas)]
            if target.node_id != self.ctx.node_id:
                self.ctx.send(target, req)
                return
        neighbours = sorted(self._neighbours().values(), key=lambda r: r.node_id)
        if neighbours:
            self.ctx.send(neighbours[self._join_attempts % len(neighbours)], req)

    def leave(self, skip: set[str]) -> None:
        """LEAVE to every replica of each leaf (so none keeps offering us as a candidate),
        except for leaves whose role we already handed over."""
        for epoch, v in self.views.items():
            if v.leaf is not None and v.leaf.cluster_id not in skip:
                for ref in v.leaf.replicas:
                    self.ctx.send(ref, Leave(epoch, v.leaf.cluster_id))
