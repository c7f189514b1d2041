"""A deterministic in-memory network for :class:`~peerlm.overlay.node.OverlayNode` cores.

Thousands of nodes in one process on a virtual clock. Everything random (placement,
latencies, loss, keys, node timers) derives from one seed, and events at equal times are
ordered by insertion, so a run is reproducible bit for bit.

* **Placement and latency**: nodes sit at uniform points of the unit square; the one-way
  latency of a directed link is ``base + per_unit * distance`` times a per-direction factor
  drawn once from ``[1, 1 + asymmetry]`` (asymmetric links), times a per-message jitter
  factor from ``[1, 1 + jitter]``.
* **Loss**: each message is dropped with probability ``loss``.
* **Neighbour graph**: each node links to its ``d_max // 2`` nearest nodes (lowest RTT),
  links are made symmetric, degrees are capped at ``d_max``, and components are joined by
  their closest pairs, so the graph is connected.
* **Churn**: :meth:`Simulator.kill` (dropout without goodbye), :meth:`Simulator.leave`
  (graceful), :meth:`Simulator.add_node` (a newcomer joining through its nearest live nodes).
* **Accounting**: messages and bytes (:func:`~peerlm.overlay.messages.wire_size`) sent per
  node and per message kind.

VRF keys are derived from the seed and the node id; proofs are verified with the real
ECVRF, memoised by ``(public key, proof, alpha)`` (verification is deterministic), and the
key resolver is the registry of every node's public key (the stand-in for certificates).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
from peerlm.overlay import vrf
from peerlm.overlay.events import Event, Send
from peerlm.overlay.messages import Message, NodeRef, SizeMemo, wire_size
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams

__all__ = ["LinkModel", "Simulator"]


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Latency and loss of the simulated network (seconds, probabilities)."""

    base: float = 0.005
    per_unit: float = 0.04
    asymmetry: float = 0.3
    jitter: float = 0.2
    loss: float = 0.0


class _VerifyCache:
    def __init__(self) -> None:
        self._cache: dict[tuple[bytes, bytes, bytes], bytes | None] = {}
        self.hits = 0

    def __call__(self, pk: bytes, proof: bytes, alpha: bytes) -> bytes | None:
        key = (pk, proof, alpha)
        if key in self._cache:
            self.hits += 1
            return self._cache[key]
        beta = vrf.verify(pk, proof, alpha)
        self._cache[key] = beta
        return beta


class Simulator:
    """An event-driven network of overlay nodes on a virtual clock."""

    def __init__(
        self,
        params: OverlayParams,
        seed: int = 0,
        links: LinkModel | None = None,
        on_event: Callable[[str, Event], None] | None = None,
    ) -> None:
        self.params = params
        self.links = links or LinkModel()
        self.seed = seed
        self.now = 0.0
        self.nodes: dict[str, OverlayNode] = {}
        self.alive: set[str] = set()
        self.positions: dict[str, tuple[float, float]] = {}
        self.keys: dict[str, bytes] = {}
        self._rng = random.Random(seed)
        self._queue: list[tuple[float, int, int, str, object]] = []
        self._seq = 0
        self._scheduled: dict[str, float] = {}
        self._fixed: dict[tuple[str, str], float] = {}
        self._verify = _VerifyCache()
        # Messages, descriptors and member entries recur in many sends: size each once.
        self._sizes: SizeMemo = {}
        self._on_event = on_event
        self.events: list[tuple[float, str, Event]] = []
        self.sent_messages: Counter[str] = Counter()
        self.sent_bytes: Counter[str] = Counter()
        self.kind_messages: Counter[str] = Counter()
        self.kind_bytes: Counter[str] = Counter()
        self.delivered = 0
        self.dropped = 0
        self._created = 0

    # ------------------------------------------------------------------ nodes
    def _secret(self, node_id: str) -> bytes:
        return hashlib.sha256(f"peerlm-sim-{self.seed}-{node_id}".encode()).digest()

    def create_node(self, node_id: str, position: tuple[float, float] | None = None) -> OverlayNode:
        """Create a node (not yet connected); returns it."""
        if node_id in self.nodes:
            raise ValueError(f"duplicate node id {node_id}")
        sk = self._secret(node_id)
        self.keys[node_id] = vrf.public_key(sk)
        self._created += 1
        node = OverlayNode(
            node_id,
            f"sim://{node_id}",
            self.params,
            sk,
            rng=random.Random(f"{self.seed}/{node_id}"),
            key_resolver=self.keys.get,
            vrf_verify=self._verify,
        )
        self.nodes[node_id] = node
        self.alive.add(node_id)
        self.positions[node_id] = position or (self._rng.random(), self._rng.random())
        return node

    def distance(self, a: str, b: str) -> float:
        pa, pb = self.positions[a], self.positions[b]
        return math.hypot(pa[0] - pb[0], pa[1] - pb[1])

    def latency(self, src: str, dst: str) -> float:
        key = (src, dst)
        # ``base * factor`` of the link (positions never move), then the jitter: the same
        # products, in the same order, as computing both per message.
        fixed = self._fixed.get(key)
        if fixed is None:
            h = hashlib.sha256(f"{self.seed}|{src}|{dst}".encode()).digest()
            factor = 1.0 + self.links.asymmetry * int.from_bytes(h[:4], "big") / 2**32
            base = self.links.base + self.links.per_unit * self.distance(src, dst)
            fixed = base * factor
            self._fixed[key] = fixed
        return fixed * (1.0 + self.links.jitter * self._rng.random())

    def build_graph(self, ids: list[str] | None = None) -> dict[str, list[str]]:
        """Neighbour sets preferring low RTT (see the module docstring); applied to nodes."""
        ids = sorted(ids if ids is not None else self.alive)
        n = len(ids)
        d_max = self.params.max_neighbours
        if n <= 1:
            return {i: [] for i in ids}
        pts = np.array([self.positions[i] for i in ids])
        k = max(1, min(n - 1, d_max // 2))
        adj: list[set[int]] = [set() for _ in range(n)]
        nearest = _nearest(pts, k)
        for a in range(n):
            for b in nearest[a]:
                b = int(b)
                if len(adj[a]) < d_max and len(adj[b]) < d_max:
                    adj[a].add(b)
                    adj[b].add(a)
        self._connect(adj, pts)
        graph = {ids[a]: [ids[b] for b in sorted(adj[a])] for a in range(n)}
        for nid, neigh in graph.items():
            self.nodes[nid].set_neighbours([self.nodes[m].ref for m in neigh], self.now)
        return graph

    @staticmethod
    def _connect(adj: list[set[int]], pts: np.ndarray) -> None:
        n = len(adj)
        while True:
            comp = [-1] * n
            count = 0
            for s in range(n):
                if comp[s] >= 0:
                    continue
                stack = [s]
                comp[s] = count
                while stack:
                    x = stack.pop()
                    for y in adj[x]:
                        if comp[y] < 0:
                            comp[y] = count
                            stack.append(y)
                count += 1
            if count == 1:
                return
            labels = np.asarray(comp)
            inside = np.flatnonzero(labels == 0)
            outside = np.flatnonzero(labels != 0)
            a_local, b_local = _closest_pair(pts[inside], pts[outside])
            a = int(inside[a_local])
            b = int(outside[b_local])
            adj[a].add(b)
            adj[b].add(a)

    # ------------------------------------------------------------------ events
    def _push(self, at: float, kind: int, node_id: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, kind, node_id, payload))

    def _reschedule(self, node_id: str) -> None:
        node = self.nodes[node_id]
        deadline = node.next_deadline()
        if deadline is None:
            return
        current = self._scheduled.get(node_id)
        if current is not None and current <= deadline:
            return
        self._scheduled[node_id] = deadline
        self._push(deadline, 0, node_id, None)

    def deliver(self, src: str, sends: list[Send]) -> None:
        """Put ``sends`` from ``src`` on the wire."""
        sizes = self._sizes
        if len(sizes) > _SIZE_MEMO_ENTRIES:
            sizes.clear()
        if sends:
            # Per-message work of the whole run: locals instead of attribute look-ups.
            loss = self.links.loss
            nodes = self.nodes
            kind_messages, kind_bytes = self.kind_messages, self.kind_bytes
            total = 0
            for s in sends:
                msg = s.msg
                size = wire_size(msg, sizes)
                total += size
                kind = msg.KIND
                kind_messages[kind] += 1
                kind_bytes[kind] += size
                if loss > 0 and self._rng.random() < loss:
                    self.dropped += 1
                    continue
                dst = s.dst_id
                if dst not in nodes:
                    self.dropped += 1
                    continue
                self._push(self.now + self.latency(src, dst), 1, dst, (src, msg))
            self.sent_messages[src] += len(sends)
            self.sent_bytes[src] += total
        self._collect(src)
        self._reschedule(src)

    def _collect(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.ctx.events:
            return
        for ev in node.pop_events():
            self.events.append((self.now, node_id, ev))
            if self._on_event is not None:
                self._on_event(node_id, ev)

    def call(self, node_id: str, fn: Callable[[OverlayNode], list[Send]]) -> None:
        """Run an application call on a node at the current time and send its output."""
        if node_id not in self.alive:
            return
        self.deliver(node_id, fn(self.nodes[node_id]))

    def schedule(self, at: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``at`` (churn, queries)."""
        self._push(at, 2, "", fn)

    def run_until(self, t: float, stop: Callable[[], bool] | None = None) -> None:
        """Process events up to time ``t`` (or until ``stop()`` is true)."""
        queue, alive, nodes, scheduled = self._queue, self.alive, self.nodes, self._scheduled
        pop = heapq.heappop
        while queue and queue[0][0] <= t:
            at, _, kind, node_id, payload = pop(queue)
            self.now = at
            if kind == 2:
                assert callable(payload)
                payload()
                continue
            if node_id not in alive:
                if kind == 1:
                    self.dropped += 1
                continue
            node = nodes[node_id]
            if kind == 0:
                if scheduled.get(node_id) != at:
                    continue
                del scheduled[node_id]
                self.deliver(node_id, node.on_tick(at))
            else:
                src, msg = cast(tuple[str, Message], payload)
                self.delivered += 1
                self.deliver(node_id, node.on_message(src, msg, at))
            if stop is not None and stop():
                return
        self.now = max(self.now, t)

    # ------------------------------------------------------------------ churn
    def kill(self, node_id: str) -> None:
        """Dropout: the node vanishes without a word."""
        self.alive.discard(node_id)
        self._scheduled.pop(node_id, None)

    def leave(self, node_id: str) -> None:
        """Graceful leave: the node resigns its roles and says goodbye, then stops."""
        if node_id in self.alive:
            self.deliver(node_id, self.nodes[node_id].leave(self.now))
            self.alive.discard(node_id)
            self._scheduled.pop(node_id, None)

    def nearest_alive(self, node_id: str, count: int) -> list[str]:
        others = [n for n in self.alive if n != node_id]
        others.sort(key=lambda n: (self.distance(node_id, n), n))
        return others[:count]

    def add_node(self, node_id: str, setup: Callable[[OverlayNode], list[Send]]) -> OverlayNode:
        """A newcomer: created, ``setup`` run (e.g. set_signature), then joins via its
        ``d_max // 2`` nearest live nodes."""
        node = self.create_node(node_id)
        self.deliver(node_id, setup(node))
        boot = self.nearest_alive(node_id, max(1, self.params.max_neighbours // 2))
        self.deliver(node_id, node.join([self.nodes[b].ref for b in boot], self.now))
        return node

    # ------------------------------------------------------------------ accounting
    def messages_by_kind(self, kinds: set[str]) -> int:
        return sum(v for k, v in self.kind_messages.items() if k in kinds)

    def verify_cache_hits(self) -> int:
        return self._verify.hits

    def stats(self) -> dict[str, object]:
        per_node = defaultdict(int, self.sent_bytes)
        n = max(1, self._created)
        return {
            "now": self.now,
            "messages": sum(self.sent_messages.values()),
            "bytes": sum(self.sent_bytes.values()),
            "bytes_per_node": sum(per_node.values()) / n,
            "delivered": self.delivered,
            "dropped": self.dropped,
        }


_SIZE_MEMO_ENTRIES = 200_000
"""Records whose wire size the simulator remembers before starting afresh."""

_ROWS_PER_BLOCK = 1024
"""Distance rows computed at once (``N`` x this many floats), so memory stays ``O(N)``."""


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows of ``a`` and of ``b`` (the one formula used, so
    that every ordering below sees bit-identical values)."""
    return np.asarray(np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)))


def _nearest(pts: np.ndarray, k: int) -> np.ndarray:
    """Row ``i``: the ``k`` points nearest to point ``i`` (itself excluded), ordered by
    distance, ties to the lower index, as a stable argsort of the full distance matrix
    orders them, without building that ``N x N`` matrix: a k-d tree proposes ``k + 4``
    candidates per point and the exact distances order them."""
    from scipy.spatial import cKDTree

    n = len(pts)
    want = min(n, k + 5)
    _, cand = cKDTree(pts).query(pts, k=want)
    cand = np.asarray(cand).reshape(n, want)
    out = np.empty((n, k), dtype=np.int64)
    for i in range(n):
        row = cand[i][cand[i] != i]
        d = _distances(pts[i : i + 1], pts[row])[0]
        order = np.lexsort((row, d))
        out[i] = row[order[:k]]
    return out


def _closest_pair(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """``(i, j)`` minimising the distance of ``a[i]`` and ``b[j]``; the first such pair in
    row-major order, as ``argmin`` over the full ``|a| x |b|`` matrix would find."""
    best = (np.inf, 0, 0)
    for start in range(0, len(a), _ROWS_PER_BLOCK):
        block = _distances(a[start : start + _ROWS_PER_BLOCK], b)
        flat = int(np.argmin(block))
        value = float(block.flat[flat])
        if value < best[0]:
            i, j = divmod(flat, block.shape[1])
            best = (value, start + i, j)
    return best[1], best[2]


def deliver_all(sim: Simulator, node_id: str, msgs: list[tuple[NodeRef, Message]]) -> None:
    """Test helper: inject messages as if ``node_id`` had sent them."""
    sim.deliver(node_id, [Send(ref.node_id, ref.address, msg) for ref, msg in msgs])
