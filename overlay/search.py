"""Top-down similarity search with bottom-up top-K merging (SemanticDFL Sec. 3.4-3.5).

A query reaches a replica of the top-level (root) cluster. At each visited super-peer the
query's signature is scored against the children's prototypes (a *signature comparison*
each); the children with ``sim >= tau`` are expanded, at most ``B`` of them (the beam); if
none passes, the best ``dead_end_keep`` are (no dead ends). A leaf (level-1) cluster scores
its members' signatures and returns its top-K ``(id, address, sim)``; every super-peer
merges its children's lists with a size-K heap keyed by similarity, de-duplicating ids, and
passes the result up. Only signatures and descriptors travel.

**Relax and retry** (Sec. 3.5): when fewer than K distinct candidates with ``sim >= tau``
came back, the root lowers the same round threshold by ``delta`` and re-descends, for at
most ``max_relax`` steps (the visit budget). Sessions are kept per query, so a retry only
*re-expands*: already-scored prototypes and leaves are not scored again, and a subtree is
re-entered only if its reported *frontier* (the best score it left unexpanded) now passes.
Relax steps that cannot reach anything new cost no messages.

Deadlines and failover: the root may spend ``search_budget * Delta_t``. Every QUERY_DOWN
carries the time the child may take (the sender's remaining time less a round-trip
allowance of ``2 t_a``); a super-peer replies with whatever it has when its time is up. An
inner super-peer acknowledges a QUERY_DOWN at once (QUERY_ACK) and a leaf answers within a
round trip, so a replica that stays silent for ``2 t_a`` is presumed gone and the next
replica is asked. A branch none of whose replicas answered in time counts as failed and the
result is marked incomplete. So every query is answered before the querier's soft barrier.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
from peerlm.overlay.context import NodeContext
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.messages import (
    Candidate,
    ClusterDescriptor,
    NodeRef,
    Query,
    QueryAck,
    QueryDown,
    QueryPartial,
    QueryResult,
    SearchStats,
)
from peerlm.overlay.signature import Signature, cosine_to_many
from peerlm.overlay.threshold import quantile_threshold

__all__ = ["SearchServer", "merge_top_k", "pick_replica"]

NO_FRONTIER = -2.0
_SAMPLES = 16


def merge_top_k(lists: Iterable[Iterable[Candidate]], k: int) -> tuple[Candidate, ...]:
    """Size-K merge keyed by similarity, de-duplicating node ids (best score kept).

    Ties are broken by node id so every node merges identically.
    """
    best: dict[str, Candidate] = {}
    for lst in lists:
        for cand in lst:
            seen = best.get(cand.node_id)
            if seen is None or cand.similarity > seen.similarity:
                best[cand.node_id] = cand
    return tuple(heapq.nsmallest(k, best.values(), key=lambda c: (-c.similarity, c.node_id)))


def pick_replica(replicas: tuple[NodeRef, ...], qid: str, offset: int = 0) -> NodeRef:
    """Spread queries over live replicas (Sec. 3.7, load balancing): by a hash of the query
    id, shifted by ``offset`` when failing over."""
    return replicas[(zlib.crc32(qid.encode()) + offset) % len(replicas)]


def _sample(values: np.ndarray, limit: int = _SAMPLES) -> tuple[float, ...]:
    if values.size <= limit:
        return tuple(float(v) for v in values)
    idx = np.linspace(0, values.size - 1, limit).round().astype(np.int64)
    return tuple(float(v) for v in np.sort(values)[idx])


def _add_stats(parts: Iterable[SearchStats]) -> SearchStats:
    prototypes = members = accepted = visited = failed = 0
    samples: list[float] = []
    for s in parts:
        prototypes += s.prototypes
        members += s.members
        accepted += s.accepted
        visited += s.visited
        failed += s.failed_branches
        samples.extend(s.samples)
    if len(samples) > 4 * _SAMPLES:
        samples = list(_sample(np.asarray(samples), 4 * _SAMPLES))
    return SearchStats(prototypes, members, accepted, visited, failed, tuple(samples))


@dataclass(slots=True)
class _Branch:
    child: ClusterDescriptor
    score: float
    expanded: bool = False
    pending: bool = False
    attempt: int = -1
    replica_offset: int = 0
    candidates: tuple[Candidate, ...] = ()
    frontier: float = NO_FRONTIER
    stats: SearchStats = field(default_factory=SearchStats)
    failed: bool = False
    acked: bool = False
    timer: object | None = None


@dataclass(slots=True)
class _Session:
    qid: str
    cluster_id: str
    level: int
    querier_id: str
    signature: Signature
    k: int
    tau: float
    attempt: int
    reply_to: NodeRef | None
    branches: dict[str, _Branch] = field(default_factory=dict)
    prototypes: int = 0
    samples: tuple[float, ...] = ()
    replied_attempt: int = -1
    deadline: float = 0.0
    expired: bool = False


@dataclass(slots=True)
class _RootQuery:
    querier: NodeRef
    epoch: int
    relax_steps: int = 0
    finished: bool = False


class SearchServer:
    """Serves QUERY, QUERY_DOWN and QUERY_PARTIAL for the clusters this node replicates."""

    def __init__(
        self,
        ctx: NodeContext,
        role_of: Callable[[str], ClusterRole | None],
        root_role_of: Callable[[int], ClusterRole | None],
        any_role: Callable[[int], ClusterRole | None],
        root_of: Callable[[int], ClusterDescriptor | None],
        leaf_of: Callable[[int], ClusterDescriptor | None] = lambda _: None,
    ) -> None:
        self.ctx = ctx
        self._leaf_of = leaf_of
        self._role_of = role_of
        self._root_role_of = root_role_of
        self._any_role = any_role
        self._root_of = root_of
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._by_child: dict[tuple[str, str], tuple[str, str]] = {}
        self._roots: dict[str, _RootQuery] = {}
        self._done: dict[str, QueryResult] = {}

    # ------------------------------------------------------------------ entry
    def on_query(self, src: str, msg: Query) -> None:
        params = self.ctx.params
        if not 1 <= msg.k <= params.max_k or msg.signature.p > params.max_signature_p:
            self.ctx.reject("bad_field")
            return
        if msg.querier.node_id != src and not msg.ascend:
            self.ctx.reject("bad_field")
            return
        if msg.tau is not None and not -1.0 <= msg.tau <= 1.0:
            self.ctx.reject("bad_field")
            return
        if not 0.0 <= msg.budget <= params.query_timeout:
            self.ctx.reject("bad_field")
            return
        done = self._done.get(msg.qid)
        if done is not None:
            self.ctx.send(msg.querier, done)
            return
        if msg.qid in self._roots:
            return
        root = self._root_role_of(msg.epoch)
        if root is None:
            self._forward_up(msg)
            return
        self.ctx.counters["search.queries"] += 1
        self.ctx.send(msg.querier, QueryAck(msg.qid, root.cluster_id, -1))
        self._roots[msg.qid] = _RootQuery(msg.querier, msg.epoch)
        tau = msg.tau
        if tau is None:
            tau = self._initial_tau(root, msg.signature)
        session = self._new_session(
            msg.qid, root, msg.querier.node_id, msg.signature, msg.k, tau, None
        )
        # Spend our share of Delta_t, but never more than the querier still waits for.
        budget = min(params.search_budget * params.query_timeout, msg.budget - 2 * params.hop_time)
        self._arm_deadline(session, max(0.0, budget))
        self._visit(session, root)
        self.ctx.after(2 * params.query_timeout, lambda: self._forget(msg.qid))

    def _forward_up(self, msg: Query) -> None:
        role = self._any_role(msg.epoch)
        leaf = self._leaf_of(msg.epoch)
        if role is not None and role.parent is not None:
            # The parent's primary: the replica our heartbeats keep us current about.
            target = role.parent.replicas[0]
        elif role is None and leaf is not None and leaf.replicas[0].node_id != self.ctx.node_id:
            target = leaf.replicas[0]
        else:
            root = self._root_of(msg.epoch)
            if root is None or self.ctx.node_id in [r.node_id for r in root.replicas]:
                self.ctx.reject("no_route")
                return
            target = pick_replica(root.replicas, msg.qid)
        self.ctx.counters["search.forwarded_up"] += 1
        budget = max(0.0, msg.budget - self.ctx.params.hop_time)
        self.ctx.send(target, replace(msg, ascend=True, budget=budget))

    def _initial_tau(self, root: ClusterRole, sig: Signature) -> float:
        if root.level == 1:
            protos = [m.signature for m in root.members.values() if m.signature is not None]
        else:
            protos = [c.prototype for c in root.children.values()]
        tau = quantile_threshold(
            cosine_to_many(sig, protos).tolist(), self.ctx.params.target_acceptance
        )
        return 0.0 if tau is None else tau

    def _new_session(
        self,
        qid: str,
        role: ClusterRole,
        querier_id: str,
        sig: Signature,
        k: int,
        tau: float,
        reply_to: NodeRef | None,
        attempt: int = 0,
    ) -> _Session:
        session = _Session(
            qid, role.cluster_id, role.level, querier_id, sig, k, tau, attempt, reply_to
        )
        self._sessions[(qid, role.cluster_id)] = session
        return session

    # ------------------------------------------------------------------ descent
    def on_query_down(self, src: str, msg: QueryDown) -> None:
        params = self.ctx.params
        if not 1 <= msg.k <= params.max_k or not -1.0 <= msg.tau <= 1.0 or msg.attempt < 0:
            self.ctx.reject("bad_field")
            return
        if msg.reply_to.node_id != src or msg.signature.p > params.max_signature_p:
            self.ctx.reject("bad_field")
            return
        if not 0.0 <= msg.budget <= params.query_timeout:
            self.ctx.reject("bad_field")
            return
        role = self._role_of(msg.cluster_id)
        if role is None:
            self.ctx.reject("unknown_cluster")
            return
        if role.level == 1:
            self._answer_leaf(role, msg)
            return
        self.ctx.send(msg.reply_to, QueryAck(msg.qid, role.cluster_id, msg.attempt))
        session = self._sessions.get((msg.qid, role.cluster_id))
        if session is None:
            session = self._new_session(
                msg.qid,
                role,
                msg.querier_id,
                msg.signature,
                msg.k,
                msg.tau,
                msg.reply_to,
                msg.attempt,
            )
            self.ctx.after(2 * params.query_timeout, lambda: self._forget_session(session))
            self._arm_deadline(session, msg.budget)
            self._visit(session, role)
            return
        if msg.attempt <= session.attempt:
            return
        session.attempt = msg.attempt
        session.tau = msg.tau
        session.reply_to = msg.reply_to
        self._arm_deadline(session, msg.budget)
        self._expand(session)

    def _arm_deadline(self, session: _Session, budget: float) -> None:
        session.deadline = self.ctx.now + budget
        session.expired = False
        deadline = session.deadline
        self.ctx.at(deadline, lambda: self._deadline(session, deadline))

    def _deadline(self, session: _Session, deadline: float) -> None:
        """Out of time: give up on branches still pending and answer with what we have."""
        if self.ctx.inert or session.deadline != deadline:
            return
        session.expired = True
        pending = False
        for b in session.branches.values():
            if b.pending:
                pending = True
                b.pending = False
                b.failed = True
                self.ctx.counters["search.branch_deadline"] += 1
        if pending or session.replied_attempt != session.attempt:
            self._maybe_reply(session)

    def _answer_leaf(self, role: ClusterRole, msg: QueryDown) -> None:
        candidates, stats = self._score_members(role, msg.signature, msg.querier_id, msg.k, msg.tau)
        self.ctx.send(
            msg.reply_to,
            QueryPartial(msg.qid, role.cluster_id, msg.attempt, candidates, NO_FRONTIER, stats),
        )

    def _score_members(
        self, role: ClusterRole, sig: Signature, querier_id: str, k: int, tau: float
    ) -> tuple[tuple[Candidate, ...], SearchStats]:
        members = [
            m for nid, m in role.members.items() if nid != querier_id and m.signature is not None
        ]
        sims = cosine_to_many(sig, [m.signature for m in members if m.signature is not None])
        cands = [
            Candidate(m.ref.node_id, m.ref.address, float(s))
            for m, s in zip(members, sims, strict=True)
        ]
        self.ctx.counters["search.member_comparisons"] += len(members)
        stats = SearchStats(
            prototypes=0,
            members=len(members),
            accepted=int((sims >= tau).sum()),
            visited=1,
            samples=_sample(sims),
        )
        return merge_top_k([cands], k), stats

    def _visit(self, session: _Session, role: ClusterRole) -> None:
        """First visit: score the children once, then expand."""
        if role.level == 1:
            # The root itself is a leaf (a network of one zone and one cluster).
            candidates, stats = self._score_members(
                role, session.signature, session.querier_id, session.k, session.tau
            )
            self._finish_root(session, candidates, NO_FRONTIER, stats)
            return
        children = list(role.children.values())
        scores = cosine_to_many(session.signature, [c.prototype for c in children])
        session.prototypes = len(children)
        session.samples = _sample(scores)
        self.ctx.counters["search.prototype_comparisons"] += len(children)
        for child, score in zip(children, scores, strict=True):
            session.branches[child.cluster_id] = _Branch(child, float(score))
            self._by_child[(session.qid, child.cluster_id)] = (session.qid, session.cluster_id)
        self._expand(session)

    def _expand(self, session: _Session) -> None:
        params = self.ctx.params
        fresh = [b for b in session.branches.values() if not b.expanded]
        passing = sorted(
            (b for b in fresh if b.score >= session.tau),
            key=lambda b: (-b.score, b.child.cluster_id),
        )[: params.beam]
        if not passing and not any(b.expanded for b in session.branches.values()):
            passing = sorted(fresh, key=lambda b: (-b.score, b.child.cluster_id))[
                : params.dead_end_keep
            ]
        for b in passing:
            b.expanded = True
            self._send_down(session, b)
        for b in session.branches.values():
            if (
                b.expanded
                and not b.pending
                and not b.failed
                and b.attempt < session.attempt
                and b.child.level > 1
                and b.frontier >= session.tau
            ):
                self._send_down(session, b)
        self._maybe_reply(session)

    def _send_down(self, session: _Session, b: _Branch) -> None:
        allowance = 2 * self.ctx.params.hop_time
        remaining = session.deadline - self.ctx.now - allowance
        b.attempt = session.attempt
        if remaining <= 0:
            b.pending = False
            b.failed = True
            return
        budget = remaining
        b.pending = True
        b.acked = False
        target = pick_replica(b.child.replicas, session.qid, b.replica_offset)
        msg = QueryDown(
            session.qid,
            b.child.epoch,
            b.child.cluster_id,
            session.querier_id,
            session.signature,
            session.k,
            session.tau,
            session.attempt,
            self.ctx.ref,
            budget,
        )
        self.ctx.send(target, msg)
        # A leaf answers within a round trip and an inner super-peer acknowledges at once, so
        # silence for one allowance means this replica is gone: fail over to the next.
        attempt, offset = session.attempt, b.replica_offset
        b.timer = self.ctx.after(
            allowance, lambda: self._child_timeout(session, b, attempt, offset)
        )

    def on_query_ack(self, src: str, msg: QueryAck) -> None:
        """A child's acknowledgement of a QUERY_DOWN (``attempt >= 0``; a root's ack to a
        querier, ``attempt < 0``, is the querier's)."""
        key = self._by_child.get((msg.qid, msg.cluster_id))
        session = self._sessions.get(key) if key is not None else None
        b = session.branches.get(msg.cluster_id) if session is not None else None
        if session is None or b is None or src not in [r.node_id for r in b.child.replicas]:
            self.ctx.reject("unknown_query")
            return
        if not b.pending or b.attempt != msg.attempt or b.acked:
            return
        b.acked = True
        if b.timer is not None:
            b.timer.cancelled = True  # type: ignore[attr-defined]
        attempt, offset = session.attempt, b.replica_offset
        wait = max(0.0, session.deadline - self.ctx.now)
        b.timer = self.ctx.after(wait, lambda: self._child_timeout(session, b, attempt, offset))

    def _child_timeout(self, session: _Session, b: _Branch, attempt: int, offset: int) -> None:
        if not b.pending or b.attempt != attempt or b.replica_offset != offset or self.ctx.inert:
            return
        b.replica_offset += 1
        self.ctx.counters["search.child_timeouts"] += 1
        if b.replica_offset < len(b.child.replicas):
            self._send_down(session, b)
            if b.pending:
                return
            self._maybe_reply(session)
            return
        b.pending = False
        b.failed = True
        self.ctx.counters["search.branch_failed"] += 1
        self._maybe_reply(session)

    def on_query_partial(self, src: str, msg: QueryPartial) -> None:
        key = self._by_child.get((msg.qid, msg.cluster_id))
        session = self._sessions.get(key) if key is not None else None
        if session is None:
            self.ctx.reject("unknown_query")
            return
        b = session.branches[msg.cluster_id]
        if src not in [r.node_id for r in b.child.replicas]:
            self.ctx.reject("not_member")
            return
        if len(msg.candidates) > max(session.k, 1) or msg.attempt != b.attempt or not b.pending:
            self.ctx.reject("stale" if msg.attempt != b.attempt or not b.pending else "bad_field")
            return
        b.pending = False
        b.failed = False
        b.candidates = msg.candidates
        b.frontier = msg.frontier
        b.stats = msg.stats
        if b.timer is not None:
            b.timer.cancelled = True  # type: ignore[attr-defined]
        self._maybe_reply(session)

    # ------------------------------------------------------------------ merge
    def _summary(self, session: _Session) -> tuple[tuple[Candidate, ...], float, SearchStats]:
        expanded = [b for b in session.branches.values() if b.expanded]
        candidates = merge_top_k((b.candidates for b in expanded), session.k)
        frontier = max(
            [b.score for b in session.branches.values() if not b.expanded]
            + [b.frontier for b in expanded]
            + [NO_FRONTIER]
        )
        scores = np.fromiter((b.score for b in session.branches.values()), dtype=np.float64)
        own = SearchStats(
            prototypes=session.prototypes,
            members=0,
            accepted=int((scores >= session.tau).sum()),
            visited=1,
            failed_branches=sum(1 for b in expanded if b.failed),
            samples=session.samples,
        )
        return candidates, frontier, _add_stats([own, *(b.stats for b in expanded)])

    def _maybe_reply(self, session: _Session) -> None:
        if any(b.pending for b in session.branches.values()):
            return
        if session.replied_attempt == session.attempt:
            return
        session.replied_attempt = session.attempt
        candidates, frontier, stats = self._summary(session)
        if session.reply_to is None:
            self._finish_root(session, candidates, frontier, stats)
            return
        self.ctx.send(
            session.reply_to,
            QueryPartial(
                session.qid, session.cluster_id, session.attempt, candidates, frontier, stats
            ),
        )

    # ------------------------------------------------------------------ root loop
    def _finish_root(
        self,
        session: _Session,
        candidates: tuple[Candidate, ...],
        frontier: float,
        stats: SearchStats,
    ) -> None:
        rq = self._roots.get(session.qid)
        if rq is None or rq.finished:
            return
        params = self.ctx.params
        tau = session.tau
        passed = sum(1 for c in candidates if c.similarity >= tau)
        while passed < session.k and rq.relax_steps < params.max_relax:
            if frontier >= tau:
                break
            if frontier == NO_FRONTIER:
                break
            tau = max(-1.0, tau - params.relax_step)
            rq.relax_steps += 1
            passed = sum(1 for c in candidates if c.similarity >= tau)
        if (
            passed < session.k
            and frontier >= tau
            and rq.relax_steps < params.max_relax
            and not session.expired
            and session.deadline - self.ctx.now > 2 * params.hop_time
        ):
            if tau == session.tau:
                rq.relax_steps += 1
            session.tau = tau
            session.attempt += 1
            self.ctx.counters["search.retries"] += 1
            self._expand(session)
            return
        rq.finished = True
        complete = stats.failed_branches == 0 and (passed >= session.k or frontier == NO_FRONTIER)
        root_role = self._role_of(session.cluster_id)
        result = QueryResult(
            session.qid,
            rq.epoch,
            candidates,
            stats,
            tau,
            complete,
            root_role.descriptor if root_role is not None else self._root_of(rq.epoch),
        )
        self._done[session.qid] = result
        self.ctx.send(rq.querier, result)

    # ------------------------------------------------------------------ housekeeping
    def _forget(self, qid: str) -> None:
        self._roots.pop(qid, None)
        self._done.pop(qid, None)
        for key in [k for k in self._sessions if k[0] == qid]:
            self._forget_session(self._sessions[key])

    def _forget_session(self, session: _Session) -> None:
        self._sessions.pop((session.qid, session.cluster_id), None)
        for cid in session.branches:
            self._by_child.pop((session.qid, cid), None)

    def pending(self) -> int:
        return len(self._sessions)
