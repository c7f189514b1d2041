"""The experiment's clients as agents: every directive a pairing strategy makes is executed
by the exchange protocol the daemon dispatches to (:func:`peerlm.agent.agent_registry`),
its teacher's step and its student's, with the peers and the CPM in this process.

What an agent has, each client has here (:class:`ClientAgent`, an
:class:`~peerlm.agent.ExchangeContext`):

* **peers** (:class:`InProcessPeers`, a :class:`~peerlm.agent.PeerTransport`): the package
  a teacher's step built for a directive, and any client's current adapter (encoded by the
  adapter codec, as the peer service serves it). The bytes then go through everything an
  agent does with received bytes: the package's decoding, limits and vetting, the adapter's
  codec checks and norm bounds, the acceptance gate, Eq. 3. Only the wire is left out: no
  TLS, no chunking, no sender proofs (one process has no identities to prove).
* **cpm** (:class:`InProcessCpm`): the pairing policy of the strategy. A reward is learnt
  from as the CPM service learns it (a refusal as the service's ``refusal_reward``), and
  the ack carries the normalised value the policy returns.
* **where it measures**: the gate and Eq. 3 run on the examples the plan's ``reward``
  names (:func:`~peerlm.app.experiment_distill.reward_examples`; the probe by default), with
  no margin for merges (a measurement, never a rollback) and AKD's margin from the round
  configuration, as the experiment has always measured them. An agent's gate judges its
  own validation set and its reward a configured probe (``reward_file``); the experiment
  measures both on one set so that every strategy's rewards compare.
* **where integrations write**: the peer slot (``separate``) through the daemon's own
  runner (:func:`~peerlm.agent.slot_runner`), or the one adapter (``shared``).

A student's step never raises for a failed exchange (it reports the refusal);
:meth:`InProcessFederation.execute` records no exchange for a directive that integrated
nothing, as the agent then counts none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from peerlm.app.experiment_distill import (
    reward_examples,
    reward_scope,
    teacher_answers,
    teacher_package_bytes,
)
from peerlm.app.experiment_world import Client, World, round_config
from peerlm.config import explicit_settings
from peerlm.protocols import lookup
from peerlm.wire.v1 import common_pb2, cpm_pb2

if TYPE_CHECKING:
    from peerlm.agent import (
        AcceptanceGate,
        AgentSettings,
        AgentSummary,
        AgentTelemetry,
        Candidate,
        ExchangeProtocol,
        Guardrail,
        ModelHost,
        ProtocolRegistry,
        PullReport,
        PullSettings,
        RoundConfig,
    )
    from peerlm.node import NodeContext
    from peerlm.services.cpm import Pairing, PairingPolicy

__all__ = [
    "ClientAgent",
    "EventLog",
    "Executed",
    "InProcessCpm",
    "InProcessFederation",
    "InProcessPeers",
]

T = TypeVar("T")


@dataclass
class EventLog:
    """A client's logger: keeps each line its steps log, ``(level, event, fields)``."""

    lines: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        self.lines.append((level, event, fields))

    def debug(self, event: str, /, **fields: Any) -> None:
        """Keep a debug line."""
        self._emit("debug", event, **fields)

    def info(self, event: str, /, **fields: Any) -> None:
        """Keep an info line."""
        self._emit("info", event, **fields)

    def warning(self, event: str, /, **fields: Any) -> None:
        """Keep a warning."""
        self._emit("warning", event, **fields)

    def error(self, event: str, /, **fields: Any) -> None:
        """Keep an error."""
        self._emit("error", event, **fields)


@dataclass
class InProcessPeers:
    """The experiment's peer transport (module docstring): packages offered per directive,
    adapters encoded from the named client's host when pulled. ``endpoint`` is the
    client's name. ``bytes_served`` counts every payload handed out."""

    clients: Mapping[str, Client]
    round_: int
    packages: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    bytes_served: int = 0
    frozen: dict[str, bytes] | None = None

    def offer(self, directive_id: str, teacher: str, data: bytes) -> None:
        """The package ``teacher`` built for ``directive_id`` (the teacher's step)."""
        self.packages[directive_id] = (teacher, data)

    def freeze(self) -> None:
        """Serve every client's adapter as it is now, whatever it becomes (agents that
        step at once: each pulls what the others held before their own steps)."""
        self.frozen = {n: c.host.encoded_adapter().data for n, c in self.clients.items()}

    def _hand_out(self, what: str, data: bytes, max_bytes: int) -> bytes:
        from peerlm.agent import PeerExchangeError

        if len(data) > max_bytes:
            raise PeerExchangeError(
                f"{what} of {len(data)} bytes is over the limit of {max_bytes}",
                reason="too_large",
            )
        self.bytes_served += len(data)
        return data

    async def fetch_package(
        self,
        endpoint: str,
        directive_id: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float,
        tokenizer_sha256: str | None = None,
    ) -> bytes:
        """The package offered for ``directive_id`` by ``endpoint``; ``refused`` (as the
        peer service's NOT_FOUND) when there is none from that teacher."""
        from peerlm.agent import PeerExchangeError

        held = self.packages.get(directive_id)
        if held is None or held[0] != endpoint or (expect is not None and expect != endpoint):
            raise PeerExchangeError(
                f"{endpoint!r} holds no package for directive {directive_id!r}", reason="refused"
            )
        return self._hand_out("package", held[1], max_bytes)

    async def pull_adapter(
        self,
        endpoint: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float | None,
    ) -> tuple[int, bytes]:
        """Client ``endpoint``'s own adapter now, as its peer service would stream it."""
        from peerlm.agent import PeerExchangeError

        client = self.clients.get(endpoint)
        if client is None or (expect is not None and expect != endpoint):
            raise PeerExchangeError(f"no client {endpoint!r} to pull from", reason="unavailable")
        data = (
            self.frozen[endpoint] if self.frozen is not None else client.host.encoded_adapter().data
        )
        return self.round_, self._hand_out("adapter", data, max_bytes)


@dataclass(frozen=True)
class Report:
    """What a student reported for one directive."""

    reward: float
    loss_pre: float
    loss_post: float
    failure: int
    normalised: float


@dataclass
class InProcessCpm:
    """The students' CPM: each report feeds ``policy`` (a refusal as ``refusal_reward``, as
    the CPM service's core learns it); one report per directive it issued."""

    policy: PairingPolicy | None
    refusal_reward: float
    pairings: dict[str, Pairing] = field(default_factory=dict)
    reports: dict[str, Report] = field(default_factory=dict)

    async def report_reward(
        self,
        directive_id: str,
        reward: float,
        *,
        loss_pre: float = 0.0,
        loss_post: float = 0.0,
        kilobytes: int = 0,
        failure: int = 0,
        space_mismatch: Sequence[str] = (),
    ) -> cpm_pb2.ReportRewardResponse:
        """Learn from the report; ``ValueError`` for a directive not issued or reported
        twice (a step that does that is a bug, not a peer's fault), and for a
        ``space_mismatch``: the experiment's clients declare the parameter space they hold
        and its policy pairs only admissible ones, so a sender's adapter of another space
        is the harness's bug, where the CPM service would store a disproof
        (:mod:`peerlm.services.cpm.core`)."""
        pairing = self.pairings.get(directive_id)
        if self.policy is None or pairing is None or directive_id in self.reports:
            raise ValueError(f"directive {directive_id!r} was not issued or is reported twice")
        if space_mismatch:
            raise ValueError(
                f"directive {directive_id!r}: senders {list(space_mismatch)} sent an adapter"
                " of another parameter space than the one the experiment paired them by"
            )
        normalised = float(self.policy.observe(pairing, self.refusal_reward if failure else reward))
        self.reports[directive_id] = Report(reward, loss_pre, loss_post, failure, normalised)
        return cpm_pb2.ReportRewardResponse(normalised_reward=normalised)


@dataclass
class ClientAgent:
    """One client as the protocols' :class:`~peerlm.agent.ExchangeContext` (module
    docstring). ``integrations``: what each integration call returned, in order."""

    world: World
    client: Client
    index: int
    seed: int
    t: int
    peers: InProcessPeers
    cpm: InProcessCpm
    s: AgentSettings
    ctx: NodeContext
    telemetry: AgentTelemetry
    summary: AgentSummary
    log: EventLog = field(default_factory=EventLog)
    integrations: list[Any] = field(default_factory=list)

    @property
    def host(self) -> ModelHost:
        """The client's model host."""
        return self.client.host

    @property
    def config(self) -> RoundConfig:
        """The client's round configuration for an integration."""
        return round_config(self.world.plan, self.seed, self.index, integration=True)

    @property
    def guardrail(self) -> Guardrail:
        """The client's guardrail."""
        return self.client.guardrail

    @property
    def transfer_prompts(self) -> list[str]:
        """X_u's prompts."""
        return self.world.transfer

    @property
    def transfer_digest(self) -> str:
        """X_u's SHA-256."""
        return self.world.transfer_sha256

    @property
    def train_examples(self) -> list[tuple[str, str]]:
        """The client's private training pairs."""
        return self.client.train_examples

    @property
    def val_examples(self) -> list[tuple[str, str]]:
        """Where the gate and Eq. 3 measure (module docstring)."""
        return reward_examples(self.world, self.client, self.index)

    @property
    def reward_examples(self) -> list[tuple[str, str]] | None:
        """None: Eq. 3 is measured on :attr:`val_examples` (module docstring)."""
        return None

    @property
    def reward_scope(self) -> Callable[[Sequence[str]], Sequence[tuple[str, str]]] | None:
        """``probe_scope: answered`` or ``routed``: the probe of a package's categories (as
        the daemon)."""
        return reward_scope(self.world, self.client)

    @property
    def public_pairs(self) -> list[tuple[str, str]]:
        """D_pub, OnePeFT's HKA pairs."""
        return self.world.public_pairs

    @property
    def slot_learns(self) -> Callable[[Sequence[str]], Sequence[bool]] | None:
        """What the peer slot distils of a package (``slot_scope``, as the daemon)."""
        return self.client.slot_learns(self.world.plan)

    async def run_model(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Inline: the experiment's process owns its hosts."""
        return fn(*args, **kwargs)

    def integrating(self, what: str) -> Callable[..., Any]:
        """The daemon's runner for an integration (the slot under ``separate``), keeping
        what each integration call returns."""
        from peerlm.agent import INTEGRATIONS, slot_runner

        base: Callable[..., Any] = (
            slot_runner(self.run_model, self.client.slot, self.host, what)
            if self.world.plan.integration == "separate"
            else self.run_model
        )

        async def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
            out: T = await base(fn, *args, **kwargs)
            if fn in INTEGRATIONS:
                self.integrations.append(out)
            return out

        return run

    def slot_integrated(self, kind: str) -> None:
        """Nothing: the client's slot counts its integrations itself."""

    def note_interrupted(self, interrupted: bool, t: int, what: str, steps: int) -> None:
        """Nothing: no stop grace cuts an experiment's training short."""

    def prebuild_predictions(self, directive: cpm_pb2.Directive) -> None:
        """The teacher's step: answer X_u and offer the package (text, or top-k logits for
        ``akd_logits``) for the student to fetch."""
        mode: Literal["text", "logits"] = (
            "logits" if lookup(directive.protocol).payload == "logits_package" else "text"
        )
        predictions = teacher_answers(self.world, self.client, self.t)
        data = teacher_package_bytes(
            self.world, self.client, predictions, directive.directive_id, mode
        )
        self.peers.offer(directive.directive_id, self.client.name, data)

    def expect_adapter_pull(self, student: str) -> None:
        """Nothing: the adapter is encoded when the student pulls it."""


@dataclass(frozen=True)
class Executed:
    """One directive's outcome: its exchange record (None when the student integrated
    nothing: refused, or a merge that changed nothing) and how many integration calls the
    student's step made, and how many of them took optimiser steps (an AKD package the
    peer slot learns nothing of takes none: :func:`~peerlm.agent.slot_learns`)."""

    record: dict[str, Any] | None
    integrations: int
    stepped: int


@dataclass
class InProcessFederation:
    """One round's directives among ``clients``, executed by the agent's protocols."""

    world: World
    clients: Sequence[Client]
    seed: int
    t: int
    cpm: InProcessCpm
    registry: ProtocolRegistry = field(init=False)
    peers: InProcessPeers = field(init=False)
    settings: AgentSettings = field(init=False)

    def __post_init__(self) -> None:
        from peerlm.agent import AgentSettings, agent_registry

        plan = self.world.plan
        self.registry = agent_registry()
        self.peers = InProcessPeers({c.name: c for c in self.clients}, self.t)
        # An agent's defaults (never the shell's PEERLM_AGENT_* variables), but: no merge
        # margin (the experiment measures, module docstring), Eq. 3's coefficients, the
        # length and HKA's steps of the plan's round configuration, every co-sender pulled.
        config = round_config(plan, self.seed, 0, integration=True)
        self.settings = explicit_settings(
            AgentSettings,
            {
                "acceptance_margin": None,
                "reward_gamma": config.reward_gamma,
                "reward_delta": config.reward_delta,
                "max_length": config.train.max_length,
                "overlay": {
                    "hka_steps": plan.integration_steps,
                    "k": max(explicit_settings(AgentSettings).overlay.k, plan.cpm_merge_senders),
                },
            },
        )

    def agent(self, client: Client) -> ClientAgent:
        """``client`` as an agent for this round's steps."""
        from peerlm.agent import AgentSummary, AgentTelemetry
        from peerlm.config import GrpcLimits
        from peerlm.node import NodeContext
        from peerlm.pki.identity import Role

        log = EventLog()
        ctx = NodeContext.create(
            component="agent",
            role=Role.AGENT,
            federation="experiment",
            tls=None,
            insecure_dev=True,
            limits=GrpcLimits(),
            log=log,
            dev_name=client.name,
        )
        return ClientAgent(
            world=self.world,
            client=client,
            index=list(self.clients).index(client),
            seed=self.seed,
            t=self.t,
            peers=self.peers,
            cpm=self.cpm,
            s=self.settings,
            ctx=ctx,
            telemetry=AgentTelemetry(ctx.registry),
            summary=AgentSummary(name=client.name, model=client.arch, family=client.host.family),
            log=log,
        )

    def pull(
        self,
        client: Client,
        candidates: Sequence[Candidate],
        settings: PullSettings,
        gate: AcceptanceGate | None,
        hka: tuple[Sequence[tuple[str, str]], Any] | None,
    ) -> PullReport:
        """``client``'s overlay pull of ``candidates`` (endpoint: the client's name) by the
        agent's :func:`~peerlm.agent.pull_and_aggregate`, into the slot under
        ``separate``."""
        import asyncio

        from peerlm.agent import pull_and_aggregate

        agent = self.agent(client)
        report: PullReport = asyncio.run(
            pull_and_aggregate(
                agent.ctx,
                client.host,
                candidates,
                settings=settings,
                run_model=agent.integrating("overlay"),
                round_=self.t,
                gate=gate,
                hka=hka,
                peers=self.peers,
            )
        )
        # A neighbour's fault is an outcome; the aggregate failing to load is the harness's.
        broken = [r for r in report.refused if r.reason in ("load", "error")]
        if broken:
            raise RuntimeError(f"{client.name}'s overlay pull failed: {broken}")
        return report

    def execute(self, pairing: Pairing, directive_id: str) -> Executed:
        """Run ``pairing`` as a directive: the teacher's step, then the student's.

        A refusal the student reports (a package or adapter its checks reject) is an
        outcome; a failure an agent keeps to itself (an internal error: nothing reported,
        :func:`~peerlm.agent.cpm.directives.refusal_failure`) is the harness's own and
        raises ``RuntimeError``, so that no run quietly loses exchanges. A merge that
        changed nothing (``not_integrated``) is an outcome too."""
        import asyncio

        from peerlm.agent import learnt_anything

        by_name = {c.name: c for c in self.clients}
        teacher, student = by_name[pairing.sender], by_name[pairing.receiver]
        d = cpm_pb2.Directive(
            directive_id=directive_id,
            teacher=teacher.name,
            student=student.name,
            protocol=pairing.protocol,
            peer=common_pb2.PeerAddress(name=teacher.name, endpoint=teacher.name),
            co_senders=[common_pb2.PeerAddress(name=c, endpoint=c) for c in pairing.co_senders],
        )
        protocol: ExchangeProtocol = self.registry.get_protocol(pairing.protocol)
        self.cpm.pairings[directive_id] = pairing
        protocol.teacher(self.agent(teacher), d, self.t)
        learner = self.agent(student)
        served = self.peers.bytes_served
        asyncio.run(protocol.student(learner, d, self.t))
        report = self.cpm.reports.get(directive_id)
        if report is None:
            failed = [f for _, event, f in learner.log.lines if event == "exchange_failed"]
            unchanged = [f for f in failed if str(f.get("error")).startswith("not_integrated")]
            if not failed or len(unchanged) != len(failed):
                raise RuntimeError(f"directive {directive_id} failed in the student: {failed}")
        integrated = len(learner.integrations)
        stepped = sum(1 for x in learner.integrations if learnt_anything(x))
        if report is None or report.failure or not integrated:
            return Executed(None, integrated, stepped)
        kilobytes = (self.peers.bytes_served - served) / 1024
        record: dict[str, Any] = {"teacher": teacher.name, "student": student.name}
        if protocol.entry.kind == "distillation":
            result = learner.integrations[-1]
            record |= {
                "mode": result.mode,
                "alpha_kd": round(result.alpha_kd, 4),
                "steps": result.stats.steps,
            }
        else:
            record |= {"co_senders": list(pairing.co_senders), "mode": pairing.protocol}
        return Executed(
            {
                **record,
                "loss_pre": round(report.loss_pre, 5),
                "loss_post": round(report.loss_post, 5),
                "kilobytes": round(kilobytes, 2),
                "reward": round(report.reward, 6),
                "normalised_reward": round(report.normalised, 5),
            },
            integrated,
            stepped,
        )
