"""The CPM's Prometheus metrics (catalogue in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["CpmMetrics"]


class CpmMetrics:
    """All CPM series, registered in one per-process registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.profiles = Counter(
            "peerlm_cpm_profiles_received_total", "Profiles accepted.", registry=registry
        )
        self.directives = Counter(
            "peerlm_cpm_directives_issued_total",
            "Pairing directives issued (one per selected pair).",
            ["protocol"],
            registry=registry,
        )
        self.rewards = Counter(
            "peerlm_cpm_rewards_observed_total",
            "Rewards committed to the bandit.",
            registry=registry,
        )
        self.exchange_refusals = Counter(
            "peerlm_cpm_exchange_refusals_total",
            "Directives their student refused (committed like a reward; the bandit learnt "
            "refusal_reward), by refusal reason and protocol.",
            ["reason", "protocol"],
            registry=registry,
        )
        self.rejected = Counter(
            "peerlm_cpm_rejected_requests_total",
            "Requests refused by validation or authorisation, by RPC and reason.",
            ["rpc", "reason"],
            registry=registry,
        )
        self.expired = Counter(
            "peerlm_cpm_directives_expired_total",
            "Directives closed without a reward before their deadline.",
            registry=registry,
        )
        self.matchmaking_rounds = Counter(
            "peerlm_cpm_matchmaking_rounds_total",
            "Matchmaking rounds run, by trigger.",
            ["trigger"],
            registry=registry,
        )
        self.matchmaking_seconds = Histogram(
            "peerlm_cpm_matchmaking_duration_seconds",
            "Time to select pairs for one matchmaking round (Algorithm 2).",
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
        )
        self.normalised_reward = Histogram(
            "peerlm_cpm_reward_normalised_zscore",
            "Rewards after normalisation (running or robust z-score), as fed to the bandit.",
            registry=registry,
            buckets=(-3, -2, -1, -0.5, 0, 0.5, 1, 2, 3),
        )
        self.theta_norm = Gauge(
            "peerlm_cpm_bandit_theta_norm_ratio",
            "Euclidean norm of the bandit's weight estimate theta = A^-1 b (dimensionless).",
            registry=registry,
        )
        self.bandit_updates = Gauge(
            "peerlm_cpm_bandit_updates_count",
            "Sherman-Morrison updates applied to the bandit (survives restarts).",
            registry=registry,
        )
        self.open_directives = Gauge(
            "peerlm_cpm_directives_open_count",
            "Directives issued and not yet rewarded or expired.",
            registry=registry,
        )
        self.connected = Gauge(
            "peerlm_cpm_directive_streams_count",
            "Agents with an open directive feed.",
            registry=registry,
        )
        self.without_feed = Counter(
            "peerlm_cpm_unpaired_without_feed_total",
            "Pending agents left out of a matchmaking round because their directive feed "
            "was closed.",
            registry=registry,
        )
        self.reward_batch = Histogram(
            "peerlm_cpm_reward_batch_size_count",
            "Rewards committed together in one transaction (group commit).",
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.snapshots = Counter(
            "peerlm_cpm_bandit_snapshots_total",
            "Bandit snapshots written (each after a full positive-definiteness check).",
            registry=registry,
        )
        self.rewards_replayed = Counter(
            "peerlm_cpm_rewards_replayed_total",
            "Ledger rewards replayed into the bandit at start (after the last snapshot).",
            registry=registry,
        )
        self.bandit_recovery = Counter(
            "peerlm_cpm_bandit_recoveries_total",
            "How the bandit came back at start: fresh, snapshot, or rebuilt from the ledger.",
            ["how"],
            registry=registry,
        )
        self.bandit_refactors = Counter(
            "peerlm_cpm_bandit_refactors_total",
            "Re-derivations of A^-1 from a Cholesky factor of A (periodic or after a check).",
            registry=registry,
        )
        self.space_disproofs = Counter(
            "peerlm_cpm_space_disproofs_total",
            "Parameter-space disproofs recorded: a student named a sender whose pulled "
            "adapter was not of the fingerprint it declared (one per sender, fingerprint "
            "and student).",
            registry=registry,
        )
        self.space_disproved = Gauge(
            "peerlm_cpm_space_disproved_members_count",
            "Agents whose declared fingerprint space_disproof_quorum students disproved "
            "(matched as undeclared until they declare another).",
            registry=registry,
        )
        self.agents = Gauge(
            "peerlm_cpm_agents_known_count",
            "Agents that have submitted a profile.",
            registry=registry,
        )
