"""The agent daemon: one hosted model, the KNEXA-FL round loop, a peer-exchange server.

Algorithm 3 from the agent's side, every round t:

1. local epochs on private data (off the event loop, in the model worker thread);
2. evaluate (validation loss, perplexity, pass@1 in the sandbox) and build the profile p_i;
3. submit the profile to the CPM and wait (bounded) for this round's directives: one, or
   under the CPM's ``pairing: per_student`` one per teacher (``teachers_per_student``)
   and one per student taught, acted on as teacher first, then each student directive in
   turn (docs/matchmaker.md, "A student every round", "Several teachers a student");
4. as a student: fetch the teacher's knowledge package over mTLS, integrate it by AKD
   (Eq. 2), measure L_pre and L_post on the validation set and report the reward of Eq. 3;
   as a teacher: serve the package to the named student from the peer server (it is
   generated lazily on the first verified request and cached for the directive);
   without a directive the round is local training only;
5. checkpoint the adapter and round state atomically.

The event loop never runs model code: training, generation and evaluation go to a single
worker thread that owns the :class:`ModelHost`, so gRPC (health, peer exchange, the
directive feed) stays responsive while a training step runs. What is done with the model in
each phase lives in :mod:`peerlm.agent.exchange.rounds`, shared with the in-process experiment.

Merge directives (protocols ``pmix`` and ``svd_hka`` of the CPM's menu): the student pulls
the teacher's adapter and merges it with its own (:mod:`peerlm.agent.merging.directive`),
then reports Eq. 3 as for AKD; the teacher only serves its adapter (``PullAdapter``). A
directive naming a protocol this agent does not execute is refused (counted as a failed
exchange, reason ``unsupported_protocol``). The profile declares the agent's
parameter-space fingerprint and executed protocols so the CPM recommends only what fits.

Package modes: as a teacher the agent sends text (protocol ``akd``) or, for a directive of
protocol ``akd_logits`` (or with ``akd_mode: logits``), the top-k logits of its completions
when the student announced the same tokenizer, text otherwise (the student announces its
tokenizer hash with the fetch; see :mod:`peerlm.agent.exchange.rounds`).

Stopping (SIGTERM, SIGINT): :meth:`AgentDaemon.stop` lets the round in progress finish for
up to ``stop_grace_s``; after that, training ends at the next optimiser step, the wait for a
directive ends, pass@k evaluation and new exchanges are skipped. Either way the round is
checkpointed and :meth:`run` returns, so the process exits 0. A second signal ends the grace
at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from peerlm.agent.acceptance import AcceptanceGate
from peerlm.agent.checkpoint import CheckpointStore
from peerlm.agent.cpm.client import CpmClient, next_directive, rest_of_round
from peerlm.agent.cpm.directives import MAX_CO_SENDERS, DirectiveBook, directive_action
from peerlm.agent.cpm.profile import host_parameter_space
from peerlm.agent.eval.evaluation import structural_match_rate
from peerlm.agent.eval.sandbox import LimitOptions, SandboxTelemetry, require_confinement
from peerlm.agent.exchange.answer_check import check_answers
from peerlm.agent.exchange.peer_knowledge import InputRouter, PeerSlot, route_map, routed_share
from peerlm.agent.exchange.protocol import exchange_failed, report_refusal
from peerlm.agent.exchange.registry import agent_registry
from peerlm.agent.exchange.reward_probe import AnsweredProbe
from peerlm.agent.exchange.rounds import (
    PackageMode,
    ProfileInputs,
    RoundConfig,
    build_package,
    category_counts,
    choose_package_mode,
    linear_schedule,
    local_update,
    reference_nll,
    round_profile,
    sample_completions,
    score_completions,
    teacher_completions,
)
from peerlm.agent.exchange.self_check import example_verdicts, self_check
from peerlm.agent.exchange.teaching import Competence, competence_of, teachable_indices
from peerlm.agent.metrics import AgentTelemetry
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.peer.service import PeerExchangeService, serve_peer
from peerlm.agent.peer.stream import PeerStreamer
from peerlm.agent.peer.transport import GrpcPeers
from peerlm.agent.peer_integration import (
    fit_agent_router,
    restore_slot,
    slot_extra,
    slot_learns,
    slot_record,
    slot_runner,
)
from peerlm.agent.settings import AgentSettings
from peerlm.agent.tasks.dataset import read_jsonl, transfer_set_sha256
from peerlm.agent.vetting.guardrail import agent_guardrail

from peerlm.chunks import HashedPayload
from peerlm.config import parse_host_port
from peerlm.metrics import serve_metrics
from peerlm.node import NodeContext
from peerlm.pki.identity import Role
from peerlm.protocols import lookup, names
from peerlm.security.mode import resolve_channel_security
from peerlm.wire.v1 import cpm_pb2

# The overlay, FedWave and FedProxy are imported where an agent that enables them starts
# them: an agent without them would load the overlay's clustering (networkx, scikit-learn's
# cluster, 0.5 s CPU) and FedWave's text metrics (NLTK) for nothing, on every start.
if TYPE_CHECKING:
    from peerlm.agent.fedproxy.member import Evaluator

__all__ = ["AgentDaemon", "AgentSummary", "linear_schedule"]

T = TypeVar("T")


@dataclass
class AgentSummary:
    """What the agent did; printed as one JSON line on stdout when it ends."""

    name: str
    model: str
    family: str
    trainable_share: float = 0.0
    rounds_completed: int = 0
    pass_at_1_before: float = 0.0
    pass_at_1_after: float = 0.0
    loss_before: float = 0.0
    loss_after: float = 0.0
    exchanges: int = 0
    as_teacher: int = 0
    rewards: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    packages_by_mode: dict[str, int] = field(default_factory=dict)
    # CPM merge directives integrated as a student, by protocol (pmix, svd_hka).
    merges_by_protocol: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    # SemanticDFL (overlay.enabled): distinct neighbours found by searches, adapters
    # integrated, pull refusals by reason, step outcomes by name.
    overlay_neighbours: list[str] = field(default_factory=list)
    adapters_pulled: int = 0
    overlay_refusals: dict[str, int] = field(default_factory=dict)
    overlay_steps: dict[str, int] = field(default_factory=dict)
    # overlay.aggregate_once: the round whose overlay step aggregated (None: not yet).
    one_shot_round: int | None = None
    # Adapter bytes pulled and served: overlay pulls and CPM merge directives alike.
    overlay_bytes_received: int = 0
    overlay_bytes_sent: int = 0
    # FedProxy (fedproxy.enabled): cohort rounds this agent completed as owner or member,
    # and the cohort report (CohortReport as a dict: bytes, held-out losses, digests, merges).
    fedproxy_rounds: int = 0
    fedproxy: dict[str, Any] = field(default_factory=dict)
    # Per evaluation slice (eval_slice_files): {"pass1", "struct", "nll", "n"}.
    slices_before: dict[str, dict[str, float]] = field(default_factory=dict)
    slices_after: dict[str, dict[str, float]] = field(default_factory=dict)
    # FedWave (fedwave.workflow set): the expert loop's report (FedWaveReport as a dict).
    fedwave: dict[str, Any] = field(default_factory=dict)
    # integration: separate: integrations the peer slot holds (each slice's routed share
    # is its "peer_share" in slices_before / slices_after).
    peer_slot_integrations: int = 0


class AgentDaemon:
    """Create with :meth:`create` (async factory), then :meth:`run` until done or stopped."""

    def __init__(self, settings: AgentSettings, log: Any) -> None:
        self.s = settings
        self.log = log
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._stop = asyncio.Event()
        # Set when the stop grace has run out: cut whatever the round is doing.
        self._abort = asyncio.Event()
        self._grace: asyncio.TimerHandle | None = None
        # The latest round's teacher directives: their predictions, being generated, and
        # their ids (the linger after the last round waits for each one's first fetch).
        self._prebuild: list[asyncio.Task[tuple[list[int], list[str]]]] = []
        self._last_taught: list[str] = []
        # The students of the latest round's merge directives as a teacher, and the adapter
        # pulls each made from us before (the linger waits for one more each).
        self._last_merge: list[tuple[str, int]] = []
        # The matchmaking round our latest profile is considered in (SubmitProfile's answer).
        self._awaited_round = 0
        self.overlay: Any = None  # AgentOverlay when overlay.enabled
        self.cohort: Any = None  # ProxyOwner or ProxyMember when fedproxy.enabled
        # The cohort report's held-out loss and how many texts it measures on.
        self._cohort_loss: Evaluator | None = None
        self._cohort_texts = 0
        self.fedwave: Any = None  # FedWaveNode when fedwave.workflow is set
        self._expert_loop: Any = None  # its ExpertLoop once the rounds started
        # integration: separate: peers' knowledge beside the own adapter, and the router
        # that picks per input (peerlm.agent.peer_integration); None: one adapter.
        self.slot: PeerSlot | None = None
        self.router: InputRouter | None = None
        # The exchange protocols this agent executes, by catalogue name: a directive's
        # student and teacher steps (peerlm.agent.exchange.protocol).
        self.exchanges = agent_registry()

    # ------------------------------------------------------------------ set-up

    @classmethod
    async def create(cls, settings: AgentSettings, log: Any) -> AgentDaemon:
        """Load everything, verify the transfer set, restore the checkpoint, start servers."""
        self = cls(settings, log)
        await self._setup()
        return self

    async def _model(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, lambda: fn(*args, **kwargs))

    async def _setup(self) -> None:
        self._connect()
        self._load_data()
        await self._load_model()
        await self._fit_router()
        await self._restore()
        await self._serve()
        self.cpm = CpmClient(self.ctx, self.s.cpm)
        self.log.info(
            "agent_ready",
            endpoint=self.endpoint,
            model=str(self.s.model),
            family=self.host.family,
            trainable_share=round(self.host.trainable_share, 5),
            train=len(self.train),
            val=len(self.val),
            transfer=len(self.transfer_prompts),
            transfer_sha256=self.transfer_digest,
            round=self.state["round"],
        )

    def _connect(self) -> None:
        """The node context: security mode, identity, proofs, metrics registry."""
        s = self.s
        self.ctx = NodeContext.from_settings(s, role=Role.AGENT, log=self.log)
        # The CPM target under the same decision (insecure-dev: loopback only), said at start.
        resolve_channel_security(
            insecure_dev=s.insecure_dev,
            target=s.cpm,
            tls=self.ctx.tls,
            component="agent",
            logger=self.log,
        )
        self.identity = self.ctx.identity
        self.registry = self.ctx.registry
        # The exchange protocols' way to their peers: the peer service over mTLS.
        self.peers = GrpcPeers(self.ctx)

    def _load_data(self) -> None:
        """The private sets and the pinned public transfer set X_u (its SHA-256 checked)."""

        s = self.s
        self.train = read_jsonl(s.train_file)
        self.val = read_jsonl(s.val_file)
        transfer = read_jsonl(s.transfer_file)
        self.transfer_prompts = [p.prompt for p in transfer]
        self.transfer_categories = [p.category for p in transfer]
        digest = transfer_set_sha256(self.transfer_prompts)
        if s.transfer_sha256 and digest != s.transfer_sha256:
            raise ValueError(
                f"transfer set {s.transfer_file} has SHA-256 {digest}, but the federation "
                f"pins {s.transfer_sha256}; refusing to exchange on a different X_u"
            )
        self.transfer_digest = digest
        if s.transfer_limit is not None:
            self.transfer_prompts = self.transfer_prompts[: s.transfer_limit]
            self.transfer_categories = self.transfer_categories[: s.transfer_limit]
        # Guardrail index: the private samples as whole texts.
        self.train_texts = [p.prompt + p.reference for p in self.train]
        # Training and validation as (prompt, completion) pairs: the loss covers the solution,
        # tokenised apart from the prompt exactly as generation sees it at evaluation time.
        self.train_examples = [(p.prompt, p.reference) for p in self.train]
        self.val_examples = [(p.prompt, p.reference) for p in self.val]
        # Where Eq. 3's losses are measured when not on val (``reward_file``): public pairs.
        probe = read_jsonl(s.reward_file) if s.reward_file else []
        self.reward_examples = [(p.prompt, p.reference) for p in probe] or None
        if s.reward_file and not self.reward_examples:
            raise ValueError(f"reward_file {s.reward_file} holds no problem to measure on")
        # reward_scope "answered": a package's reward on the probe's problems of its categories
        # ("routed": narrowed to what the slot answers once the router is fitted).
        self.reward_scope = (
            AnsweredProbe.of(
                ((p.prompt, p.reference, p.category) for p in probe),
                self.transfer_prompts,
                self.transfer_categories,
            )
            if s.reward_scope in ("answered", "routed")
            else None
        )
        # D_pub of OnePeFT's HKA (an overlay aggregation that needs public pairs).
        self.public_pairs = (
            [(p.prompt, p.reference) for p in read_jsonl(s.public_file)] if s.public_file else []
        )
        if lookup(s.overlay.aggregation).needs_public_pairs and not self.public_pairs:
            raise ValueError(
                f"public_file {s.public_file} holds no pair for {s.overlay.aggregation}'s HKA"
            )
        # Held-out test problems per slice, for the report only (never trained on).
        self.slice_problems = {
            name: read_jsonl(path)[: s.eval_limit] if s.eval_limit else read_jsonl(path)
            for name, path in s.eval_slice_files.items()
        }

    async def _load_model(self) -> None:
        """The model host (on the model thread), round configuration, telemetry, guardrail."""

        s = self.s
        lora = LoraSettings(
            r=s.lora_rank,
            alpha=s.lora_alpha,
            dropout=s.lora_dropout,
            target_modules=list(s.lora_target_modules) if s.lora_target_modules else None,
        )
        self.host = await self._model(ModelHost.load, s.model, lora, device=s.device, seed=s.seed)
        self.config = RoundConfig.from_settings(s)
        self.protocols = self._executed_protocols()
        #: The overlay's last top-K, reported with the profile (empty: none yet).
        self.overlay_peers: list[str] = []
        self.parameter_space = await self._model(host_parameter_space, self.host)
        self.telemetry = AgentTelemetry(self.registry)
        # Generated code is run only confined: refuse to start (before any model output is
        # executed) when this kernel lacks Landlock or seccomp, unless the operator opted out.
        self.sandbox_telemetry = SandboxTelemetry(self.registry)
        require_confinement(
            allow_unconfined=s.sandbox_allow_unconfined, telemetry=self.sandbox_telemetry
        )
        # Public: the transfer prompts and the bank's public corpus (code every model saw).
        self.guardrail = agent_guardrail(
            self.train_texts,
            public_texts=self.transfer_prompts,
            ngram=s.guardrail_ngram,
            registry=self.registry,
        )

    async def _fit_router(self) -> None:
        """With ``integration: separate``: an empty peer slot and the input router, fitted
        on the own training prompts against X_u's, calibrated on the validation prompts."""

        if self.s.integration != "separate":
            return
        self.slot = PeerSlot(rehearsal=self.s.slot_rehearsal, seed=self.s.seed)
        self.router, how = await asyncio.to_thread(
            fit_agent_router,
            [p.prompt for p in self.train],
            [p.category for p in self.train],
            self.transfer_prompts,
            self.transfer_categories,
            [p.prompt for p in self.val],
        )
        banks = self.s.slot_banks or "category"
        if banks == "category" and self.router is not None:
            self.slot.classify = self.router.unheld_category
        emit = self.log.info if self.router is not None else self.log.warning
        emit(
            "peer_router_fitted",
            how=how,
            threshold=None if self.router is None else round(self.router.threshold, 4),
            slot_banks=banks if self.router is not None else "one",
        )
        if self.s.reward_scope == "routed" and self.reward_scope is not None:
            self.reward_scope = self.reward_scope.routed(
                self.router.to_peer if self.router is not None else None
            )
            if not self.reward_scope.probe:
                # Every AKD reward is then Eq. 3's KB penalty alone: say so once, at start.
                self.log.warning(
                    "reward_scope_measures_nothing",
                    reason="no probe problem reaches the peer slot (reward_scope 'routed')",
                )

    def _executed_protocols(self) -> tuple[str, ...]:
        """The protocols this agent advertises: the settings' choice, of those it has an
        implementation of (ValueError for a configured one it has not)."""
        chosen = self.s.executed_protocols()
        if self.s.protocols is not None:
            missing = [p for p in chosen if p not in self.exchanges]
            if missing:
                raise ValueError(f"protocols {', '.join(missing)} have no implementation here")
        return tuple(p for p in chosen if p in self.exchanges)

    async def run_model(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the model thread (the exchange protocols' model executor)."""
        return await self._model(fn, *args, **kwargs)

    @property
    def slot_learns(self) -> Callable[[Sequence[str]], Sequence[bool]] | None:
        """What the peer slot distils of a package (every item, or with ``slot_scope:
        routed`` the router's peer side; :func:`~peerlm.agent.peer_integration.slot_learns`);
        None without a slot."""
        if self.slot is None:
            return None
        return slot_learns(self.router, self.s.slot_scope)

    def integrating(self, what: str) -> Callable[..., Awaitable[Any]]:
        """How an integration's model calls run: in the peer slot (``separate``, labelled
        ``what``) or on the one adapter (``shared``)."""

        if self.slot is None:
            return self._model
        return slot_runner(self._model, self.slot, self.host, what)

    def slot_integrated(self, kind: str) -> None:
        """Count the integrations the peer slot took since the last call (``separate``)."""
        if self.slot is None:
            return
        new = self.slot.integrations - self.summary.peer_slot_integrations
        if new > 0:
            self.telemetry.peer_slot_integrations.labels(kind).inc(new)
        self.summary.peer_slot_integrations = self.slot.integrations
        self.telemetry.peer_slot_banks.set(len(self.slot.banks))

    async def _restore(self) -> None:
        """The latest checkpoint's adapter, round state and summary, if there is one."""

        self.checkpoints = CheckpointStore(self.s.state_dir / "checkpoints")
        self.summary = AgentSummary(
            name=self.identity.name,
            model=str(self.s.model),
            family=self.host.family,
            trainable_share=self.host.trainable_share,
        )
        self.state: dict[str, Any] = {"round": 0, "processed": [], "history": []}
        restored = await self._model(self.checkpoints.load_latest)
        if restored is not None:
            await self._model(self.host.load_adapter_state, dict(restored.tensors))
            self.state = dict(restored.state)
            saved = self.state.get("summary")
            if isinstance(saved, dict):
                self.summary = AgentSummary(**saved)
                # A restart re-joins the overlay: OnePeFT's one shot is taken again.
                self.summary.one_shot_round = None
            if self.slot is not None:
                await self._restore_slot(restored)
                self.summary.peer_slot_integrations = self.slot.integrations
                self.telemetry.peer_slot_banks.set(len(self.slot.banks))
            self.log.info("checkpoint_restored", round=self.state["round"])

    async def _restore_slot(self, restored: Any) -> None:
        """The peer slot saved with ``restored``; a damaged or misfitting bank is set aside
        and counted, and starts empty (never an error)."""

        assert self.slot is not None

        def damaged(reason: str) -> None:
            self.telemetry.peer_slot_quarantined.labels(reason).inc()
            self.log.warning("peer_slot_quarantined", round=restored.round, reason=reason)

        await self._model(restore_slot, self.slot, self.host, restored, self.checkpoints, damaged)

    async def _serve(self) -> None:
        """The peer-exchange server (with the overlay when enabled), the directive book it
        checks requests against, and the metrics endpoint."""
        s = self.s
        self.book = DirectiveBook(time.time)
        self._predictions: dict[int, asyncio.Future[tuple[list[int], list[str]]]] = {}
        # One send budget for the port: every service on it streams through this streamer,
        # so a member is metered by one share whichever service it pulls from.
        streamer = PeerStreamer(self.registry, s.peer_send, log=self.log)
        service = self.peer_service = PeerExchangeService(
            self.book,
            self._package_for,
            self._adapter_for,
            chunk_bytes=s.limits.chunk_bytes,
            max_package_bytes=s.max_package_bytes,
            max_adapter_bytes=self.host.adapter_spec().max_encoded_bytes(),
            registry=self.registry,
            log=self.log,
            signer=self.ctx.signer,
            streamer=streamer,
            # A FedWave expert's adapter (trained on its stage's private examples) leaves
            # only over the FedWave exchange, to the agents of the workflow's other stages
            # (decide_pull); PullAdapter would hand it to any member of the federation.
            adapter_closed=(
                (
                    "fedwave_expert",
                    "this agent is a FedWave expert: its adapter is served only over "
                    "FedWaveExchange, to the agents of its workflow's other stages",
                )
                if s.fedwave.enabled
                else None
            ),
        )
        extra = await self._fedproxy_services(streamer)
        if s.fedwave.enabled:
            # FedWave: serve this stage's router and VCLayer to the workflow's agents on the
            # same port (round 0 published; run() plays the expert round loop).
            from peerlm.agent.fedwave.agent_node import start_fedwave
            from peerlm.agent.fedwave.exchange_service import FEDWAVE_POLICY, fedwave_service

            self.fedwave = start_fedwave(
                self.ctx,
                s.fedwave,
                hidden_size=int(self.host.model.config.hidden_size),
                n_samples=len(self.train_examples),
                chunk_bytes=s.limits.chunk_bytes,
                log=self.log,
                streamer=streamer,
                # π_SFT's assembly: the other stages' adapters must fit this host's.
                adapter=self.host.adapter_spec() if s.fedwave.assembly.enabled else None,
            )
            extra.append((fedwave_service(self.fedwave.service), FEDWAVE_POLICY))
        if s.overlay.enabled:
            from peerlm.agent.overlay_client.node import serve_agent
            from peerlm.overlay import ImportanceTracker

            self.importance = ImportanceTracker(s.overlay.importance_beta)
            saved_importance = self.state.get("importance")
            if isinstance(saved_importance, dict):
                self.importance.load_state_dict(saved_importance)
            self.server, self.overlay = await serve_agent(self.ctx, service, s, extra)
        else:
            self.server = await serve_peer(self.ctx, service, listen=s.listen, extra=extra)
        host, _ = parse_host_port(s.listen)
        self.endpoint = s.advertise or f"{host}:{self.server.port}"
        self.ctx.check_advertised(self.endpoint)
        self.metrics_endpoint = (
            serve_metrics(self.registry, s.metrics_host, s.metrics_port)
            if s.metrics_port is not None
            else None
        )

    async def _fedproxy_services(self, streamer: PeerStreamer) -> list[tuple[Any, Any]]:
        """FedProxy's role (docs/fedproxy.md, section 6): the owner loads its proxy, a
        member its trainer (its own tokenizer: the host's is the model worker's); either
        serves ``ProxyExchange`` on the peer server, streaming through the port's
        ``streamer``."""
        fp = self.s.fedproxy
        if not fp.enabled:
            return []
        from peerlm.agent.fedproxy.member import ProxyMember, text_trainer
        from peerlm.agent.fedproxy.owner import ProxyOwner
        from peerlm.agent.fedproxy.service import FEDPROXY_POLICY, fedproxy_service
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self._cohort_loss = await self._fedproxy_evaluator()
        if fp.owner:
            if fp.compress_ratio is not None and not (fp.proxy_path / "config.json").is_file():
                await self._fedproxy_compress(fp.compress_ratio)
            proxy = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, fp.proxy_path)
            checkpoint = self.s.state_dir / "fedproxy" / "owner-proxy.safetensors"
            self.cohort = ProxyOwner(
                self.ctx, fp, proxy, checkpoint=checkpoint, evaluate=await self._fedproxy_gate()
            )
        else:
            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.s.model)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            trainer = text_trainer(
                tokenizer,
                self.train_texts,
                steps=fp.local_steps,
                learning_rate=fp.learning_rate,
                batch_size=self.s.batch_size,
                max_length=self.s.max_length,
                seed=self.s.seed,
            )
            # The only proxy configuration a member accepts is the one its own base implies.
            base_config = await asyncio.to_thread(AutoConfig.from_pretrained, self.s.model)
            self.cohort = ProxyMember(
                self.ctx, fp, trainer, base_config=base_config, evaluate=self._cohort_loss
            )
        service = self.cohort.service(
            chunk_bytes=self.s.limits.chunk_bytes,
            max_wait_s=fp.round_deadline_s,
            streamer=streamer,
        )
        self.log.info(
            "fedproxy_role",
            owner=fp.owner,
            cohort=sorted(fp.cohort),
            owner_name=fp.owner_name,
            rounds=fp.rounds,
        )
        return [(fedproxy_service(service), dict(FEDPROXY_POLICY))]

    async def _fedproxy_compress(self, ratio: float) -> None:
        """The owner's proxy made at start (``fedproxy.compress_ratio``): its model by Block
        Influence on the public transfer set, written to ``fedproxy.proxy_path``."""
        from peerlm.agent.fedproxy.agent import make_owner_proxy
        from peerlm.agent.tasks.dataset import read_jsonl

        texts = [p.prompt + p.reference for p in read_jsonl(self.s.transfer_file)]
        kept, influence = await asyncio.to_thread(
            make_owner_proxy,
            self.s.model,
            texts,
            self.s.fedproxy.proxy_path,
            ratio,
            max_length=self.s.max_length,
        )
        self.log.info(
            "fedproxy_compressed",
            ratio=ratio,
            kept_blocks=kept,
            block_influence=[round(v, 6) for v in influence],
            texts=len(texts),
            path=str(self.s.fedproxy.proxy_path),
        )

    async def _fedproxy_evaluator(self) -> Evaluator | None:
        """The cohort report's held-out loss (owner and member): mean token cross-entropy
        on the first ``fedproxy.gate_examples`` validation texts, tokenised as the members
        train; None without validation texts."""
        texts = self._gate_texts()
        self._cohort_texts = len(texts)
        return await self._text_loss(texts) if texts else None

    def _gate_texts(self) -> list[str]:
        """The first ``fedproxy.gate_examples`` validation texts (prompt + reference)."""
        return [p.prompt + p.reference for p in self.val[: self.s.fedproxy.gate_examples]]

    async def _text_loss(self, texts: list[str]) -> Evaluator:
        """Mean token cross-entropy on ``texts`` under the model's tokenizer (which a proxy
        shares), batched and truncated as the agent trains."""
        from peerlm.agent.fedproxy.member import text_loss
        from transformers import AutoTokenizer

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.s.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return text_loss(
            tokenizer, texts, batch_size=self.s.batch_size, max_length=self.s.max_length
        )

    async def _fedproxy_gate(self) -> Evaluator | None:
        """The owner's acceptance gate: a merged proxy's loss on the first
        ``fedproxy.gate_examples`` validation texts (prompt + reference, tokenised with the
        model's tokenizer, which the proxy shares); None when the gate is off or there is no
        validation text (logged: merges then pass on the norm bound alone)."""
        fp = self.s.fedproxy
        texts = self._gate_texts()
        if fp.acceptance_margin is None or not texts:
            self.log.warning(
                "fedproxy_gate_off", margin=fp.acceptance_margin, validation_texts=len(texts)
            )
            return None
        return await self._text_loss(texts)

    async def _fedproxy_rounds(self) -> None:
        """Run ``fedproxy.rounds`` cohort rounds beside the agent's own rounds. A member
        ends by keeping the owner's final merge. A failure ends the cohort's part (logged,
        in the summary's errors), not the agent."""
        from peerlm.agent.fedproxy.agent import CohortReport

        fp, cohort = self.s.fedproxy, self.cohort
        report = CohortReport(
            role="owner" if fp.owner else "member", heldout_texts=self._cohort_texts
        )
        try:
            if fp.owner:
                if self._cohort_loss is not None and cohort.round == 0:
                    report.heldout_before, report.proxy_before = await asyncio.to_thread(
                        self._fedproxy_measure_owner, None
                    )
                await cohort.start()  # resumes at the checkpointed round
                while cohort.round <= fp.rounds:
                    await cohort.run_round()
                    self.summary.fedproxy_rounds += 1
                report.heldout_after, report.proxy_after = await asyncio.to_thread(
                    self._fedproxy_fuse, fp.fused_path
                )
                await cohort.linger(fp.round_deadline_s)
            else:
                t = 0
                while t < fp.rounds:  # a late member takes the owner's current round
                    t = await cohort.run_round(t + 1)
                    self.summary.fedproxy_rounds += 1
                await cohort.keep(t + 1)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the cohort's failure is logged, the agent goes on
            self.summary.errors.append(f"fedproxy: {err}")
            self.log.error("fedproxy_failed", error=repr(err))
        finally:
            self._fedproxy_report(report)

    def _fedproxy_report(self, report: Any) -> None:
        """Complete ``report`` from the cohort's records and counters into the summary."""
        from peerlm.agent.fedproxy.agent import fedproxy_bytes

        cohort = self.cohort
        report.rounds = self.summary.fedproxy_rounds
        report.bytes_sent, report.bytes_received = fedproxy_bytes(self.registry)
        if self.s.fedproxy.owner:
            report.proxy_sha256 = {str(k): v for k, v in sorted(cohort.published.items())}
            report.merges = list(cohort.history)
        else:
            report.proxy_sha256 = {str(k): v for k, v in sorted(cohort.pulled.items())}
            report.losses = {str(k): v for k, v in sorted(cohort.losses.items())}
            if cohort.losses:
                first, last = min(cohort.losses), max(cohort.losses)
                report.heldout_before = cohort.losses[first]
                report.heldout_after = cohort.losses[last] if last > first else None
        if cohort.info is not None:
            report.kept_blocks = list(cohort.info.kept_blocks)
            report.source_layers = int(cohort.info.source_layers)
        self.summary.fedproxy = asdict(report)

    def _fedproxy_measure_owner(self, fused: Any) -> tuple[float, float]:
        """The owner's held-out losses (called on a worker thread, off the event loop): the
        full model (``fused``, else ``model`` as loaded) and the current global proxy."""
        from transformers import AutoModelForCausalLM

        assert self._cohort_loss is not None
        full = fused if fused is not None else AutoModelForCausalLM.from_pretrained(self.s.model)
        proxy = self.cohort.global_proxy()
        return self._cohort_loss(full), self._cohort_loss(proxy)

    async def _fedwave_rounds(self) -> None:
        """The expert round loop (docs/fedwave.md, "The expert round loop"): ``rounds``
        FedWave rounds (0: until stopped) on this stage's private examples, the held-out
        loss on the validation examples before and after; then serve until the others have
        the last round's parts. With ``fedwave.assembly`` π_SFT is assembled and aligned by
        DPO after the last round (docs/fedwave.md, section 5). A failure ends the loop
        (logged, in the summary's errors)."""
        from peerlm.agent.checkpoint import CheckpointStore
        from peerlm.agent.fedwave.code_chain import StageExample
        from peerlm.agent.fedwave.expert_loop import ExpertLoop
        from peerlm.agent.fedwave.expert_round import ExpertTrainer

        s, node = self.s, self.fedwave
        as_examples = [
            StageExample(p.task_id, node.stage, p.prompt, p.reference) for p in self.train
        ]
        val = self.val[: s.eval_limit] if s.eval_limit else self.val
        held_out = [StageExample(p.task_id, node.stage, p.prompt, p.reference) for p in val]
        trainer = ExpertTrainer(
            self.host.model,
            self.host.tokenizer,
            node.vclayer,
            node.router,
            stage_index=node.stage_index,
            examples=as_examples,
            collab=s.fedwave.collab,
            learning_rate=s.learning_rate,
            router_lr=s.fedwave.router.learning_rate or s.learning_rate,
            batch_size=s.batch_size,
            max_length=s.max_length,
            seed=s.seed,
            interrupt=self.host.interrupt,
        )
        loop = ExpertLoop(
            self.ctx,
            s.fedwave,
            node,
            trainer,
            n_samples=len(as_examples),
            # Unset: one pass over the stage's examples per round.
            local_steps=s.local_steps or -(-len(as_examples) // s.batch_size),
            run_on_model=lambda fn: self._model(fn),
            # Each concluded round, atomically; a restart goes on from the newest.
            checkpoints=CheckpointStore(s.state_dir / "fedwave" / "checkpoints", log=self.log),
            adapter_state=self.host.adapter_state,
            load_adapter=self.host.load_adapter_state,
            encoded_adapter=lambda: self.host.encoded_adapter().data,
            # Only the last round's parts carry the adapter (the assembly's); 0: no last.
            final_round=s.rounds or None,
        )
        self._expert_loop = loop
        t = 0
        try:
            t = await loop.restore()
            if t == 0:
                await loop.measure(held_out, after=False)
            if await self._unless_aborted(loop.rejoin(t) if t else loop.start()):
                t = loop.next_round - 1
                while not self._stop.is_set() and (s.rounds == 0 or t < s.rounds):
                    t += 1
                    if not await self._unless_aborted(loop.play(t)):
                        t -= 1
                        break
            if not self._stop.is_set():
                await loop.measure(held_out, after=True)
                if t and s.fedwave.assembly.enabled:
                    # π_SFT from the stages' experts, DPO on the public prompts (X_u).
                    await self._unless_aborted(loop.assemble(t, held_out, self.transfer_prompts))
                if t:
                    await loop.linger(t, self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the loop's failure is reported, the agent stops cleanly
            self.summary.errors.append(f"fedwave: {err!r}")
            self.log.error("fedwave_failed", round=t, error=repr(err))
        self.summary.rounds_completed = loop.report.rounds
        self._count_sent()

    async def _unless_aborted(self, step: Awaitable[Any]) -> bool:
        """Run ``step`` unless the stop grace runs out first (then it is cancelled, the
        summary says interrupted, and False); a FedWave round may otherwise wait out its
        deadline after a stop."""
        task = asyncio.ensure_future(step)
        aborted = asyncio.ensure_future(self._abort.wait())
        done, _ = await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if task in done:
            task.result()
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.summary.interrupted = True
        self.log.warning("fedwave_round_cut", reason="stop_grace_over")
        return False

    def _fedproxy_fuse(self, out: Path | None) -> tuple[float | None, float | None]:
        """The owner's final proxy fused into a fresh copy of its full model, written to
        ``out`` with the tokenizer (loadable with ``from_pretrained``) when set; the fused
        model's and the final proxy's held-out losses (None without validation texts)."""
        from peerlm.agent.fedproxy.member import save_model_atomic
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if out is None and self._cohort_loss is None:
            return None, None
        full = AutoModelForCausalLM.from_pretrained(self.s.model)
        changed = self.cohort.fuse(full)
        if out is not None:
            save_model_atomic(full, out)
            AutoTokenizer.from_pretrained(self.s.model).save_pretrained(out)
            self.log.info("fedproxy_fused", path=str(out), changed_tensors=len(changed))
        if self._cohort_loss is None:
            return None, None
        return self._fedproxy_measure_owner(full)

    # ------------------------------------------------------------ teacher side

    def _wanted_mode(self, directive: cpm_pb2.Directive) -> PackageMode:
        mode = self.s.akd_mode
        if mode == "directive":
            payload = lookup(directive.protocol).payload
            return "logits" if payload == "logits_package" else "text"
        return mode

    async def _teacher_predictions(
        self, directive: cpm_pb2.Directive
    ) -> tuple[list[int], list[str]]:
        """Greedy completions on what this agent teaches of X_u (:meth:`_teachable`) for a
        directive, as (prompt indices, completions), generated once and shared.

        The round loop starts this when the directive arrives; the peer server's fetch
        awaits the same future, so the model generates once per matchmaking round: every
        student this agent teaches in it (``pairing: per_student`` gives a teacher several)
        gets the same answers.
        """
        key = int(directive.matchmaking_round)
        task = self._predictions.get(key)
        if task is None:
            task = asyncio.ensure_future(self._model(self._predict_teachable))
            # Keep only the latest few: predictions are worth nothing after their round.
            self._predictions = {**dict(list(self._predictions.items())[-3:]), key: task}
        return await asyncio.shield(task)

    def _predict_teachable(self) -> tuple[list[int], list[str]]:

        chosen = self._teachable()
        prompts = [self.transfer_prompts[k] for k in chosen]
        completions = teacher_completions(self.host, prompts, self.s.max_new_tokens)
        if self.s.teach_self_check:
            checked = self_check(
                prompts,
                completions,
                **self._sandbox_limits(),
            )
            counts = self.telemetry.self_checked
            counts.labels("failed").inc(checked.failed)
            counts.labels("passed").inc(checked.checked - checked.failed)
            counts.labels("unchecked").inc(len(prompts) - checked.checked)
            chosen = [chosen[i] for i in checked.kept]
            completions = [completions[i] for i in checked.kept]
            self.log.info(
                "teacher_self_checked",
                answers=len(prompts),
                checked=checked.checked,
                failed=checked.failed,
                sent=len(chosen),
            )
        self.telemetry.taught_prompts.observe(len(chosen))
        return chosen, completions

    async def _package_for(
        self, directive: cpm_pb2.Directive, student_tokenizer: str | None
    ) -> bytes:
        """Teacher predictions on X_u for a verified student, guardrailed and encoded.

        Logits only where this directive (or ``akd_mode``) asks for them *and* the student
        announced our tokenizer; text otherwise. The peer server caches the result per
        directive.
        """

        chosen, completions = await self._teacher_predictions(directive)
        wanted = self._wanted_mode(directive)
        mode = choose_package_mode(wanted, self.host.tokenizer_hash, student_tokenizer)
        data = await self._model(
            build_package,
            self.host,
            mode=mode,
            prompts=[self.transfer_prompts[k] for k in chosen],
            prompt_ids=[str(k) for k in chosen],
            completions=completions,
            teacher=self.identity.name,
            directive_id=directive.directive_id,
            transfer_sha256=self.transfer_digest,
            guardrail=self.guardrail,
            top_k=self.s.logits_top_k,
            max_length=self.s.max_length,
        )
        self.telemetry.packages_built.labels(mode).inc()
        self.summary.packages_by_mode[mode] = self.summary.packages_by_mode.get(mode, 0) + 1
        self.log.info(
            "package_built",
            directive=directive.directive_id,
            student=directive.student,
            protocol=directive.protocol,
            wanted=wanted,
            mode=mode,
            prompts=len(chosen),
            bytes=len(data),
        )
        return data

    async def _adapter_for(self, round_: int) -> tuple[int, HashedPayload] | None:
        # Encoded and hashed once per adapter version; pulls of that version share it.
        encoded = await self._model(self.host.encoded_adapter)
        return int(self.state["round"]), encoded

    # ------------------------------------------------------------ evaluation

    async def _evaluate(self, with_pass: bool) -> tuple[float, float]:
        """(validation loss, pass@1; NaN when not measured). pass@1 runs generated code in
        the sandbox.

        Generation runs in the model worker, the sandbox in the default executor, so the
        model worker stays free (e.g. to build a package for a peer) while code runs.
        """

        loss, _ppl = await self._model(
            self.host.eval_loss, self.val_examples, max_length=self.s.max_length
        )
        if not with_pass:
            return loss, float("nan")
        problems = self.val[: self.s.eval_limit] if self.s.eval_limit else self.val
        completions = await self._model(
            sample_completions, self.host, problems, max_new_tokens=self.s.max_new_tokens
        )
        report = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: score_completions(
                problems,
                completions,
                ks=(1,),
                **self._sandbox_limits(),
            ),
        )
        competence = competence_of((r.category, r.c, r.n) for r in report.problems)
        self.state["competence"] = competence.to_dict()
        return loss, float(report.mean.get(1, 0.0))

    def _sandbox_limits(self) -> LimitOptions:
        """The sandbox's limits from the settings, for every run of generated code (one
        place, so no call site forgets the opt-out or the telemetry)."""
        return LimitOptions(
            timeout_s=self.s.sandbox_timeout_s,
            memory_mb=self.s.sandbox_memory_mb,
            allow_unconfined=self.s.sandbox_allow_unconfined,
            telemetry=self.sandbox_telemetry,
        )

    def _teachable(self) -> list[int]:
        """The X_u prompts this agent answers as a teacher (``teach_scope``,
        :mod:`peerlm.agent.exchange.teaching`), by its last measured validation pass@1 per
        category."""
        saved = self.state.get("competence")
        competence = Competence.from_dict(saved) if isinstance(saved, dict) else None
        return teachable_indices(
            self.transfer_categories,
            competence,
            scope=self.s.teach_scope,
            min_pass=self.s.teach_min_pass,
        )

    async def _evaluate_slices(self) -> dict[str, dict[str, float]]:
        """Greedy pass@1, structural match and reference NLL (nats/byte) per slice; with
        ``integration: separate`` each problem is answered by the adapter the router picks
        (own or peer slot), and ``peer_share`` is the share of the slice sent to the slot."""

        host, router = self.host, self.router
        slot = self.slot if self.slot is not None else PeerSlot()

        def routed(problems: list[Any], run: Callable[[Any], Any]) -> list[Any]:
            return route_map(host, slot, router, problems, lambda p: p.prompt, run)

        def verdicts(prompts: Sequence[str], answers: Sequence[str]) -> list[bool | None]:
            return example_verdicts(
                prompts,
                answers,
                **self._sandbox_limits(),
            )

        def answered(problems: list[Any], run: Callable[[Any], Any]) -> tuple[list[Any], Any]:
            # The model's part of an answer_check: every answer, and for the inputs routed
            # to the slot both adapters' (judged after, outside the model worker).
            seen: list[tuple[list[Any], list[Any], list[Any]]] = []

            def keep(items: Any, own: Any, peer: Any) -> Any:
                seen.append((list(items), list(own), list(peer)))
                return peer

            check = keep if self.s.answer_check != "off" else None
            got = route_map(host, slot, router, problems, lambda p: p.prompt, run, choose=check)
            return got, seen[0] if seen else None

        async def checked(problems: list[Any], answers: list[Any], to_check: Any) -> int:
            # answer_check on the routed inputs (sandbox runs in the default executor);
            # their answers replaced in place; the count of the own adapter's kept.
            if to_check is None:
                return 0
            items, own, peer = to_check
            result = await asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    check_answers,
                    self.s.answer_check,
                    [p.prompt for p in items],
                    own,
                    peer,
                    verdicts,
                ),
            )
            index = {p.task_id: k for k, p in enumerate(problems)}
            for p, answer in zip(items, result.answers, strict=True):
                answers[index[p.task_id]] = answer
            return result.from_own

        def greedy(problems: list[Any]) -> list[list[str]]:
            got = sample_completions(host, problems, max_new_tokens=self.s.max_new_tokens)
            return [got[p.task_id] for p in problems]

        out: dict[str, dict[str, float]] = {}
        for name, problems in self.slice_problems.items():
            if not problems:
                continue
            nll = await self._model(routed, problems, functools.partial(reference_nll, host))
            answers, to_check = await self._model(answered, problems, greedy)
            from_own = await checked(problems, answers, to_check)
            self.telemetry.peer_slot_own_answers.labels(name).inc(from_own)
            completions = {p.task_id: c for p, c in zip(problems, answers, strict=True)}
            share = routed_share(router, [p.prompt for p in problems]) if slot.ready else 0.0
            self.telemetry.peer_slot_routed.labels(name).set(share)
            report = await asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    score_completions,
                    problems,
                    completions,
                    ks=(1,),
                    **self._sandbox_limits(),
                ),
            )
            out[name] = {
                "pass1": float(report.mean.get(1, 0.0)),
                "struct": sum(structural_match_rate(p, completions[p.task_id]) for p in problems)
                / len(problems),
                "nll": sum(nll) / len(nll),
                "n": float(len(problems)),
                "peer_share": share,
                # Routed answers the own adapter gave in the slot's place (answer_check).
                "own_answers": float(from_own),
            }
        return out

    # ------------------------------------------------------------ round loop

    async def run(self) -> AgentSummary:
        """Play rounds until ``rounds`` are done (0: forever) or :meth:`stop` is called."""
        s = self.s
        inbox: asyncio.Queue[cpm_pb2.Directive] = asyncio.Queue()
        feed = asyncio.create_task(self._follow(inbox))
        cohort = asyncio.create_task(self._fedproxy_rounds()) if self.cohort else None
        try:
            if self.fedwave is not None:
                # A FedWave expert plays FedWave rounds instead of CPM-directed ones: both
                # would train the same adapter.
                await self._fedwave_rounds()
                return self.summary
            if cohort is not None and s.fedproxy.cohort_only:
                # The cohort's rounds only (fedproxy.cohort_only): no CPM-directed rounds,
                # no evaluation of the adapter those would train.
                await self._until_stopped(cohort)
                self.summary.rounds_completed = self.summary.fedproxy_rounds
                return self.summary
            if self.state["round"] == 0 and not self._stop.is_set():
                loss, pass1 = await self._evaluate(with_pass=True)
                self.summary.loss_before, self.summary.pass_at_1_before = loss, pass1
                self.summary.loss_after, self.summary.pass_at_1_after = loss, pass1
                self.summary.slices_before = await self._evaluate_slices()
            if self.overlay is not None:
                await self._overlay_enter()
            t = int(self.state["round"])
            while not self._stop.is_set() and (s.rounds == 0 or t < s.rounds):
                t += 1
                await self._round(t, inbox, feed)
            if not self._stop.is_set():
                self.summary.slices_after = await self._evaluate_slices()
            if cohort is not None:  # the cohort's rounds are bounded by their deadlines
                await self._until_stopped(cohort)
        except grpc.aio.AioRpcError as err:
            self.summary.errors.append(f"{err.code().name}: {err.details()}")
            self.log.error("cpm_error", code=err.code().name, detail=err.details())
        finally:
            feed.cancel()
            if cohort is not None:
                cohort.cancel()
            await asyncio.gather(feed, *([cohort] if cohort else []), return_exceptions=True)
            await self._linger()
        self._count_sent()
        return self.summary

    async def _until_stopped(self, task: asyncio.Task[Any]) -> None:
        """Wait for ``task`` or :meth:`stop`, whichever comes first."""
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()

    def _count_sent(self) -> None:
        if self._expert_loop is not None:
            # FedWave: the parts served and pulled are the traffic (no package moves), with
            # the report (its byte counts go on across restarts).
            report = self._expert_loop.count_bytes()
            self.summary.bytes_sent = sum(report.bytes_sent.values())
            self.summary.bytes_received = sum(report.bytes_received.values())
            self.summary.fedwave = asdict(report)
            return
        sent = self.registry.get_sample_value("peerlm_agent_package_bytes_sent_total")
        self.summary.bytes_sent = int(sent or 0)
        adapters = self.registry.get_sample_value("peerlm_agent_adapter_bytes_sent_total")
        self.summary.overlay_bytes_sent = int(adapters or 0)

    async def _linger(self) -> None:
        """After the last round, keep serving until the last student has started its fetch
        (bounded by ``round_timeout_s``); the server's graceful stop lets it finish."""
        await asyncio.gather(*self._prebuild, return_exceptions=True)
        if self._stop.is_set():
            return
        deadline = time.monotonic() + self.s.round_timeout_s
        for taught in self._last_taught:
            while self.book.fetches(taught) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        for student, before in self._last_merge:
            while (
                self.peer_service.adapter_pulls(student) <= before and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.2)

    async def _follow(self, inbox: asyncio.Queue[cpm_pb2.Directive]) -> None:
        """Every directive goes into the book (the peer server verifies fetches against it);
        new ones also go to the round loop, which waits for this round's pairing."""
        async for d in self.cpm.directives():
            if d.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED:
                await inbox.put(d)  # not a directive: nothing for the book
                continue
            self.book.add(d)
            if d.directive_id not in self.state["processed"]:
                await inbox.put(d)

    async def _round(
        self,
        t: int,
        inbox: asyncio.Queue[cpm_pb2.Directive],
        feed: asyncio.Task[None],
    ) -> None:

        s = self.s
        started = mark = time.monotonic()
        phase = self.telemetry.phase_seconds

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phase.labels(name).observe(now - mark)
            mark = now

        self.log.info("round_started", round=t)
        stats = await self._model(local_update, self.host, self.train_examples, self.config, t)
        self.note_interrupted(stats.interrupted, t, "train", stats.steps)
        lap("train")
        with_pass = (t % s.eval_every == 0 or t == s.rounds) and not self._abort.is_set()
        loss, pass1 = await self._evaluate(with_pass)
        lap("evaluate")
        self.telemetry.val_loss.set(loss)
        history = self.state["history"]
        profile, pass1 = round_profile(
            self.host,
            ProfileInputs(
                t=t,
                total_rounds=s.rounds,
                val_loss=loss,
                pass_at_1=pass1,
                last_reward=self.summary.rewards[-1] if self.summary.rewards else 0.0,
                exchanges=self.summary.exchanges,
            ),
            history,
            category_counts(self.train),
            dp_epsilon=s.profile_dp_epsilon,
            seed=s.seed,
        )
        submitted = await self._submit_profile(t, [float(x) for x in profile])
        self.log.info(
            "round_trained",
            round=t,
            train_loss=round(stats.mean_loss, 4),
            val_loss=round(loss, 4),
            pass_at_1=pass1,
        )
        wait_started = time.monotonic()
        directives = await self._next_directives(inbox, feed) if submitted else []
        waited = time.monotonic() - wait_started
        lap("wait")
        if directives and await self._act_on_all(directives, t):
            lap("integrate")
        if self.overlay is not None and not self._abort.is_set():
            await self._overlay_step(t)
            lap("overlay")
        if directives:
            ids = [d.directive_id for d in directives]
            self.state["processed"] = [*self.state["processed"], *ids][-256:]
        if not math.isnan(pass1):
            self.telemetry.pass_at_1.set(pass1)
        self.summary.loss_after, self.summary.pass_at_1_after = loss, pass1
        history.append({"round": t, "loss": loss, "pass1": pass1})
        self.state["round"] = t
        self.summary.rounds_completed = t
        if self.slot is not None:
            self.state["peer_slot"] = slot_record(self.slot)
        self.state["summary"] = asdict(self.summary)
        adapter = await self._model(self.host.adapter_state)
        await self._model(
            self.checkpoints.save, t, adapter, _jsonable(self.state), extra=slot_extra(self.slot)
        )
        lap("checkpoint")
        self.telemetry.rounds.inc()
        self.log.info(
            "round_done",
            round=t,
            seconds=round(time.monotonic() - started, 2),
            waited_s=round(waited, 2),  # for a directive: the idle share of the round
        )

    async def _act_on_all(self, directives: Sequence[cpm_pb2.Directive], t: int) -> bool:
        """This round's directives: as a teacher first (each only starts its package, so
        the students' fetches are served while this agent learns), then as a student; True
        when this agent integrated (or tried to). Skipped once the stop grace has run out."""
        if any(d.role != cpm_pb2.EXCHANGE_ROLE_STUDENT for d in directives):
            # The linger waits for the latest round we taught in (as before, whatever
            # rounds we only learnt in since).
            self._prebuild, self._last_taught, self._last_merge = [], [], []
        integrated = False
        teaching_first = sorted(directives, key=lambda d: d.role == cpm_pb2.EXCHANGE_ROLE_STUDENT)
        for directive in teaching_first:
            if self._abort.is_set():
                self.log.info("directive_skipped", round=t, directive=directive.directive_id)
                continue
            integrated |= await self._act_on(directive, t)
        return integrated

    async def _act_on(self, directive: cpm_pb2.Directive, t: int) -> bool:
        """Do what the directive names (:func:`~peerlm.agent.cpm.directives.directive_action`):
        refuse it, or run the student's or the teacher's step of the protocol registered
        under its name (:attr:`exchanges`); True when this agent integrated (or tried to)
        as the student."""

        action = directive_action(
            directive.protocol,
            directive.role,
            self.protocols,
            names(kind="merge"),
            len(directive.co_senders),
        )
        if action == "refuse" and directive.protocol in self.protocols:
            # Co-senders on a protocol that is not a merge, or more than any merge names: a
            # directive no CPM sends. Not reported (it says nothing about the tuple); the
            # directive expires unrewarded.
            exchange_failed(
                self,
                directive,
                "malformed_directive",
                ValueError(
                    f"{len(directive.co_senders)} co-senders on protocol "
                    f"{directive.protocol[:32]!r} (a merge names at most "
                    f"{MAX_CO_SENDERS}; any other protocol none)"
                ),
            )
            return False
        if action == "refuse":
            exchange_failed(
                self,
                directive,
                "unsupported_protocol",
                ValueError(
                    f"protocol {directive.protocol[:32]!r} as role {int(directive.role)} is "
                    f"not one this agent executes ({', '.join(self.protocols)})"
                ),
            )
            if directive.role == cpm_pb2.EXCHANGE_ROLE_STUDENT:
                await report_refusal(self, directive, "unsupported_protocol")
            return False
        protocol = self.exchanges.get_protocol(directive.protocol)
        if action in ("merge", "learn"):
            await protocol.student(self, directive, t)
            return True
        self.log.info(
            "directive_teacher",
            round=t,
            directive=directive.directive_id,
            student=directive.student,
            protocol=directive.protocol,
        )
        self.summary.as_teacher += 1
        protocol.teacher(self, directive, t)
        return False

    def prebuild_predictions(self, directive: cpm_pb2.Directive) -> None:
        """As teacher: generate the package's predictions now, ahead of the next round's
        training in the model worker's queue, so the student does not wait behind it; the
        linger after the last round waits for the student's fetch."""
        self._last_taught.append(directive.directive_id)
        self._prebuild.append(asyncio.create_task(self._teacher_predictions(directive)))

    def expect_adapter_pull(self, student: str) -> None:
        """As teacher of a merge: the linger after the last round waits for one more
        adapter pull by ``student``."""
        self._last_merge.append((student, self.peer_service.adapter_pulls(student)))

    async def _overlay_enter(self) -> None:
        """Join the overlay (retrying the bootstrap nodes for up to ``round_timeout_s``) and
        publish a first signature, so the next overlay build places this agent."""
        from peerlm.agent.overlay_client.step import publish_signature

        deadline = time.monotonic() + self.s.round_timeout_s
        while not await self.overlay.join(self._stop):
            if self._stop.is_set() or time.monotonic() > deadline:
                self.log.warning("overlay_not_joined", retry="next round")
                return
            await asyncio.sleep(self.s.overlay.bootstrap_retry_s)
        try:
            p, p_min = await publish_signature(
                self.overlay.host, self.host, self.importance, self.s.overlay, self._model
            )
        except ValueError as err:
            self.log.warning("overlay_signature_refused", error=str(err))
            return
        self.state["importance"] = _importance_state(self.importance)
        self.log.info("overlay_signature_published", p=p, p_min=p_min)
        wait = self.s.overlay.placement_wait_s
        if wait > 0:
            started = time.monotonic()
            ready = await self.overlay.wait_ready(self._stop, wait)
            self.log.info(
                "overlay_ready" if ready else "overlay_not_ready",
                waited_s=round(time.monotonic() - started, 2),
            )

    async def _overlay_step(self, t: int) -> None:
        """SemanticDFL pull and personalised aggregation (:mod:`peerlm.agent.overlay_client.step`);
        its failures are counted in the summary and never end the round."""
        from peerlm.agent.overlay_client.step import overlay_round_step
        from peerlm.services.cpm import MAX_OVERLAY_PEERS

        if not await self.overlay.join(self._stop):
            self._count_overlay("not_joined", None)
            self.log.warning("overlay_step", round=t, outcome="not_joined")
            return
        result = await overlay_round_step(
            self.ctx,
            self.overlay.host,
            self.host,
            self.importance,
            settings=self.s.overlay,
            round_=t,
            round_timeout_s=self.s.round_timeout_s,
            run_model=self._model,
            gate=self._gate(),
            hka=(
                (self.public_pairs, self.config.integrating().train_settings(t))
                if self.public_pairs
                else None
            ),
            pull=not (self.s.overlay.aggregate_once and self.summary.one_shot_round is not None),
            integrate_model=self.integrating("overlay"),
        )
        self.slot_integrated("overlay")
        if self.s.overlay.aggregate_once and result.outcome == "aggregated":
            self.summary.one_shot_round = t
            self.log.info("overlay_one_shot_done", round=t, pulled=result.pulled)
        self._count_overlay(result.outcome, result)
        if result.neighbours:
            # The CPM narrows the senders of our merge directives to these (menu.py).
            self.overlay_peers = list(dict.fromkeys(result.neighbours))[:MAX_OVERLAY_PEERS]
        self.state["importance"] = _importance_state(self.importance)

    def _gate(self) -> Any:
        """The acceptance gate on the validation set (None when disabled)."""

        margin = self.s.acceptance_margin
        if margin is None:
            return None
        return AcceptanceGate(self.val_examples, margin, self.s.max_length)

    def _count_overlay(self, outcome: str, result: Any) -> None:
        steps = self.summary.overlay_steps
        steps[outcome] = steps.get(outcome, 0) + 1
        if result is None:
            return
        for peer in result.neighbours:
            if peer not in self.summary.overlay_neighbours:
                self.summary.overlay_neighbours.append(peer)
        self.summary.adapters_pulled += len(result.pulled)
        self.summary.overlay_bytes_received += result.bytes_received
        for reason in result.refused.values():
            refusals = self.summary.overlay_refusals
            refusals[reason] = refusals.get(reason, 0) + 1

    async def _submit_profile(self, t: int, features: list[float]) -> bool:
        """Submit this round's profile; False if the CPM cannot be reached right now.

        An unreachable CPM (restarting, or the network to it cut) makes the round a local
        one instead of ending the agent: it waits up to ``round_timeout_s`` for the channel
        to come back (so a long outage does not turn into back-to-back local rounds) and
        tries again next round. The directive feed reconnects on its own. Other errors
        (refused identity, invalid profile) still end the run.
        """
        try:
            resp = await self.cpm.submit_profile(
                t,
                features,
                self.endpoint,
                parameter_space=self.parameter_space,
                protocols=self.protocols,
                overlay_peers=self.overlay_peers,
            )
            self._awaited_round = int(resp.matchmaking_round)
            return True
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            self.telemetry.exchange_failures.labels("cpm_unreachable").inc()
            self.log.warning("cpm_unreachable", round=t, code=err.code().name, detail=err.details())
        waits = [
            asyncio.ensure_future(self.cpm.wait_ready(self.s.round_timeout_s)),
            asyncio.ensure_future(self._stop.wait()),
        ]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return False

    def note_interrupted(self, interrupted: bool, t: int, what: str, steps: int) -> None:
        """Record a training call the stop grace cut short."""
        if interrupted:
            self.summary.interrupted = True
            self.log.warning("training_interrupted", round=t, phase=what, steps_done=steps)

    async def _next_directives(
        self, inbox: asyncio.Queue[cpm_pb2.Directive], feed: asyncio.Task[None]
    ) -> list[cpm_pb2.Directive]:
        """This round's directives: the first (:meth:`_next_directive`) and the rest of its
        matchmaking round (:func:`~peerlm.agent.cpm.client.rest_of_round`; under
        ``pairing: per_student`` an agent may teach several students and learn from
        ``teachers_per_student`` teachers in one round)."""
        first = await self._next_directive(inbox, feed)
        if first is None:
            return []
        return [first, *await rest_of_round(inbox, first)]

    async def _next_directive(
        self, inbox: asyncio.Queue[cpm_pb2.Directive], feed: asyncio.Task[None]
    ) -> cpm_pb2.Directive | None:
        """This round's directive, or None: after ``round_timeout_s``, once the stop grace has
        run out, or at once when the CPM says our profile's matchmaking round left us
        unpaired (an older round's notice is skipped)."""
        deadline = time.monotonic() + self.s.round_timeout_s
        while not self._abort.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            waiting = asyncio.ensure_future(next_directive(inbox, feed, remaining))
            aborted = asyncio.ensure_future(self._abort.wait())
            try:
                await asyncio.wait({waiting, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                aborted.cancel()
                if not waiting.done():
                    waiting.cancel()
            await asyncio.gather(aborted, return_exceptions=True)
            if waiting.cancelled():
                return None
            d = waiting.result()
            if d is None or d.role != cpm_pb2.EXCHANGE_ROLE_UNMATCHED:
                return d
            if d.matchmaking_round >= self._awaited_round:
                self.log.info("not_matched", matchmaking_round=d.matchmaking_round)
                self.telemetry.unmatched_rounds.inc()
                return None
        return None

    # ------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Finish the round in progress within ``stop_grace_s``, then stop (see the module
        docstring). A second call cuts the grace short."""
        if self._stop.is_set():
            self._abort_now("second_signal")
            return
        self._stop.set()
        self.log.info("stop_requested", grace_s=self.s.stop_grace_s)
        loop = asyncio.get_running_loop()
        self._grace = loop.call_later(self.s.stop_grace_s, self._abort_now, "grace_expired")

    def _abort_now(self, why: str) -> None:
        if self._abort.is_set():
            return
        self.log.warning("stop_grace_over", reason=why)
        self._abort.set()
        self.host.interrupt.set()

    async def close(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        await self.cpm.close()
        if self.overlay is not None:
            # Leave gracefully while the server still answers the neighbours' handover.
            await self.overlay.close()
        await self.server.stop()
        # A fetch that started during the linger finishes inside the graceful stop; count
        # its bytes too, so the summary's sent and the students' received agree.
        self._count_sent()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self._worker.shutdown(wait=True)


def _importance_state(tracker: Any) -> dict[str, Any]:
    """The importance EMA as JSON for the round checkpoint (scores as a float list)."""
    state: dict[str, Any] = tracker.state_dict()
    scores = state["scores"]
    state["scores"] = None if scores is None else [float(x) for x in scores]
    return state


def _jsonable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as strict JSON values: NaN and the infinities are not JSON and the
    checkpoint's state.json must parse everywhere, so a non-finite float becomes None (the
    decoder's ``parse_constant``; a string that spells "NaN" is kept as it is); anything
    else JSON has no type for becomes its ``str``."""
    clean: dict[str, Any] = json.loads(
        json.dumps(state, default=str), parse_constant=lambda _constant: None
    )
    return clean
