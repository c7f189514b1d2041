"""Disjoint pair selection: Algorithm 2's greedy pass, and an exact max-weight alternative.

*Greedy* (the paper's lines 8-12): walk the candidates in descending UCB order and keep a
candidate when both its agents are still unmatched, until ``K_p`` pairs are kept. Its
total weight is at least half the optimum (greedy matching is a 1/2-approximation).

*Blossom* (``matching="blossom"``): the exact problem the greedy pass approximates —
a matching of exactly ``k = min(K_p, floor(N/2))`` pairs with the largest total weight —
solved with Edmonds' blossom algorithm (``networkx.max_weight_matching``). Choices:

* One edge per unordered pair, weighted by the pair's best UCB over both directions,
  all protocols and all roles; the matched edge is then played with that best tuple.
* Algorithm 2 fills the budget whenever agents remain (it takes a negative-UCB pair
  rather than none), so the blossom variant fills it too: ``maxcardinality=True``.
* A budget below ``floor(N/2)`` is made exact, not approximated by truncating a
  maximum matching (which can lose: with ``w(ab)=10, w(cd)=1, w(ac)=w(bd)=6`` and
  ``K_p = 1`` the best perfect matching is {ac, bd}, truncated to 6 < 10). Instead
  ``N - 2k`` dummy vertices are joined to every agent by weight-0 edges: a perfect
  matching of the augmented graph then has exactly ``k`` agent-agent edges, and the
  maximum-weight perfect matching is the best ``k``-pair matching.
* Weights are shifted to be >= 1 so that every agent-agent edge outweighs a dummy edge
  (relevant only when the candidate graph is too sparse for ``k`` pairs; among perfect
  matchings, all of which have ``k`` agent edges, a constant shift changes nothing).
* Blossom is O(V^3) in pure Python: meant for small federations and the oracle
  benchmark, not for thousands of agents (the greedy default is).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np
from numpy.typing import NDArray

__all__ = [
    "greedy_disjoint",
    "greedy_disjoint_sequential",
    "greedy_students",
    "max_weight_disjoint",
]


def greedy_disjoint(
    senders: NDArray[np.intp],
    receivers: NDArray[np.intp],
    order: NDArray[np.intp],
    budget: int,
    n_agents: int,
) -> list[int]:
    """Indices of the candidates kept by the greedy disjoint pass, in the order kept.

    ``order`` lists candidate indices best first (ties already broken by the caller).
    Keeps at most ``min(budget, n_agents // 2)`` candidates. Equal to
    :func:`greedy_disjoint_sequential` (the plain loop, kept as the reference the tests
    compare against) but vectorised: a candidate is kept by the greedy walk exactly when it
    comes first, among the candidates still alive, at both of its agents (a *locally
    dominant* edge). Each round keeps every such candidate at once, marks their agents,
    and drops the candidates touching them; what remains is the same greedy problem on the
    free agents, so the union over rounds is the greedy matching. Prefiltered candidate
    lists need ~10-20 rounds (the first keep few: a handful of agents rank high with
    everyone). A round after the 16th that keeps few candidates (long chains of decreasing
    weight), or the 64th round, hands the rest to the plain loop, so the worst case stays
    O(candidates) Python steps plus 64 vectorised rounds. The budget keeps the first
    ``limit`` of the full greedy matching by rank, which is what the greedy walk with a
    budget keeps (its earlier decisions do not depend on the budget).
    """
    limit = min(budget, n_agents // 2)
    if limit <= 0 or len(order) == 0:
        return []
    order = np.asarray(order, dtype=np.intp)
    s = np.asarray(senders, dtype=np.intp)[order]
    r = np.asarray(receivers, dtype=np.intp)[order]
    # Positions in the walk (= rank); a self-pair is never kept.
    pos = np.flatnonzero(s != r).astype(np.intp)
    s, r = s[pos], r[pos]
    kept: list[NDArray[np.intp]] = []
    n_kept = 0
    used = np.zeros(n_agents, dtype=bool)
    first = np.empty(n_agents, dtype=np.intp)
    end = len(order)
    rounds = 0
    while len(pos):
        # Each agent's first alive candidate (its best remaining rank).
        first.fill(end)
        np.minimum.at(first, s, pos)
        np.minimum.at(first, r, pos)
        dominant = (first[s] == pos) & (first[r] == pos)
        won = pos[dominant]
        kept.append(won)
        n_kept += len(won)
        used[s[dominant]] = True
        used[r[dominant]] = True
        alive = ~(used[s] | used[r])
        pos, s, r = pos[alive], s[alive], r[alive]
        if n_kept >= limit and (not len(pos) or _kth(kept, limit) < pos[0]):
            break  # every later keep would rank after the first `limit` ones
        rounds += 1
        if len(pos) and (rounds >= _MAX_ROUNDS or (rounds >= 16 and len(won) < _MIN_ROUND_KEEP)):
            kept.append(_walk(pos, s, r, used))
            break
    if not kept:
        return []
    ranks = np.sort(np.concatenate(kept))[:limit]
    out: list[int] = order[ranks].tolist()
    return out


# After 16 rounds, a round keeping fewer than this hands the rest to the plain walk; after
# _MAX_ROUNDS rounds the walk takes over regardless. Score structure (a few agents that rank
# high with everyone) makes the first rounds keep few, so the walk must not start too early.
_MIN_ROUND_KEEP = 32
_MAX_ROUNDS = 64


def _kth(kept: list[NDArray[np.intp]], k: int) -> int:
    """The ``k``-th smallest rank kept so far (1-based)."""
    return int(np.partition(np.concatenate(kept), k - 1)[k - 1])


def _walk(
    pos: NDArray[np.intp], s: NDArray[np.intp], r: NDArray[np.intp], used: NDArray[np.bool_]
) -> NDArray[np.intp]:
    """The plain greedy walk over candidates already in rank order; marks ``used``."""
    taken = bytearray(used.tobytes())
    out: list[int] = []
    for p, a, b in zip(pos.tolist(), s.tolist(), r.tolist(), strict=True):
        if taken[a] or taken[b]:
            continue
        taken[a] = taken[b] = 1
        out.append(p)
    return np.asarray(out, dtype=np.intp)


def greedy_disjoint_sequential(
    senders: NDArray[np.intp],
    receivers: NDArray[np.intp],
    order: NDArray[np.intp],
    budget: int,
    n_agents: int,
) -> list[int]:
    """The greedy disjoint pass as a plain loop (the reference for :func:`greedy_disjoint`).

    Walks ``order`` and keeps a candidate when both agents are still free, until
    ``min(budget, n_agents // 2)`` are kept.
    """
    limit = min(budget, n_agents // 2)
    chosen: list[int] = []
    if limit <= 0:
        return chosen
    used = bytearray(n_agents)
    order = np.asarray(order, dtype=np.intp)
    s_list = np.asarray(senders)[order].tolist()
    r_list = np.asarray(receivers)[order].tolist()
    for cand, s, r in zip(order.tolist(), s_list, r_list, strict=True):
        if used[s] or used[r] or s == r:
            continue
        used[s] = used[r] = 1
        chosen.append(cand)
        if len(chosen) == limit:
            break
    return chosen


def greedy_students(
    senders: NDArray[np.intp],
    receivers: NDArray[np.intp],
    budget: int,
    served: NDArray[np.intp],
    load: NDArray[np.intp],
    capacity: int,
    teachers: int = 1,
    taken: set[tuple[int, int]] | None = None,
) -> list[int]:
    """Positions kept by the greedy walk of ``pairing="per_student"`` (ours, beyond
    Algorithm 2; docs/matchmaker.md, "A student every round").

    ``senders`` and ``receivers`` are the candidates' agents already in walk order (best
    first). A candidate is kept when its receiver has fewer than ``teachers`` teachers
    this round (``served``, a count per agent), its sender teaches fewer than ``capacity``
    students (``load``), the two differ and the sender does not teach that receiver yet
    this round (``taken``, the (sender, receiver) pairs kept so far: a pair has one
    tuple a round, whatever the protocols); at most ``budget`` are kept. An agent may be
    a teacher and a student in the same round. ``served``, ``load`` and ``taken`` are
    updated in place, so that refill passes continue from this one.
    """
    chosen: list[int] = []
    if budget <= 0 or capacity <= 0 or teachers <= 0:
        return chosen
    kept = set() if taken is None else taken
    for k, (s, r) in enumerate(zip(senders.tolist(), receivers.tolist(), strict=True)):
        if s == r or served[r] >= teachers or load[s] >= capacity or (s, r) in kept:
            continue
        served[r] += 1
        load[s] += 1
        kept.add((s, r))
        chosen.append(k)
        if len(chosen) == budget:
            break
    return chosen


def max_weight_disjoint(
    left: Sequence[int] | NDArray[np.intp],
    right: Sequence[int] | NDArray[np.intp],
    weights: Sequence[float] | NDArray[np.float64],
    budget: int,
    n_agents: int,
) -> list[int]:
    """Indices of the edges in a maximum-weight matching of ``min(budget, N//2)`` edges.

    Edge ``e`` joins agents ``left[e]`` and ``right[e]`` (distinct, each unordered pair at
    most once) with weight ``weights[e]``. Returned best edge first.
    """
    k = min(budget, n_agents // 2)
    w = np.asarray(weights, dtype=np.float64)
    if k <= 0 or len(w) == 0:
        return []
    shifted = w - float(w.min()) + 1.0
    graph = nx.Graph()
    graph.add_nodes_from(range(n_agents))
    index: dict[tuple[int, int], int] = {}
    for e, (a, b) in enumerate(
        zip(np.asarray(left).tolist(), np.asarray(right).tolist(), strict=True)
    ):
        key = (a, b) if a < b else (b, a)
        index[key] = e
        graph.add_edge(a, b, weight=float(shifted[e]))
    n_dummy = n_agents - 2 * k
    if n_dummy >= 2:
        graph.add_edges_from(
            (n_agents + d, a, {"weight": 0.0}) for d in range(n_dummy) for a in range(n_agents)
        )
    matching = nx.max_weight_matching(graph, maxcardinality=True, weight="weight")
    edges = []
    for a, b in matching:
        if a >= n_agents or b >= n_agents:
            continue
        edges.append(index[(a, b) if a < b else (b, a)])
    # The matching comes back as a set: sort by weight, then edge index, to be deterministic.
    edges.sort(key=lambda e: (-float(w[e]), e))
    return edges[:k]
