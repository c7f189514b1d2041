"""The physical neighbour set: at most ``d_max`` peers, preferring low RTT, kept alive.

Zone formation floods over this graph, and queries and re-attachments fall back to
climbing through a neighbour, so it must track churn. Every ``peer_exchange_interval``
a node sends PEER_EXCHANGE (its neighbour list, reply wanted) to each neighbour; a
neighbour not heard from for three intervals is dropped. Refs learnt from replies are
probed (one PEER_EXCHANGE each; the reply measures the RTT), and a probed peer becomes a
neighbour while there is room, or replaces the slowest measured neighbour when faster.
"""

from __future__ import annotations

from peerlm.overlay.context import NodeContext
from peerlm.overlay.messages import NodeRef, PeerExchange

__all__ = ["Neighbours"]


class Neighbours:
    """The neighbour set of one node and its maintenance."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.refs: dict[str, NodeRef] = {}
        self.rtt: dict[str, float] = {}
        self._heard: dict[str, float] = {}
        self._probe_sent: dict[str, float] = {}
        self._loop = False

    def by_recency(self) -> dict[str, NodeRef]:
        """The neighbours, most recently heard from first (ties by id)."""
        order = sorted(self.refs, key=lambda n: (-self._heard.get(n, 0.0), n))
        return {n: self.refs[n] for n in order}

    def replace(self, refs: list[NodeRef]) -> None:
        """Set the neighbours (the first ``d_max`` distinct refs other than ourselves)."""
        self.refs = {}
        for ref in refs:
            if ref.node_id != self.ctx.node_id and len(self.refs) < self.ctx.params.max_neighbours:
                self.refs.setdefault(ref.node_id, ref)
                self._heard[ref.node_id] = self.ctx.now
        self._start()

    def contact(self, refs: list[NodeRef]) -> None:
        """Bootstrap: take ``refs`` as neighbours (room permitting) and probe them."""
        for ref in refs:
            if ref.node_id == self.ctx.node_id:
                continue
            if len(self.refs) < self.ctx.params.max_neighbours:
                self.refs.setdefault(ref.node_id, ref)
                self._heard[ref.node_id] = self.ctx.now
            self._probe(ref)
        self._start()

    def _probe(self, ref: NodeRef) -> None:
        self._probe_sent[ref.node_id] = self.ctx.now
        self.ctx.send(ref, PeerExchange(self.ctx.ref, (), want_reply=True))

    def _start(self) -> None:
        if self._loop:
            return
        self._loop = True
        interval = self.ctx.params.peer_exchange_interval
        self.ctx.after(interval + self.ctx.jitter(interval), self._tick)

    def _tick(self) -> None:
        if self.ctx.inert:
            self._loop = False
            return
        interval = self.ctx.params.peer_exchange_interval
        self.ctx.after(interval, self._tick)
        now = self.ctx.now
        for nid in [n for n in self.refs if now - self._heard.get(n, now) > 3 * interval]:
            del self.refs[nid]
            self.rtt.pop(nid, None)
            self.ctx.counters["peers.dropped"] += 1
        for nid in [n for n, t in self._probe_sent.items() if now - t > interval]:
            del self._probe_sent[nid]
        mine = tuple(self.refs.values())
        for ref in mine:
            self.ctx.send(ref, PeerExchange(self.ctx.ref, mine, want_reply=True))

    def on_exchange(self, src: str, msg: PeerExchange) -> None:
        params = self.ctx.params
        if msg.sender.node_id != src or len(msg.refs) > params.max_items_per_message:
            self.ctx.reject("bad_field")
            return
        now = self.ctx.now
        self._heard[src] = now
        sent = self._probe_sent.pop(src, None)
        if sent is not None:
            self.rtt[src] = now - sent
        known = self.refs
        if src not in known and len(known) < params.max_neighbours:
            known[src] = msg.sender
        elif src not in known and src in self.rtt and known:
            slowest = max(known, key=lambda n: (self.rtt.get(n, float("inf")), n))
            if self.rtt[src] < self.rtt.get(slowest, float("inf")):
                del known[slowest]
                known[src] = msg.sender
        if msg.want_reply:
            self.ctx.send(msg.sender, PeerExchange(self.ctx.ref, tuple(known.values())))
        if len(known) >= params.max_neighbours:
            return
        for ref in msg.refs:
            if (
                ref.node_id != self.ctx.node_id
                and ref.node_id not in known
                and ref.node_id not in self._probe_sent
                and len(self._probe_sent) < params.max_neighbours
            ):
                self._probe(ref)
        self._start()
