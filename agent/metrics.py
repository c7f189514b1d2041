"""The agent daemon's own Prometheus metrics (catalogue in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["AgentTelemetry"]


class AgentTelemetry:
    """Round-loop series, registered in the agent's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rounds = Counter("peerlm_agent_rounds_total", "Rounds completed.", registry=registry)
        self.phase_seconds = Histogram(
            "peerlm_agent_round_duration_seconds",
            "Time per round phase.",
            ["phase"],
            registry=registry,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
        )
        self.val_loss = Gauge(
            "peerlm_agent_validation_loss_nats",
            "Mean token cross-entropy on the private validation set.",
            registry=registry,
        )
        self.pass_at_1 = Gauge(
            "peerlm_agent_pass_at_1_ratio", "pass@1 on the validation set.", registry=registry
        )
        self.rewards = Counter(
            "peerlm_agent_rewards_reported_total",
            "Rewards reported to the CPM as a student.",
            registry=registry,
        )
        self.packages_built = Counter(
            "peerlm_agent_teacher_packages_total",
            "Knowledge packages built as a teacher, by mode (text or logits).",
            ["mode"],
            registry=registry,
        )
        self.self_checked = Counter(
            "peerlm_agent_teacher_self_checked_total",
            "A teacher's answers run against their prompt's docstring example before its "
            "package is built (teach_self_check), by outcome: passed (sent), failed (not "
            "sent), unchecked (no example to run; sent)",
            ("outcome",),
            registry=registry,
        )
        self.taught_prompts = Histogram(
            "peerlm_agent_teacher_prompts_count",
            "Prompts of X_u a teacher answered per directive (teach_scope: all, or the "
            "categories where it showed skill).",
            registry=registry,
            buckets=(0, 1, 8, 32, 64, 128, 256, 512, 1024, 4096),
        )
        self.packages_integrated = Counter(
            "peerlm_agent_student_packages_total",
            "Knowledge packages integrated as a student, by mode (text or logits).",
            ["mode"],
            registry=registry,
        )
        self.merges = Counter(
            "peerlm_agent_directive_merges_total",
            "CPM merge directives integrated as a student (teacher's adapter pulled and "
            "merged, reward reported), by protocol (the catalogue's merge protocols).",
            ["protocol"],
            registry=registry,
        )
        self.unmatched_rounds = Counter(
            "peerlm_agent_unmatched_rounds_total",
            "Rounds the CPM said left this agent unpaired (it trained on without waiting).",
            registry=registry,
        )
        self.exchange_failures = Counter(
            "peerlm_agent_exchange_failures_total",
            "Exchanges that failed before integration.",
            ["reason"],
            registry=registry,
        )
        self.package_refusals = Counter(
            "peerlm_agent_package_refusals_total",
            "Knowledge packages refused at decode, by reason (invalid, item_too_large).",
            ["reason"],
            registry=registry,
        )
        self.rolled_back = Counter(
            "peerlm_agent_integrations_rolled_back_total",
            "Integrations undone by the acceptance gate (held-out loss worse by more than "
            "the margin), by kind (akd, overlay).",
            ["kind"],
            registry=registry,
        )
        # integration: separate (peerlm.agent.peer_integration).
        self.peer_slot_integrations = Counter(
            "peerlm_agent_peer_slot_integrations_total",
            "Integrations written to the peer slot instead of the own adapter (accepted or "
            "rolled back by their gate), by kind (akd, a merge protocol, or overlay).",
            ["kind"],
            registry=registry,
        )
        self.peer_slot_banks = Gauge(
            "peerlm_agent_peer_slot_banks",
            "Adapters the peer slot holds: 0 while empty, 1 with slot_banks 'one', one per "
            "lacked category taught (and a shared one for merges) with 'category'.",
            registry=registry,
        )
        self.peer_slot_routed = Gauge(
            "peerlm_agent_peer_slot_routed_ratio",
            "Share of an evaluation slice's problems the input router sends to the peer "
            "slot (0 while the slot is empty), by slice.",
            ["slice"],
            registry=registry,
        )
        self.peer_slot_own_answers = Counter(
            "peerlm_agent_peer_slot_own_answers_total",
            "Routed answers the own adapter gave in the peer slot's place (answer_check "
            "own_first: the own answer passed its prompt's example; peer_first: the slot's "
            "failed it and the own one passed), by slice.",
            ["slice"],
            registry=registry,
        )
        self.peer_slot_quarantined = Counter(
            "peerlm_agent_peer_slot_quarantined_total",
            "Checkpointed peer slots set aside on restore (damaged file, or tensors that do "
            "not fit the model), by reason; that bank (the slot, with one) then starts empty.",
            ["reason"],
            registry=registry,
        )
