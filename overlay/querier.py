"""The querying side: one query per round, the soft barrier and the freshness guard
(SemanticDFL Sec. 3.4-3.6).

``start`` sends ``Q_i = <u_i, K, qid>`` with the current ``tau`` to a replica of the root
(chosen by a hash of the qid), or, while the root is unknown, to the leaf super-peer, which
forwards it up the parent pointers. Half-way to the soft-barrier timeout ``Delta_t`` the
query is re-sent to another entry. When ``Delta_t`` fires without a result the query
completes anyway (``complete=False``) with candidates from earlier rounds' results that
pass the freshness guard: at most ``Delta_max`` rounds old and with recorded similarity at
least ``T_fresh``, while this node's own signature has not drifted below ``T_fresh`` from
the one it queried with (our reading of ``sim(u_i(t), u_j(t')) >= T_fresh``: the stored
similarity was computed at ``t'``, the drift term bounds how much it can have moved).
Replies that arrive after the barrier are kept for later rounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from peerlm.overlay.context import NodeContext
from peerlm.overlay.events import QueryCompleted
from peerlm.overlay.messages import (
    Candidate,
    ClusterDescriptor,
    NodeRef,
    Query,
    QueryAck,
    QueryResult,
    SearchStats,
)
from peerlm.overlay.search import merge_top_k, pick_replica
from peerlm.overlay.signature import Signature, sparse_cosine
from peerlm.overlay.threshold import ThresholdController

__all__ = ["Querier"]


@dataclass(slots=True)
class _Pending:
    qid: str
    k: int
    round: int
    epoch: int
    started: float
    signature: Signature
    tau: float | None
    entries: int = 0
    acked: bool = False


class Querier:
    """Issues queries and turns answers (or timeouts) into ``QueryCompleted`` events."""

    def __init__(
        self,
        ctx: NodeContext,
        entry: Callable[[], tuple[int, ClusterDescriptor | None, ClusterDescriptor | None]],
        note_root: Callable[[int, ClusterDescriptor | None], None],
        depth: Callable[[], int] = lambda: 1,
        neighbours: Callable[[], dict[str, NodeRef]] = dict,
    ) -> None:
        self._depth = depth
        self._neighbours = neighbours
        self.ctx = ctx
        p = ctx.params
        self.threshold = ThresholdController(
            p.target_acceptance, p.tau_step, p.drift_slack, p.tau_window
        )
        self._entry = entry
        self._note_root = note_root
        self._pending: dict[str, _Pending] = {}
        self._seq = 0
        self.round = 0
        self._expired: dict[str, tuple[int, Signature]] = {}
        self._history: deque[tuple[int, Signature, tuple[Candidate, ...]]] = deque(
            maxlen=max(1, p.max_staleness + 1)
        )

    def start(self, k: int) -> str:
        sig = self.ctx.signature
        if sig is None:
            raise ValueError("set_signature() before start_query()")
        if not 1 <= k <= self.ctx.params.max_k:
            raise ValueError(f"k must lie in [1, {self.ctx.params.max_k}], got {k}")
        self._seq += 1
        self.round += 1
        qid = f"{self.ctx.node_id}#{self._seq}"
        epoch, _, _ = self._entry()
        pending = _Pending(qid, k, self.round, epoch, self.ctx.now, sig, self.threshold.current())
        self._pending[qid] = pending
        self.ctx.counters["query.started"] += 1
        self._send(pending)
        params = self.ctx.params
        self.ctx.after(params.query_timeout / 2, lambda: self._retry(qid))
        self.ctx.after(params.query_timeout, lambda: self._barrier(qid))
        return qid

    def _send(self, p: _Pending) -> bool:
        """Send to the next entry, cycling through: the cached root's replicas (starting at
        a hash of the qid), then up through our leaf's primary, then through each physical
        neighbour. Climbing the parent pointers (ours or a neighbour's) reaches the root
        even when churn replaced every replica we cached, or our own branch lost a
        parent."""
        epoch, root, leaf = self._entry()
        p.epoch = epoch
        remaining = p.started + self.ctx.params.query_timeout - self.ctx.now
        msg = Query(p.qid, epoch, self.ctx.ref, p.signature, p.k, p.tau, p.round, budget=remaining)
        climb = replace(msg, ascend=True)
        hop = 2 * self.ctx.params.hop_time
        entries: list[tuple[str, NodeRef, Query, float]] = []
        roots = []
        if root is not None:
            n = len(root.replicas)
            roots = [("root", pick_replica(root.replicas, p.qid, i), msg, hop) for i in range(n)]
        # Two tries at the cached root, then climb (ours, then neighbours'), then the rest.
        entries += roots[:2]
        # A climb is acknowledged by the root: one way up (a hop per level), one back.
        up = self.ctx.params.hop_time * (self._depth() + 2)
        if leaf is not None:
            entries.append(("leaf", leaf.replicas[0], climb, up))
        # Neighbours come most recently heard from first.
        entries += [("neighbour", ref, climb, up) for ref in self._neighbours().values()]
        entries += roots[2:]
        if not entries:
            self.ctx.counters["query.no_route"] += 1
            return False
        attempt = p.entries
        p.entries += 1
        p.acked = False
        kind, target, out, wait = entries[attempt % len(entries)]
        self.ctx.counters[f"query.entry_{kind}"] += 1
        self.ctx.send(target, out)
        self.ctx.after(wait, lambda: self._ack_timeout(p.qid, attempt))
        return True

    def _ack_timeout(self, qid: str, attempt: int) -> None:
        p = self._pending.get(qid)
        if p is None or self.ctx.inert or p.acked or p.entries != attempt + 1:
            return
        self.ctx.counters["query.entry_failover"] += 1
        self._send(p)

    def on_ack(self, src: str, msg: QueryAck) -> None:
        """The root confirmed our QUERY (``attempt < 0``): no resend is needed."""
        p = self._pending.get(msg.qid)
        if p is None:
            return
        p.acked = True

    def _retry(self, qid: str) -> None:
        p = self._pending.get(qid)
        if p is None or self.ctx.inert:
            return
        self.ctx.counters["query.resent"] += 1
        self._send(p)

    def _barrier(self, qid: str) -> None:
        p = self._pending.pop(qid, None)
        if p is None or self.ctx.inert:
            return
        self.ctx.counters["query.barrier_fired"] += 1
        self._expired[qid] = (p.round, p.signature)
        while len(self._expired) > 4 * (self.ctx.params.max_staleness + 1):
            del self._expired[next(iter(self._expired))]
        stale = self._fresh_stale(p)
        self.ctx.emit(
            QueryCompleted(
                qid,
                p.round,
                stale,
                False,
                len(stale),
                p.tau if p.tau is not None else 0.0,
                SearchStats(),
                self.ctx.now - p.started,
            )
        )

    def _fresh_stale(self, p: _Pending) -> tuple[Candidate, ...]:
        params = self.ctx.params
        usable = []
        for rnd, sig, cands in self._history:
            if p.round - rnd > params.max_staleness:
                continue
            if sparse_cosine(p.signature, sig) < params.freshness:
                continue
            usable.append([c for c in cands if c.similarity >= params.freshness])
        return merge_top_k(usable, p.k)

    def on_result(self, src: str, msg: QueryResult) -> None:
        if len(msg.candidates) > self.ctx.params.max_k:
            self.ctx.reject("bad_field")
            return
        p = self._pending.get(msg.qid)
        if p is None:
            # Late (after the barrier): keep the answer for later rounds' freshness guard.
            late = self._expired.pop(msg.qid, None)
            if late is None:
                self.ctx.reject("unknown_query")
                return
            self.ctx.counters["query.late"] += 1
            self._history.append((late[0], late[1], msg.candidates))
            return
        _, root, _ = self._entry()
        allowed = set()
        for d in (root, msg.root):
            if d is not None:
                allowed |= {r.node_id for r in d.replicas}
        if src not in allowed:
            self.ctx.reject("not_member")
            return
        del self._pending[msg.qid]
        self._note_root(msg.epoch, msg.root)
        candidates = tuple(c for c in msg.candidates if c.node_id != self.ctx.node_id)[: p.k]
        self._history.append((p.round, p.signature, candidates))
        drift = 1.0
        if self.ctx.previous_signature is not None:
            drift = sparse_cosine(p.signature, self.ctx.previous_signature)
        self.threshold.update(
            msg.tau, msg.stats.scored, msg.stats.accepted, drift, msg.stats.samples
        )
        self.ctx.counters["query.completed"] += 1
        self.ctx.emit(
            QueryCompleted(
                msg.qid,
                p.round,
                candidates,
                msg.complete,
                0,
                msg.tau,
                msg.stats,
                self.ctx.now - p.started,
            )
        )

    def pending(self) -> int:
        return len(self._pending)
