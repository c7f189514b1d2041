"""Every knob of the semantic overlay in one frozen dataclass.

Defaults follow SemanticDFL (Sec. 5.1: ``K = 0.10 N``, ``S_Z = 0.05 N``, ``r = 3``,
``(B, F) = (8, 8)``; Sec. 3.5: relax step ``delta = 0.02``). Where the paper gives no value
the default is our choice; ``docs/overlay.md`` lists every field with its source.

Times are in seconds of whatever clock the caller feeds the node (the simulator's virtual
clock, or ``time.monotonic()`` in a real process); nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

__all__ = ["OverlayParams", "paper_k", "paper_zone_cap", "round_half_up"]


def round_half_up(x: float) -> int:
    """Round to the nearest integer, halves up (the paper's "rounded to the nearest integer")."""
    return int(x + 0.5)


def paper_zone_cap(n: int) -> int:
    """``S_Z = 0.05 N`` rounded, at least 2 (a zone of one cannot be clustered)."""
    return max(2, round_half_up(0.05 * n))


def paper_k(n: int, fraction: float = 0.10) -> int:
    """``K = fraction * N`` rounded, at least 1 and at most ``N - 1``."""
    return max(1, min(n - 1, round_half_up(fraction * n)))


@dataclass(frozen=True, slots=True)
class OverlayParams:
    """Protocol parameters shared by every node of one overlay (must agree network-wide)."""

    # --- zones (Sec. 3.3.1, Alg. 2-3) ---------------------------------------------------
    zone_cap: int = 50
    """``S_Z``: hard cap on zone membership; the paper's default is ``0.05 N``
    (use :meth:`for_network`)."""
    ttl_radius: int = 2
    """``R``: election radius and PROBE TTL, in overlay hops (our choice)."""
    hop_time: float = 0.1
    """``t_a``: per-hop time allowance; the diameter timeout is ``R * t_a`` (our choice)."""
    max_neighbours: int = 8
    """``d_max``: neighbour fan-out cap of the physical overlay graph (our choice)."""
    peer_exchange_interval: float = 3.0
    """Neighbours exchange peer lists this often; one silent for three intervals is
    dropped and replaced from the lists (our choice)."""
    orphan_passes: int = 3
    """Passes in which a peer no probe reached adopts a neighbour's zone before it seeds
    its own (our choice; the paper defers such peers to the next epoch)."""
    max_levels: int = 8
    """Safety cap on hierarchy depth (our choice; depth is ``O(log N)`` in practice)."""

    # --- clustering (Sec. 3.3.2-3.3.3) --------------------------------------------------
    replication: int = 3
    """``r``: super-peers per cluster (``|R_j| = min(r, |C_j|)``)."""
    root_replication: int = 5
    """Replicas of the root cluster (our choice, ``2r - 1``): every query enters there."""
    max_children: int = 8
    """``F``: fan-out cap, the most children a super-peer above level 1 keeps; larger
    affinity-propagation clusters are split (paper ``F = 8``)."""
    ap_damping: float = 0.5
    """Affinity-propagation damping (scikit-learn's default)."""
    ap_fallback_dampings: tuple[float, ...] = (0.75, 0.9)
    """Dampings retried when AP does not converge, before the k-medoids fallback."""
    ap_max_iter: int = 200
    ap_convergence_iter: int = 15
    ap_preference_quantile: float = 0.9
    """AP preference = this quantile of the off-diagonal similarities. 0.5 is the median,
    scikit-learn's default; we use 0.9 (more, purer clusters): at N = 400 the median left
    leaf clusters 73 % pure and capped Recall@K near 0.90, 0.9 gives 94 % (docs/overlay.md)."""
    ap_random_state: int = 0

    # --- search (Sec. 3.4-3.5) ----------------------------------------------------------
    beam: int = 8
    """``B``: most children one super-peer forwards a query to (paper ``B = 8``)."""
    dead_end_keep: int = 1
    """Children kept when none passes ``tau`` (paper: the best ``B``; we keep the best one
    and let relax-and-retry widen the search, which scores fewer prototypes)."""
    target_acceptance: float = 0.3
    """``phi``: target global acceptance rate of scored edges (our choice; ``tau(0)`` is
    the ``(1 - phi)`` quantile of the first round's scored similarities)."""
    tau_step: float = 0.05
    """``eta_tau``: controller step size (our choice)."""
    drift_slack: float = 0.05
    """``gamma``: drift-aware slack weight on ``1 - rho`` (our choice)."""
    relax_step: float = 0.02
    """``delta``: relax step when fewer than K candidates pass (paper ``0.02``)."""
    max_relax: int = 25
    """Visit budget: relax-and-retry descents per query (our choice)."""
    tau_window: int = 512
    """Recent probe similarities kept for the streaming ``(1 - phi)`` quantile (our choice)."""
    search_budget: float = 0.4
    """Share of ``Delta_t`` the root may spend on a query; each super-peer gives a child
    half of what it has left (the other half is for failing over to another replica), and
    answers with what it has when its own budget runs out (our choice)."""

    # --- synchronisation (Sec. 3.6) -----------------------------------------------------
    query_timeout: float = 5.0
    """``Delta_t``: soft-barrier timeout of one query (our choice)."""
    freshness: float = 0.5
    """``T_fresh``: a late candidate from an earlier round is used only if its similarity
    was at least this (our choice)."""
    max_staleness: int = 2
    """``Delta_max``: rounds after which late replies are discarded (our choice)."""

    # --- maintenance (Sec. 3.7) ---------------------------------------------------------
    heartbeat_interval: float = 0.5
    """Members and replicas renew every this many seconds (our choice)."""
    lease_duration: float = 1.6
    """A primary super-peer's lease; missing renewals for this long triggers takeover."""
    member_timeout: float = 2.1
    """A leaf primary drops a member whose heartbeats stopped this long ago (our choice:
    a lease plus a heartbeat, so a dropout stops being offered as a candidate quickly)."""
    orphan_after: float = 4.0
    """A member (or child cluster) whose leaf (parent) has not answered a heartbeat for this
    long re-joins (re-attaches); a primary drops members and children silent this long.
    Our choice: two and a half leases, so failover to a successor is tried first."""
    epoch_period: float = 3600.0
    """Seconds between overlay rebuilds (initiator rotation); our choice."""
    genesis_time: float = 0.0
    """Clock value at which epoch 0's build starts."""
    genesis_seed: bytes = hashlib.sha256(b"peerlm-overlay-genesis").digest()
    """Seed of epoch 0; later seeds are ``SHA-256(domain || seed_{e-1} || e)``."""
    join_retry: float = 1.0
    """A join or re-attach not acknowledged within this time is retried (our choice)."""

    # --- signature cardinality (Sec. 3.2) -------------------------------------------------
    p_quantile: float = 0.9
    """``q``: network ``P = min(Quantile_q(P_min), P_max)``; the paper suggests 0.8-0.9."""
    p_max: int = 1 << 20
    """``P_max``: cap on the network-wide signature cardinality."""

    # --- bounds (DESIGN principle 4) ------------------------------------------------------
    max_signature_p: int = 1 << 22
    """Signatures with more non-zeros are rejected."""
    max_items_per_message: int = 4096
    """Members, candidates or descriptors carried by one message."""
    max_k: int = 100_000
    """Largest K a query may ask for."""

    # --- per-sender Deliver rate limit (local, need not agree network-wide) ---------------
    deliver_rate: float = 200.0
    """Messages per second one sender may deliver to this node, sustained. The busiest
    honest sender is a primary super-peer: heartbeats or lease renewals to up to
    ``max_children`` children and ``root_replication`` replicas every
    ``heartbeat_interval`` (2 x 13 = 26/s), query forwards (``beam`` per query) and a peer
    list every ``peer_exchange_interval``; 200/s leaves about 5x headroom over that."""
    deliver_burst: float = 512.0
    """Messages one sender may deliver at once before the rate applies: two full batches
    (``CodecLimits.max_batch`` = 256), so a PROBE flood of an epoch build or a queue drained
    after a reconnect passes whole."""

    def __post_init__(self) -> None:
        checks = {
            "zone_cap >= 2": self.zone_cap >= 2,
            "ttl_radius >= 1": self.ttl_radius >= 1,
            "hop_time > 0": self.hop_time > 0,
            "max_neighbours >= 1": self.max_neighbours >= 1,
            "peer_exchange_interval > 0": self.peer_exchange_interval > 0,
            "replication >= 1": self.replication >= 1,
            "root_replication >= replication": self.root_replication >= self.replication,
            "max_children >= 2": self.max_children >= 2,
            "beam >= 1": self.beam >= 1,
            "dead_end_keep >= 1": self.dead_end_keep >= 1,
            "0 < target_acceptance < 1": 0 < self.target_acceptance < 1,
            "relax_step > 0": self.relax_step > 0,
            "max_relax >= 0": self.max_relax >= 0,
            "0.5 <= ap_damping < 1": 0.5 <= self.ap_damping < 1,
            "0.5 <= ap_fallback_dampings < 1": all(0.5 <= d < 1 for d in self.ap_fallback_dampings),
            "ap_max_iter >= 1": self.ap_max_iter >= 1,
            "ap_convergence_iter >= 1": self.ap_convergence_iter >= 1,
            "orphan_passes >= 0": self.orphan_passes >= 0,
            "tau_step > 0": self.tau_step > 0,
            "drift_slack >= 0": self.drift_slack >= 0,
            "tau_window >= 1": self.tau_window >= 1,
            "0 < search_budget <= 1": 0 < self.search_budget <= 1,
            "-1 <= freshness <= 1": -1 <= self.freshness <= 1,
            "max_staleness >= 0": self.max_staleness >= 0,
            "join_retry > 0": self.join_retry > 0,
            "16 <= len(genesis_seed) <= 64": 16 <= len(self.genesis_seed) <= 64,
            "p_max >= 1": self.p_max >= 1,
            "max_signature_p >= 1": self.max_signature_p >= 1,
            "max_items_per_message >= 1": self.max_items_per_message >= 1,
            "max_k >= 1": self.max_k >= 1,
            "0 <= ap_preference_quantile <= 1": 0 <= self.ap_preference_quantile <= 1,
            "lease_duration > heartbeat_interval": self.lease_duration > self.heartbeat_interval,
            "orphan_after > lease_duration": self.orphan_after > self.lease_duration,
            "member_timeout > heartbeat_interval": self.member_timeout > self.heartbeat_interval,
            "query_timeout > 0": self.query_timeout > 0,
            "epoch_period > build time": self.epoch_period > self.level_duration * 2,
            "max_levels >= 1": self.max_levels >= 1,
            "0 < p_quantile <= 1": 0 < self.p_quantile <= 1,
            "deliver_rate > 0": self.deliver_rate > 0,
            "deliver_burst >= 1": self.deliver_burst >= 1,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError("invalid overlay parameters: " + ", ".join(failed))

    # --- derived schedule -----------------------------------------------------------------
    @property
    def diameter_timeout(self) -> float:
        """``R * t_a``: how long a TTL-bounded flood is given to finish."""
        return self.ttl_radius * self.hop_time

    @property
    def level_phases(self) -> dict[str, float]:
        """Offsets (from the level's start) at which each build phase of one level begins.

        election (min-propagation of VRF tickets over ``R`` hops) -> probe wave -> orphan
        passes -> split -> signature collection -> clustering and descriptor publication.
        Every phase is one or two diameter/hop allowances, so a level takes ``O(R)`` hops and
        the build ``O(H * R)``.
        """
        t_a, d = self.hop_time, self.diameter_timeout
        election = 0.0
        probe = election + d + t_a
        orphan = probe + d + t_a
        split = orphan + self.orphan_passes * 2 * t_a
        sigprobe = split + 3 * t_a
        cluster = sigprobe + 2 * t_a
        end = cluster + 3 * t_a
        return {
            "election": election,
            "probe": probe,
            "orphan": orphan,
            "split": split,
            "sigprobe": sigprobe,
            "cluster": cluster,
            "end": end,
        }

    @property
    def level_duration(self) -> float:
        """Time one hierarchy level's formation takes on the schedule."""
        return self.level_phases["end"]

    def epoch_start(self, epoch: int) -> float:
        """Clock value at which ``epoch``'s build starts."""
        return self.genesis_time + epoch * self.epoch_period

    def level_start(self, epoch: int, level: int) -> float:
        """Clock value at which level ``level`` (1-based) of ``epoch`` starts forming."""
        return self.epoch_start(epoch) + (level - 1) * self.level_duration

    def epoch_of(self, now: float) -> int:
        """The epoch whose build window contains ``now`` (``-1`` before genesis)."""
        if now < self.genesis_time:
            return -1
        return int((now - self.genesis_time) // self.epoch_period)

    def epoch_seed(self, epoch: int) -> bytes:
        """The VRF input (``alpha``) of ``epoch``: a hash chain from the genesis seed.

        Deterministic so every node derives the same seed without an extra message; a VRF
        output is still unpredictable to everyone but the key holder.
        """
        seed = self.genesis_seed
        for e in range(1, epoch + 1):
            seed = hashlib.sha256(b"peerlm-overlay-epoch" + seed + e.to_bytes(8, "big")).digest()
        return seed

    @classmethod
    def for_network(cls, n: int, **overrides: object) -> OverlayParams:
        """The paper's defaults for an expected network of ``n`` peers (``S_Z = 0.05 N``)."""
        base: dict[str, object] = {"zone_cap": paper_zone_cap(n)}
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> OverlayParams:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
