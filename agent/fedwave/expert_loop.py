"""The expert agent's FedWave round loop: the thin driver over :mod:`expert_round`.

:class:`ExpertLoop` is what the agent daemon runs when ``fedwave.workflow`` is set. Each
round ``t`` (docs/fedwave.md, "The expert round loop"): train on the model thread
(:meth:`ExpertTrainer.train`), publish the trained router and VCLayer as round ``t`` in the
node's :class:`PartStore`, :func:`pull_round` (every other agent's router, the adjacent
stages' VCLayers) under ``fedwave.round_deadline_s``, :func:`conclude_round` (Eq. 9 over
what arrived, weighted by ``n_i``, after the norm bounds of :mod:`part_admission` refused
the finite-but-huge parts), and adopt the aggregate. Before round 1 it pulls the
neighbours' round-0 VCLayers (the collaborative loss of round 1 needs them).

Metrics (beside the exchange's own): ``peerlm_agent_fedwave_rounds_total{outcome}``
(``complete``: every agent's router averaged; ``partial``: some late, missing or refused),
``peerlm_agent_fedwave_round`` (the last round concluded),
``peerlm_agent_fedwave_parts_pulled_total{kind}`` (parts accepted and used),
``peerlm_agent_fedwave_train_loss`` (the last round's final step loss) and
``peerlm_agent_fedwave_heldout_loss`` (the expert's held-out SFT loss when measured).

With ``fedwave.assembly.enabled`` the last round's parts (``final_round``) include the
expert's LoRA adapter (only the last's: the others assemble from it, and the adapters of
earlier rounds would hand them the expert's training round by round), and after the last
round :meth:`ExpertLoop.assemble` pulls the other stages' experts
(adapter and VCLayer, under ``fedwave.assembly.deadline_s``), assembles π_SFT behind the
aggregated router, runs the DPO phase and scores the models
(:mod:`~peerlm.agent.fedwave.expert_assembly`). Its metrics:
``peerlm_agent_fedwave_assemblies_total{outcome}`` (``complete``: every stage's expert;
``partial``: some stage missing; ``failed``),
``peerlm_agent_fedwave_assembly_missing_stages_total``,
``peerlm_agent_fedwave_assembly_seconds`` (the experts' pulls and π_SFT's assembly) and
``peerlm_agent_fedwave_dpo_seconds`` (preference pairs and DPO steps); the experts pulled
and refused count in the exchange's ``..._parts_pulled_total{kind="adapter"|"vclayer"}``
and ``..._rejected_parts_total{kind, reason}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from peerlm.agent.fedproxy.admission import state_norm
from peerlm.agent.fedwave.agent_node import FedWaveNode
from peerlm.agent.fedwave.exchange import PartKind, RoundParts, plan_expert_pulls, plan_pulls
from peerlm.agent.fedwave.exchange_client import (
    pull_round,
    record_router_aggregate,
    workflow_positions,
)
from peerlm.agent.fedwave.expert_assembly import (
    AssemblyOutcome,
    assemble_and_align,
    score_expert,
)
from peerlm.agent.fedwave.expert_checkpoint import (
    KEY_FILE,
    ExpertCheckpointError,
    load_or_create_key,
    pack_expert_state,
    unpack_expert_state,
)
from peerlm.agent.fedwave.expert_round import (
    ExpertTrainer,
    RoundConclusion,
    adjacent_vclayers,
    conclude_round,
    router_digest,
)
from peerlm.agent.fedwave.part_admission import screen_round
from peerlm.agent.fedwave.resume import plan_resume
from peerlm.agent.fedwave.router_codec import encode_router, router_shapes
from peerlm.agent.fedwave.routing_check import ROUTING_REASON, own_expert_share, routing_refusal
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCLayer, encode_vclayer
from prometheus_client import Gauge

from peerlm.metrics import get_collector
from peerlm.node import NodeContext

if TYPE_CHECKING:
    from peerlm.agent.checkpoint import Checkpoint, CheckpointStore
    from peerlm.agent.fedwave.code_chain import StageExample

__all__ = ["ExpertLoop", "FedWaveReport"]

T = TypeVar("T")
#: Runs a blocking function on the agent's model thread.
RunOnModel = Callable[[Callable[[], T]], Awaitable[T]]


@dataclass
class FedWaveReport:
    """The loop's figures for the agent's summary (and ``peerlm up --workflow``'s table)."""

    stage: str
    rounds: int = 0
    router_sha256: list[str] = field(default_factory=list)  # per round, the aggregate's
    members: list[int] = field(default_factory=list)  # per round, agents averaged
    parts_pulled: dict[str, int] = field(default_factory=dict)  # kind -> accepted
    parts_missing: dict[str, int] = field(default_factory=dict)  # reason -> count
    parts_rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    train_loss: list[float] = field(default_factory=list)  # per round, the last step's
    heldout_before: float | None = None
    heldout_after: float | None = None
    # Restarts: the checkpointed round resumed from (the last one), and the rounds the
    # workflow played while this agent was down (it rejoined at the workflow's round).
    resumed_from: int | None = None
    rounds_skipped: int = 0
    # Restarted ahead of the others (restarted together, or after them): the round of the
    # checkpoint it had restored before it rolled back to theirs (``resumed_from``).
    rolled_back_from: int | None = None
    # Rounds whose router aggregate this agent refused (the routing check): it kept its
    # previous router.
    aggregates_rejected: int = 0
    # Part bytes by kind: streamed to the workflow's agents (served) and taken off the wire
    # from them (pulled, refused parts included); across restarts.
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    # With fedwave.assembly: the mean sentence scores (metric -> 0-100) of the expert alone
    # on the held-out examples before the first round and after the last ("expert_before",
    # "expert_after"), of π_SFT ("pi_sft") and of π_SFT after DPO ("pi_sft_dpo").
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    # The assembly's figures (expert_assembly.AssemblyOutcome without the scores), or its
    # error; empty when it did not run.
    assembly: dict[str, Any] = field(default_factory=dict)


def _rounded(scores: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in scores.items()}


class ExpertLoop:
    """Agent i's FedWave rounds over its :class:`FedWaveNode` and :class:`ExpertTrainer`."""

    def __init__(
        self,
        ctx: NodeContext,
        settings: FedWaveSettings,
        node: FedWaveNode,
        trainer: ExpertTrainer,
        *,
        n_samples: int,
        local_steps: int,
        run_on_model: RunOnModel[Any],
        checkpoints: CheckpointStore | None = None,
        adapter_state: Callable[[], dict[str, Any]] | None = None,
        load_adapter: Callable[[dict[str, Any]], None] | None = None,
        encoded_adapter: Callable[[], bytes] | None = None,
        final_round: int | None = None,
    ) -> None:
        """``final_round``: the last round the agent plays (the daemon's ``rounds``), the
        only one whose parts include the adapter; None (rounds without end, hence no
        assembly): the adapter is never published."""
        if settings.workflow is None:
            raise ValueError("fedwave.workflow is not configured")
        self.ctx = ctx
        self.settings = settings
        self.workflow = settings.workflow
        self.node = node
        self.trainer = trainer
        self.n_samples = n_samples
        self.local_steps = local_steps
        self._run = run_on_model
        # Where each concluded round is checkpointed (None: not), and how the expert's
        # adapter is read and restored (the model host's; on the model thread).
        self.checkpoints = checkpoints
        self._adapter_state = adapter_state
        self._load_adapter = load_adapter
        # The expert's adapter as the adapter codec encodes it (model thread): published with
        # the last round's parts when fedwave.assembly is on (the others pull it after that).
        self._encoded_adapter = encoded_adapter if settings.assembly.enabled else None
        self.final_round = final_round
        self._key: bytes | None = None  # the checkpoint key, read at the first save or load
        self.next_round = 1  # the round play() is to be called with next
        # The report's byte counts when this process started (restored from a checkpoint):
        # the process's counters start at 0.
        self._bytes_before: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self.endpoints: Mapping[str, str] = {
            a: e for a, e in settings.peers.items() if a != ctx.name
        }
        self.shapes = router_shapes(node.router)
        # The router bound's scale: the workflow's common initial router's norm (from the
        # seed), which no member can raise, unlike the aggregate's (part_admission.py).
        self._reference_norm = state_norm(
            settings.initial_router(node.bounds.hidden_size).state_dict()
        )
        self.predecessor: VCLayer | None = None
        self.successor: VCLayer | None = None
        self.report = FedWaveReport(stage=node.stage)
        self._rounds = ctx.counter(
            "peerlm_agent_fedwave_rounds_total",
            "FedWave expert rounds concluded: complete (every agent's router averaged) or "
            "partial (some late, missing or refused; the round went on without them)",
            ("outcome",),
        )
        self._pulled = ctx.counter(
            "peerlm_agent_fedwave_parts_pulled_total",
            "FedWave parts pulled from the workflow's agents, accepted and used",
            ("kind",),
        )
        self._round_gauge = self._gauge(
            "peerlm_agent_fedwave_round", "The last FedWave round this agent concluded"
        )
        self._train_loss = self._gauge(
            "peerlm_agent_fedwave_train_loss", "The last FedWave round's final local step loss"
        )
        self._assemblies = ctx.counter(
            "peerlm_agent_fedwave_assemblies_total",
            "Assemblies of pi_SFT after the last round: complete (every stage's expert), "
            "partial (some stage's expert missing at the deadline or refused) or failed",
            ("outcome",),
        )
        self._missing_stages = ctx.counter(
            "peerlm_agent_fedwave_assembly_missing_stages_total",
            "Stages left out of an assembly of pi_SFT (no expert of theirs arrived and fit)",
        )
        self._heldout = self._gauge(
            "peerlm_agent_fedwave_heldout_loss",
            "The expert's mean SFT loss on its stage's held-out examples (last measured)",
        )
        unlisted = sorted(set(self.workflow.agents) - set(self.endpoints) - {ctx.name})
        if unlisted:
            ctx.log.warning(
                "fedwave_peers_unlisted",
                agents=unlisted,
                detail="no endpoint in fedwave.peers: their parts will count missing (no_endpoint)",
            )

    def _gauge(self, name: str, doc: str) -> Gauge:
        gauge: Gauge = get_collector(Gauge, self.ctx.registry, name, doc)
        return gauge

    async def measure(self, examples: Any, *, after: bool) -> float | None:
        """The expert's held-out SFT loss on ``examples`` (before the first or after the
        last round); with ``fedwave.assembly`` also its greedy outputs' scores."""
        loss: float | None = await self._run(lambda: self.trainer.heldout_loss(examples))
        if loss is not None:
            self._heldout.set(loss)
        if after:
            self.report.heldout_after = loss
        else:
            self.report.heldout_before = loss
        if self.settings.assembly.enabled and examples:
            tokens = self.settings.assembly.max_new_tokens
            scores = await self._run(
                lambda: score_expert(self.trainer.model, self.trainer.tokenizer, examples, tokens)
            )
            self.report.scores["expert_after" if after else "expert_before"] = _rounded(scores)
        return loss

    async def start(self) -> None:
        """Round 0's pulls: the adjacent stages' initial VCLayers (round 1's collaborative
        loss needs them) and every other agent's round-0 router. The routers are the common
        initial one, so they are only counted, not averaged; pulling them makes every agent
        wait at start for the whole workflow (up to the deadline) the same way, so that the
        agents enter round 1 together and a missing agent is missed by all alike."""
        self.node.service.set_playing(1)
        base = self._router_state()
        parts = await self._pull(0, base)
        self._count_parts(parts)
        self.predecessor, self.successor = adjacent_vclayers(
            self.workflow, self.ctx.name, parts.vclayers
        )

    async def _pull(self, t: int, base: Mapping[str, Any]) -> RoundParts:
        """Round ``t``'s parts of the other agents under the deadline, screened against
        ``base`` (the round's starting router) by the norm bound."""
        parts = await pull_round(
            self.ctx,
            self.workflow,
            self.ctx.name,
            t,
            self.endpoints,
            self.node.bounds,
            deadline_s=self.settings.round_deadline_s,
        )
        self._screen(parts, base)
        return parts

    async def play(self, t: int) -> RoundConclusion:
        """Round ``t``: train, publish, pull, conclude, adopt the aggregate."""
        if t < 1:
            raise ValueError(f"rounds start at 1, got {t}")
        self.node.service.set_playing(t)
        started = time.monotonic()
        before, after = self.predecessor, self.successor
        base = self._router_state()  # ρ^(t−1): the norm bound's reference
        losses = await self._run(
            lambda: self.trainer.train(self.local_steps, predecessor=before, successor=after)
        )
        trained = self._router_state()
        parts = {
            PartKind.ROUTER: encode_router(self.node.router, n_samples=self.n_samples, round=t),
            PartKind.VCLAYER: encode_vclayer(self.trainer.vclayer, stage=self.node.stage),
        }
        if self._encoded_adapter is not None and t == self.final_round:
            parts[PartKind.ADAPTER] = await self._run(self._encoded_adapter)
        self.node.store.publish(t, parts)
        trained_s = time.monotonic() - started
        pulled = await self._pull(t, base)
        conclusion = conclude_round(
            self.workflow,
            self.ctx.name,
            trained,
            self.n_samples,
            pulled,
            self.shapes,
            predecessor=self.predecessor,
            successor=self.successor,
            max_weight_ratio=self.settings.max_router_weight_ratio,
            rule=self.settings.router_aggregation,
        )
        refusal = await self._run(lambda: self._routing_refusal(base, conclusion.router))
        if refusal is not None:
            # The aggregate routes this agent's own stage away from its expert: keep the
            # router held before the round (routing_check.py).
            conclusion = replace(conclusion, router=base, digest=router_digest(base))
            self.report.aggregates_rejected += 1
            self.ctx.counter(
                "peerlm_agent_fedwave_aggregates_rejected_total",
                "Round router aggregates an expert refused to adopt (routing: they route its "
                "own stage's examples away from its expert); it kept its previous router",
                ("reason",),
            ).labels(ROUTING_REASON).inc()
            self.ctx.log.warning(
                "fedwave_aggregate_rejected",
                round=t,
                reason=ROUTING_REASON,
                members=list(conclusion.members),
                detail=refusal,
            )
        for agent in conclusion.capped:
            # A claimed n_i over the cap: averaged, at the capped weight (exchange.py).
            self.ctx.counter(
                "peerlm_agent_fedwave_router_weights_capped_total",
                "Routers averaged by Eq. 9 whose claimed sample count n_i was over "
                "fedwave.max_router_weight_ratio x the members' median claim (capped)",
            ).inc()
            self.ctx.log.warning(
                "fedwave_router_weight_capped",
                round=t,
                agent=agent,
                claimed=pulled.routers[agent].n_samples,
            )
        await self._run(lambda: self.trainer.load_router(conclusion.router))
        self.predecessor, self.successor = conclusion.predecessor, conclusion.successor
        self.next_round = t + 1
        self.node.service.set_concluded(t)
        outcome = record_router_aggregate(self.ctx, self.workflow, conclusion.members, t)
        self._rounds.labels(outcome).inc()
        self._round_gauge.set(t)
        if losses:
            self._train_loss.set(losses[-1])
        self._count_parts(pulled)
        r = self.report
        r.rounds = t
        r.router_sha256.append(conclusion.digest)
        r.members.append(len(conclusion.members))
        last = round(losses[-1], 5) if losses else None
        if last is not None:
            r.train_loss.append(last)
        self.ctx.log.info(
            "fedwave_round_done",
            round=t,
            stage=self.node.stage,
            outcome=outcome,
            members=list(conclusion.members),
            router_sha256=conclusion.digest,
            train_loss=last,
            train_s=round(trained_s, 2),
            round_s=round(time.monotonic() - started, 2),
        )
        if self.checkpoints is not None:
            await self._run(lambda: self._save(t))
        return conclusion

    # ------------------------------------------------------------------ checkpoints

    def count_bytes(self) -> FedWaveReport:
        """Update the report's part bytes sent and received, by kind, from this process's
        counters (``peerlm_agent_fedwave_bytes_sent_total`` /
        ``..._bytes_received_total``) plus what the restored report held; the report."""
        sent, received = self._bytes_before
        for kind in PartKind:
            for into, before, name in (
                (self.report.bytes_sent, sent, "peerlm_agent_fedwave_bytes_sent_total"),
                (self.report.bytes_received, received, "peerlm_agent_fedwave_bytes_received_total"),
            ):
                now = self.ctx.registry.get_sample_value(name, {"kind": kind.value}) or 0.0
                total = before.get(kind.value, 0) + int(now)
                if total:
                    into[kind.value] = total
        return self.report

    def _save(self, t: int) -> None:
        """Round ``t``'s end, atomically (model thread): adapter, adopted router, VCLayer,
        the neighbours' VCLayers, the report and the batch sampler's RNG."""
        assert self.checkpoints is not None
        adapter = self._adapter_state() if self._adapter_state is not None else {}
        self.count_bytes()
        tensors, state = pack_expert_state(
            t,
            key=self._checkpoint_key(),
            adapter=adapter,
            router=self.node.router.state_dict(),
            vclayer=self.trainer.vclayer,
            predecessor=self.predecessor,
            successor=self.successor,
            report=asdict(self.report),
            rng=self.trainer.rng,
        )
        self.checkpoints.save(t, tensors, state)

    def _checkpoint_key(self) -> bytes:
        """This agent's checkpoint key (model thread): ``checkpoint.key`` beside the
        checkpoints directory, created 0600 at the first use (expert_checkpoint.py)."""
        assert self.checkpoints is not None
        if self._key is None:
            directory = self.checkpoints.directory
            directory.parent.mkdir(parents=True, exist_ok=True)
            self._key = load_or_create_key(directory.parent / KEY_FILE)
        return self._key

    async def restore(self) -> int:
        """Load the newest checkpoint, if any: the expert's adapter, router, VCLayer, the
        neighbours' VCLayers, the report and RNG as they were at the end of its round;
        that round (0: none, a fresh start). ``ValueError`` if it does not fit this agent
        (nothing loaded then). From here on ``DescribeWorkflow`` says the round."""
        checkpoint = None
        if self.checkpoints is not None:
            checkpoint = await self._run(self.checkpoints.load_latest)
        if checkpoint is None:
            self.node.service.set_concluded(0)
            return 0
        return await self._load(checkpoint)

    async def _load(self, checkpoint: Checkpoint) -> int:
        bounds = self.node.bounds
        key = await self._run(self._checkpoint_key)
        try:
            saved = unpack_expert_state(
                checkpoint.tensors,
                checkpoint.state,
                router_shapes=self.shapes,
                hidden_size=bounds.hidden_size,
                vclayer=bounds.vclayer,
                key=key,
            )
        except ExpertCheckpointError as err:
            self.ctx.counter(
                "peerlm_agent_fedwave_checkpoint_refusals_total",
                "FedWave expert checkpoints refused on restore: mac (no or another HMAC of "
                "this agent's key), non_finite, shape, state; nothing of them loaded",
                ("reason",),
            ).labels(err.reason).inc()
            self.ctx.log.error(
                "fedwave_checkpoint_refused",
                round=checkpoint.round,
                reason=err.reason,
                error=str(err),
            )
            raise ExpertCheckpointError(
                f"FedWave checkpoint of round {checkpoint.round} refused: {err}",
                reason=err.reason,
            ) from None

        def load() -> None:
            if self._load_adapter is not None:
                self._load_adapter(saved.adapter)  # checked before anything changes
            self.trainer.load_router(saved.router)
            self.trainer.vclayer.load_state_dict(saved.vclayer)
            self.trainer.rng.setstate(saved.rng)

        await self._run(load)
        self.predecessor, self.successor = saved.predecessor, saved.successor
        self.report = FedWaveReport(**saved.report)
        self.report.resumed_from = saved.round
        self._bytes_before = (dict(self.report.bytes_sent), dict(self.report.bytes_received))
        self.next_round = saved.round + 1
        self._round_gauge.set(saved.round)
        self.node.service.set_concluded(saved.round)
        self.ctx.log.info("fedwave_checkpoint_restored", round=saved.round, stage=self.node.stage)
        return saved.round

    async def rejoin(self, t: int) -> int:
        """After :meth:`restore` of round ``t``: the round to play next (docs/fedwave.md,
        section 5; :mod:`~peerlm.agent.fedwave.resume`). It asks every workflow agent where
        it is (``DescribeWorkflow``), waiting up to ``fedwave.round_deadline_s`` for agents
        still loading their checkpoints: if the others are running it joins their round
        (skipping the ones it missed); if they restarted too, all agree on the smallest
        round concluded among them. An agent ahead rolls back to its checkpoint of that
        round first (the newer checkpoints are discarded)."""
        positions = await workflow_positions(
            self.ctx, self.endpoints, wait_s=self.settings.round_deadline_s
        )
        kept = await self._run(self.checkpoints.rounds) if self.checkpoints is not None else []
        plan = plan_resume(t, positions, kept, last_round=self.final_round)
        ignored = self.ctx.counter(
            "peerlm_agent_fedwave_positions_ignored_total",
            "Workflow agents' positions a restarted expert left out of its resume plan: "
            "implausible (past the last round) or outlier (concluded more than "
            "MAX_ROLLBACK_ROUNDS below the median of the agents restarted together)",
            ("reason",),
        )
        for agent in plan.implausible:
            ignored.labels("implausible").inc()
            self.ctx.log.warning(
                "fedwave_position_implausible",
                agent=agent,
                claimed=[positions[agent].published, positions[agent].concluded],
                last_round=self.final_round,
            )
        for agent in plan.outliers:
            ignored.labels("outlier").inc()
            self.ctx.log.warning(
                "fedwave_position_outlier",
                agent=agent,
                claimed=[positions[agent].published, positions[agent].concluded],
                own=t,
            )
        rollback_unavailable = plan.rollback_unavailable
        next_round = plan.next_round
        if plan.rollback_to is not None:
            assert self.checkpoints is not None  # kept is empty otherwise
            store, target = self.checkpoints, plan.rollback_to
            moved = self._bytes_before  # bytes that did move, whatever is rolled back
            try:
                checkpoint = await self._run(lambda: store.load(target))
                # Refused (ValueError) before anything changes if it does not fit.
                await self._load(checkpoint)
            except ValueError as err:  # CheckpointError included
                self.ctx.log.warning("fedwave_rollback_failed", round=target, error=str(err))
                rollback_unavailable, next_round = True, t + 1
            else:
                # Only now the newer checkpoints go: a restart meanwhile restores the newest.
                await self._run(lambda: store.roll_back(target))
                self._bytes_before = moved
                self.report.bytes_sent, self.report.bytes_received = dict(moved[0]), dict(moved[1])
                self.report.rolled_back_from = t
        self.next_round = next_round
        self.node.service.set_playing(next_round)
        self.report.rounds_skipped += plan.skipped
        self.ctx.log.info(
            "fedwave_rejoined",
            checkpoint_round=t,
            next_round=self.next_round,
            skipped=plan.skipped,
            mode=plan.mode,
            rolled_back_to=None if rollback_unavailable else plan.rollback_to,
            rollback_unavailable=rollback_unavailable,
            peers={a: [p.published, p.concluded] for a, p in sorted(positions.items())},
        )
        return self.next_round

    # ------------------------------------------------------------------ assembly

    async def assemble(
        self, t: int, held_out: Sequence[StageExample], public: Sequence[str]
    ) -> AssemblyOutcome | None:
        """After the last round ``t``: pull the other stages' round-``t`` experts (adapter
        and VCLayer) under ``fedwave.assembly.deadline_s``, then on the model thread
        assemble π_SFT behind the aggregated router, run the DPO phase on ``public`` and
        score on ``held_out`` (:func:`assemble_and_align`). A stage whose expert did not
        arrive (late, refused, unfit) is left out: counted, logged and in the report. A
        failure is logged and reported (``assembly.error``); the agent goes on."""
        settings = self.settings.assembly
        started = time.monotonic()
        parts = await pull_round(
            self.ctx,
            self.workflow,
            self.ctx.name,
            t,
            self.endpoints,
            self.node.bounds,
            deadline_s=settings.deadline_s or self.settings.round_deadline_s,
            targets=plan_expert_pulls(self.workflow, self.ctx.name),
        )
        own_norm = None
        if self._adapter_state is not None:
            read = self._adapter_state
            own_norm = await self._run(lambda: state_norm(read()))
        # The VCLayers' and adapters' norm bounds (part_admission).
        self._screen(parts, self._router_state(), own_adapter_norm=own_norm)
        self._count_parts(parts)
        pulled_s = time.monotonic() - started
        try:
            outcome: AssemblyOutcome = await self._run(
                lambda: assemble_and_align(
                    self.workflow,
                    self.ctx.name,
                    self.trainer.model,
                    self.node.router,
                    parts,
                    self.trainer.tokenizer,
                    held_out,
                    public,
                    settings=settings,
                    dpo=self.settings.dpo,
                    top_k=self.settings.router.top_k,
                    seed=self.settings.seed,
                )
            )
        except Exception as err:  # reported; the agent goes on serving and stops cleanly
            self._assemblies.labels("failed").inc()
            self.report.assembly = {"error": repr(err)}
            self.ctx.log.error("fedwave_assembly_failed", round=t, error=repr(err))
            return None
        outcome.assemble_s = round(outcome.assemble_s + pulled_s, 3)
        outcome_label = "partial" if outcome.missing_stages else "complete"
        self._assemblies.labels(outcome_label).inc()
        if outcome.missing_stages:
            self._missing_stages.inc(len(outcome.missing_stages))
            self.ctx.log.warning(
                "fedwave_assembly_partial",
                round=t,
                missing_stages=outcome.missing_stages,
                missing={f"{x.agent}/{x.kind}": r for x, r in sorted(parts.missing.items())},
                rejected={f"{x.agent}/{x.kind}": r for x, r in sorted(parts.rejected.items())},
            )
        self._gauge(
            "peerlm_agent_fedwave_assembly_seconds",
            "Seconds the last assembly of pi_SFT took: the experts' pulls and building the model",
        ).set(outcome.assemble_s)
        self._gauge(
            "peerlm_agent_fedwave_dpo_seconds",
            "Seconds the last DPO phase took: the preference pairs and the DPO steps",
        ).set(outcome.dpo_s)
        self.report.scores["pi_sft"] = _rounded(outcome.pi_sft)
        if outcome.pi_sft_dpo is not None:
            self.report.scores["pi_sft_dpo"] = _rounded(outcome.pi_sft_dpo)
        figures = asdict(outcome)
        for key in ("pi_sft", "pi_sft_dpo"):
            figures.pop(key)
        figures["outcome"] = outcome_label
        self.report.assembly = figures
        self.ctx.log.info(
            "fedwave_assembled",
            round=t,
            outcome=outcome_label,
            experts=outcome.experts,
            missing_stages=outcome.missing_stages,
            dpo_pairs=outcome.dpo_pairs,
            dpo_informative=outcome.dpo_informative,
            assemble_s=outcome.assemble_s,
            dpo_s=outcome.dpo_s,
        )
        return outcome

    def _routing_refusal(
        self, before: Mapping[str, Any], aggregate: Mapping[str, Any]
    ) -> str | None:
        """The routing check of a round's aggregate on this agent's own stage examples
        (model thread; :mod:`routing_check`): why it is refused, or None."""
        margin = self.settings.routing_check_margin
        router = self.trainer.router
        if margin is None or router is None:
            return None
        features = self.trainer.own_features(self.settings.routing_check_examples)
        expert = self.trainer.stage_index
        was = own_expert_share(router, before, features, expert)
        now = own_expert_share(router, aggregate, features, expert)
        return routing_refusal(was, now, n_experts=router.n_experts, margin=margin)

    def _router_state(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.node.router.state_dict().items()}

    def _screen(
        self, parts: Any, base: Mapping[str, Any], *, own_adapter_norm: float | None = None
    ) -> None:
        """The norm bounds (:mod:`part_admission`): parts over them move to the rejected
        ones (reason ``norm``), counted like the transport's refusals and logged."""
        refused = screen_round(
            parts,
            base_router=base,
            own_vclayer=self.trainer.vclayer,
            max_router_update_ratio=self.settings.max_router_update_ratio,
            max_router_update_rms=self.settings.max_router_update_rms,
            max_router_update_abs=self.settings.max_router_update_abs,
            max_vclayer_norm_ratio=self.settings.max_vclayer_norm_ratio,
            own_adapter_norm=own_adapter_norm,
            max_adapter_norm_ratio=self.settings.assembly.max_adapter_norm_ratio,
            router_reference_norm=self._reference_norm,
        )
        for target, why in sorted(refused.items()):
            self.ctx.counter(
                "peerlm_agent_fedwave_rejected_parts_total",
                "FedWave parts refused on arrival (sender not in the workflow or not proved, "
                "shape, non-finite, oversized, wrong round or stage, over the norm bound); "
                "never used",
                ("kind", "reason"),
            ).labels(target.kind.value, "norm").inc()
            self.ctx.log.warning(
                "fedwave_part_refused",
                round=parts.round,
                peer=target.agent,
                kind=target.kind.value,
                reason="norm",
                detail=why,
            )

    def _count_parts(self, parts: RoundParts) -> None:
        r = self.report
        for kind, got in (
            (PartKind.VCLAYER, parts.vclayers),
            (PartKind.ROUTER, parts.routers),
            (PartKind.ADAPTER, parts.adapters),
        ):
            if got:
                self._pulled.labels(kind.value).inc(len(got))
                r.parts_pulled[kind.value] = r.parts_pulled.get(kind.value, 0) + len(got)
        for reason in parts.missing.values():
            r.parts_missing[reason] = r.parts_missing.get(reason, 0) + 1
        for reason in parts.rejected.values():
            r.parts_rejected[reason] = r.parts_rejected.get(reason, 0) + 1

    async def linger(self, t: int, stop: asyncio.Event) -> bool:
        """After the last round ``t``, keep serving until every other agent has its
        round-``t`` router from us and the adjacent stages their VCLayer, at most
        ``round_deadline_s`` (or until ``stop``); whether they all did."""
        me = self.ctx.name
        others = set(self.workflow.agents) - {me}
        neighbours = {
            a
            for a in self.workflow.agents
            if a != me
            and any(
                p.agent == me for p in plan_pulls(self.workflow, a) if p.kind is PartKind.VCLAYER
            )
        }
        # With the assembly, every agent of another stage pulls our adapter and VCLayer.
        assemblers = (
            {a for a in others if any(p.agent == me for p in plan_expert_pulls(self.workflow, a))}
            if self._encoded_adapter is not None and t == self.final_round
            else set()
        )
        neighbours |= assemblers
        service = self.node.service
        deadline = time.monotonic() + self.settings.round_deadline_s
        while not stop.is_set() and time.monotonic() < deadline:
            if (
                others <= service.served(t, PartKind.ROUTER)
                and neighbours <= service.served(t, PartKind.VCLAYER)
                and assemblers <= service.served(t, PartKind.ADAPTER)
            ):
                return True
            await asyncio.sleep(0.1)
        return False
