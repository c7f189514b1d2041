"""``peerlm bench overlay``: the semantic overlay in the simulator against exact and HNSW top-K.

One run per network size N (see ``docs/bench-overlay.md`` for the definitions):

1. A clustered non-IID population (:mod:`peerlm.overlay.population`) of N signatures, N
   nodes in the simulator (:mod:`peerlm.overlay.sim`) on a low-RTT neighbour graph, the
   paper's defaults (``S_Z = 0.05 N``, ``r = 3``, ``(B, F) = (8, 8)``).
2. The build of epoch 0: ``build_seconds`` from the epoch start until the last node learnt
   the root (EPOCH_ANNOUNCE), ``build_rounds`` the same in hop times ``t_a``, ``depth``.
3. ``rounds`` query rounds of ``period`` simulated seconds. With ``--churn f``, in every
   round after the first ``f N`` peers leave (half drop out without a word, half leave
   gracefully) and ``f N`` newcomers (fresh members of the same population) join, at
   uniform times in the first ``period - settle`` seconds; then every live peer (or a
   seeded sample of ``queries`` peers, the same ones every round while they live) asks
   for its top K.
4. Recall@K = ``|returned ∩ exact| / K`` against the exact top-K by cosine over the live
   peers' signatures (Sec. 5.3), averaged over queriers and over the rounds after the first
   (the first round also initialises ``tau``; it is reported separately). The HNSW
   reference indexes the same signatures (dense, cosine) in ``usearch`` and is scored the
   same way on the final round's population.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from peerlm.overlay import (
    BuildFinished,
    ClusteredPopulation,
    LinkModel,
    Member,
    OverlayNode,
    OverlayParams,
    PopulationSpec,
    QueryCompleted,
    Send,
    Signature,
    Simulator,
    cosine_rows,
    paper_k,
    round_half_up,
)

__all__ = [
    "BenchConfig",
    "exact_top_k",
    "exact_top_k_of",
    "hnsw_recall",
    "parse_k",
    "render_report",
    "run_benchmark",
    "run_one",
    "write_plots",
]

_TOP_K_BLOCK = 512
"""Rows of the exact top-K computed at once (``N`` similarities each)."""
QUERY_KINDS = frozenset({"QUERY", "QUERY_ACK", "QUERY_DOWN", "QUERY_PARTIAL", "QUERY_RESULT"})
Progress = Callable[[str, int, int], None]


def parse_k(text: str) -> tuple[float | None, int | None]:
    """``"10%"`` -> ``(0.10, None)``; ``"25"`` -> ``(None, 25)``. Raises ``ValueError``."""
    text = text.strip()
    if text.endswith("%"):
        frac = float(text[:-1]) / 100.0
        if not 0 < frac < 1:
            raise ValueError(f"K as a percentage must lie in (0%, 100%), got {text}")
        return frac, None
    k = int(text)
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    return None, k


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark invocation."""

    peers: tuple[int, ...] = (1000,)
    k: str = "10%"
    zone_cap: str = "5%"
    churn: float = 0.0
    seed: int = 0
    rounds: int = 3
    queries: int | None = None
    period: float = 30.0
    settle: float = 6.0
    hnsw: bool = True
    population: PopulationSpec = field(default_factory=PopulationSpec)
    links: LinkModel = field(default_factory=LinkModel)
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def zone_cap_for(self, n: int) -> int:
        frac, absolute = parse_k(self.zone_cap)
        if absolute is not None:
            return max(2, absolute)
        assert frac is not None
        return max(2, round_half_up(frac * n))

    def k_for(self, n: int) -> int:
        frac, absolute = parse_k(self.k)
        if absolute is not None:
            return min(absolute, n - 1)
        assert frac is not None
        return paper_k(n, frac)


def exact_top_k(signatures: Sequence[Signature], k: int) -> list[set[int]]:
    """Row ``i``: indices of the ``k`` signatures most similar to ``i`` (itself excluded),
    ties to the lower index."""
    rows = exact_top_k_of(signatures, k, range(len(signatures)))
    return [rows[i] for i in range(len(signatures))]


def exact_top_k_of(
    signatures: Sequence[Signature], k: int, rows: Iterable[int]
) -> dict[int, set[int]]:
    """:func:`exact_top_k` for the given rows only, computed in blocks of rows so that
    memory is ``O(N)`` per block instead of the ``N x N`` similarity matrix."""
    wanted = sorted(set(rows))
    out: dict[int, set[int]] = {}
    for start in range(0, len(wanted), _TOP_K_BLOCK):
        block = wanted[start : start + _TOP_K_BLOCK]
        sim = cosine_rows(signatures, block)
        sim[np.arange(len(block)), block] = -np.inf
        order = np.argsort(-sim, axis=1, kind="stable")[:, :k]
        out.update({i: set(int(j) for j in row) for i, row in zip(block, order, strict=True)})
    return out


def hnsw_recall(
    signatures: Sequence[Signature], truth: Mapping[int, set[int]], k: int, seed: int
) -> float:
    """Recall@K of a centralised HNSW index (usearch, cosine, one thread) over the same
    signatures as dense vectors; each peer's own entry is removed from its answer."""
    from usearch.index import Index

    dense = np.stack([s.dense() for s in signatures]).astype(np.float32)
    index = Index(ndim=dense.shape[1], metric="cos")
    index.add(np.arange(len(signatures), dtype=np.uint64), dense, threads=1)
    found = index.search(dense, k + 1, threads=1)
    recalls = []
    for i, row in enumerate(np.asarray(found.keys)):
        got = [int(j) for j in row if int(j) != i][:k]
        recalls.append(len(truth[i].intersection(got)) / k)
    return float(np.mean(recalls))


@dataclass
class _Round:
    recall: list[float] = field(default_factory=list)
    comparisons: list[int] = field(default_factory=list)
    prototypes: list[int] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    answered: int = 0
    unanswered: int = 0
    incomplete: int = 0
    queries: int = 0
    messages: int = 0
    live: int = 0


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """CPython's cyclic collector paused while the simulator runs, then run once.

    The simulator holds millions of long-lived objects (every node's state, the pending
    messages) and makes almost no reference cycles while it runs (a query session's
    callbacks); each automatic full collection re-scanned the whole heap, about a fifth of
    the CPU of an N = 500 run and more as N grows. Reference counting still frees
    everything else at once, so memory grows only by the few cycles, freed at the end.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def run_one(cfg: BenchConfig, n: int, progress: Progress | None = None) -> dict[str, Any]:
    """One network size: build, then ``cfg.rounds`` query rounds (with churn if asked)."""
    with _no_cyclic_gc():
        return _run_one(cfg, n, progress)


def _run_one(cfg: BenchConfig, n: int, progress: Progress | None) -> dict[str, Any]:
    wall0 = time.perf_counter()
    k = cfg.k_for(n)
    overrides = {"zone_cap": cfg.zone_cap_for(n), **dict(cfg.overrides)}
    params = OverlayParams(genesis_time=1.0, **overrides)
    sim = Simulator(params, seed=cfg.seed, links=cfg.links)
    population = ClusteredPopulation(cfg.population, seed=cfg.seed)
    members: dict[str, Member] = {}
    ids = [f"p{i:05d}" for i in range(n)]
    for nid, member in zip(ids, population.draw(n), strict=True):
        members[nid] = member
        sim.create_node(nid)
    sim.build_graph()
    for nid in ids:
        sim.call(nid, _publisher(members[nid], 0.0))
    if progress:
        progress(f"N={n}: build", 0, cfg.rounds + 1)
    build_deadline = params.genesis_time + params.max_levels * params.level_duration + 2.0

    sim.run_until(build_deadline)
    finish = [t for t, _, ev in sim.events if isinstance(ev, BuildFinished)]
    depth = max((ev.depth for _, _, ev in sim.events if isinstance(ev, BuildFinished)), default=0)
    build_seconds = (max(finish) - params.genesis_time) if finish else float("nan")
    build_bytes = sum(sim.sent_bytes.values())
    build_messages = sum(sim.sent_messages.values())
    roots = {ev.root_id for _, _, ev in sim.events if isinstance(ev, BuildFinished)}
    clustering = {
        "affinity_propagation": sum(
            node.counters.get("cluster.affinity_propagation", 0) for node in sim.nodes.values()
        ),
        "fallback": sum(
            node.counters.get("cluster.ap", 0) + node.counters.get("cluster.k_medoids", 0)
            for node in sim.nodes.values()
        ),
    }
    rng = random.Random(cfg.seed * 7919 + n)
    next_id = n
    rounds: list[_Round] = []
    sample: list[str] = []
    hnsw = float("nan")
    for rnd in range(cfg.rounds):
        t0 = sim.now
        if cfg.churn > 0 and rnd > 0:
            alive = sorted(sim.alive)
            count = min(len(alive) - 2, round(cfg.churn * n))
            leaving = rng.sample(alive, count)
            window = cfg.period - cfg.settle
            for i, nid in enumerate(leaving):
                at = t0 + rng.random() * window
                sim.schedule(at, partial(sim.kill if i % 2 == 0 else sim.leave, nid))
            for _ in range(count):
                nid = f"p{next_id:05d}"
                next_id += 1
                member = population.draw(1)[0]
                members[nid] = member
                at = t0 + rng.random() * window
                sim.schedule(at, partial(_arrive, sim, nid, member))
            sim.run_until(t0 + window)
        else:
            sim.run_until(t0 + 0.5)
        live = sorted(sim.alive)
        index = {nid: i for i, nid in enumerate(live)}
        sigs = [members[nid].signature for nid in live]
        queriers = live
        if cfg.queries is not None and cfg.queries < len(live):
            # The same peers query every round (their tau controllers warm up), topped up
            # with random live peers where churn took some away.
            kept = [nid for nid in sample if nid in sim.alive]
            fresh = [nid for nid in live if nid not in set(kept)]
            kept += rng.sample(fresh, min(len(fresh), cfg.queries - len(kept)))
            sample = kept
            queriers = sorted(sample)
        # Only the queriers' rows are needed, unless the HNSW reference scores every peer.
        scored_all = cfg.hnsw and rnd == cfg.rounds - 1
        truth = exact_top_k_of(
            sigs, k, range(len(sigs)) if scored_all else [index[q] for q in queriers]
        )
        start_events = len(sim.events)
        messages0 = sim.messages_by_kind(set(QUERY_KINDS))
        qids: dict[str, str] = {}
        for nid in queriers:
            node = sim.nodes[nid]
            qid, sends = node.start_query(k, sim.now)
            qids[qid] = nid
            sim.deliver(nid, sends)
        sim.run_until(sim.now + params.query_timeout + 1.0)
        result = _Round(live=len(live), queries=len(queriers))
        for _, nid, ev in sim.events[start_events:]:
            if not isinstance(ev, QueryCompleted) or ev.qid not in qids:
                continue
            got = {index[c.node_id] for c in ev.results if c.node_id in index}
            result.recall.append(len(truth[index[nid]] & got) / k)
            answered = ev.stats.visited > 0
            result.answered += answered
            result.unanswered += not answered
            result.incomplete += not ev.complete
            result.comparisons.append(ev.stats.scored)
            result.prototypes.append(ev.stats.prototypes)
            result.latency.append(ev.latency)
        missing = len(queriers) - len(result.recall)
        result.unanswered += missing
        result.recall.extend([0.0] * missing)
        result.messages = sim.messages_by_kind(set(QUERY_KINDS)) - messages0
        rounds.append(result)
        if cfg.hnsw and rnd == cfg.rounds - 1:
            hnsw = hnsw_recall(sigs, truth, k, cfg.seed)
        if not math.isclose(sim.now, t0 + cfg.period) and sim.now < t0 + cfg.period:
            sim.run_until(t0 + cfg.period)
        if progress:
            progress(f"N={n}: round {rnd + 1}/{cfg.rounds}", rnd + 1, cfg.rounds + 1)
    measured = rounds[1:] if len(rounds) > 1 else rounds
    total_bytes = sum(sim.sent_bytes.values())
    sim_seconds = sim.now - params.genesis_time
    query_bytes = sum(v for kind, v in sim.kind_bytes.items() if kind in QUERY_KINDS)
    all_queries = sum(r.queries for r in rounds)

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else float("nan")

    return {
        "n": n,
        "k": k,
        "zone_cap": params.zone_cap,
        "churn": cfg.churn,
        "seed": cfg.seed,
        "recall_at_k": mean([x for r in measured for x in r.recall]),
        "recall_at_k_min": float(min((min(r.recall) for r in measured if r.recall), default=0.0)),
        "recall_first_round": mean(rounds[0].recall),
        "recall_per_round": [mean(r.recall) for r in rounds],
        "hnsw_recall_at_k": hnsw,
        "comparisons_per_query": mean([float(x) for r in measured for x in r.comparisons]),
        "prototype_comparisons_per_query": mean([float(x) for r in measured for x in r.prototypes]),
        "comparisons_share_of_n": mean([float(x) for r in measured for x in r.comparisons]) / n,
        "comparisons_per_k": mean([float(x) for r in measured for x in r.comparisons]) / k,
        "messages_per_query": sum(r.messages for r in measured)
        / max(1, sum(r.queries for r in measured)),
        "query_latency_s": mean([x for r in measured for x in r.latency]),
        "unanswered_queries": sum(r.unanswered for r in rounds),
        "incomplete_queries": sum(r.incomplete for r in rounds),
        "queries": all_queries,
        "depth": depth,
        "roots": len(roots),
        "build_seconds": build_seconds,
        "build_rounds": build_seconds / params.hop_time if finish else float("nan"),
        "build_announced": len(finish),
        "build_messages_per_node": build_messages / n,
        "build_bytes_per_node": build_bytes / n,
        "control_bytes_per_node": total_bytes / max(1, len(sim.nodes)),
        "control_bytes_per_node_per_s": total_bytes
        / max(1, len(sim.nodes))
        / max(sim_seconds, 1e-9),
        "query_bytes_per_query": query_bytes / max(1, all_queries),
        "simulated_seconds": sim_seconds,
        "messages_by_kind": dict(sorted(sim.kind_messages.items())),
        "clustering": clustering,
        "wall_seconds": time.perf_counter() - wall0,
    }


def _publisher(member: Member, now: float) -> Callable[[OverlayNode], list[Send]]:
    def publish(node: OverlayNode) -> list[Send]:
        return node.set_signature(member.signature, now, member.p_min)

    return publish


def _arrive(sim: Simulator, nid: str, member: Member) -> None:
    sim.add_node(nid, _publisher(member, sim.now))


def run_benchmark(cfg: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Every network size in ``cfg.peers``; returns the JSON-ready report."""
    runs = [_finite_or_none(run_one(cfg, n, progress)) for n in cfg.peers]
    config = asdict(replace(cfg, overrides=dict(cfg.overrides)))
    report: dict[str, Any] = {"config": config, "runs": runs}
    if len(runs) == 1:
        report.update({key: value for key, value in runs[0].items() if key != "messages_by_kind"})
    else:
        for key in (
            "recall_at_k",
            "hnsw_recall_at_k",
            "comparisons_per_query",
            "messages_per_query",
            "depth",
            "build_rounds",
            "build_seconds",
            "control_bytes_per_node",
            "unanswered_queries",
        ):
            report[key] = {str(r["n"]): r[key] for r in runs}
    return report


def _finite_or_none(run: dict[str, Any]) -> dict[str, Any]:
    """NaN (a metric that was not measured) becomes ``None``, so the JSON is strict."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in run.items()}


def render_report(report: Mapping[str, Any], console: Any) -> None:
    """A rich table of the runs."""
    from rich.table import Table

    table = Table(title="semantic overlay (simulated)")
    cols = [
        ("N", "n", "{}"),
        ("K", "k", "{}"),
        ("churn", "churn", "{:.0%}"),
        ("Recall@K", "recall_at_k", "{:.3f}"),
        ("HNSW", "hnsw_recall_at_k", "{:.3f}"),
        ("cmp/query", "comparisons_per_query", "{:.0f}"),
        ("cmp/K", "comparisons_per_k", "{:.2f}"),
        ("msg/query", "messages_per_query", "{:.0f}"),
        ("depth", "depth", "{}"),
        ("build s", "build_seconds", "{:.2f}"),
        ("build rounds", "build_rounds", "{:.0f}"),
        ("ctl KB/node", "control_bytes_per_node", "{:.0f}"),
        ("unanswered", "unanswered_queries", "{}"),
    ]
    for title, _, _ in cols:
        table.add_column(title, justify="right")
    for run in report["runs"]:
        row = []
        for _, key, fmt in cols:
            value = run[key]
            if value is None:
                row.append("-")
                continue
            if key == "control_bytes_per_node":
                value = value / 1024
            row.append(fmt.format(value))
        table.add_row(*row)
    console.print(table)


def write_plots(report: Mapping[str, Any], directory: Path) -> list[Path]:
    """PNG plots of recall, comparisons and build time against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    ns = [r["n"] for r in runs]
    written = []
    specs = [
        ("recall.png", "Recall@K", [("overlay", "recall_at_k"), ("HNSW", "hnsw_recall_at_k")]),
        ("comparisons.png", "comparisons / N", [("overlay", "comparisons_share_of_n")]),
        ("build.png", "build time (s)", [("overlay", "build_seconds")]),
    ]
    for name, ylabel, series in specs:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for label, key in series:
            ys = [r[key] if r[key] is not None else float("nan") for r in runs]
            ax.plot(ns, ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("N")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    # `python bench/overlay.py ...` is the same as `peerlm bench overlay ...`.
    import sys

    from peerlm.bench.cli import app

    sys.exit(app(["overlay", *sys.argv[1:]], standalone_mode=True))
