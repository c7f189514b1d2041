"""One interface for the knowledge-exchange protocols an agent executes, and their registry.

Each protocol of the kernel's catalogue (:mod:`peerlm.protocols`) that this agent executes
is one :class:`ExchangeProtocol`: its catalogue entry, the **student's step** (fetch or pull
what the teacher offers, integrate it behind the acceptance gate, report Eq. 3 to the CPM)
and the **teacher's step** (prepare what the student will fetch). The daemon dispatches a
directive to the protocol registered under the directive's name
(:class:`ProtocolRegistry`), and hands it one :class:`ExchangeContext`: the model executor,
the agent's data and round configuration, the reporter to the CPM, its node context for
peer calls, telemetry and summary. A protocol module holds everything its exchange does;
the daemon keeps only what every protocol shares (the round loop, the refusal of a
directive it cannot execute, the linger after the last round).

The reporting helpers here (:func:`report_reward`, :func:`report_refusal`,
:func:`exchange_failed`, :func:`log_exchange`) are what every student step ends with, so
each protocol reports, counts and logs the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from peerlm.protocols import ProtocolEntry, lookup
from peerlm.wire.v1 import cpm_pb2

if TYPE_CHECKING:
    from peerlm.agent.daemon import AgentSummary
    from peerlm.agent.exchange.rounds import RoundConfig
    from peerlm.agent.metrics import AgentTelemetry
    from peerlm.agent.modelhost import ModelHost
    from peerlm.agent.peer.transport import PeerTransport
    from peerlm.agent.settings import AgentSettings

    from peerlm.node import NodeContext

__all__ = [
    "CpmReporter",
    "ExchangeContext",
    "ExchangeProtocol",
    "ProtocolRegistry",
    "exchange_failed",
    "log_exchange",
    "report_refusal",
    "report_reward",
]

T = TypeVar("T")
#: Runs a model call on the agent's model thread (or the peer slot's runner).
ModelRunner = Callable[..., Awaitable[Any]]


class CpmReporter(Protocol):
    """What a student's step calls of the CPM (:class:`~peerlm.agent.cpm.client.CpmClient`
    is one): report a directive's Eq. 3 reward, or its refusal (``failure``)."""

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
        """Report it; raises ``grpc.aio.AioRpcError`` when the CPM refuses it."""
        ...


class ExchangeContext(Protocol):
    """What a protocol's steps may use of the agent that hosts them (the daemon is one).

    Attributes are read when a step runs, never cached: the agent's model and data are
    those of the moment the directive is executed."""

    @property
    def s(self) -> AgentSettings:
        """The agent's settings."""

    @property
    def ctx(self) -> NodeContext:
        """The node context: peer channels (mTLS), metrics registry, logger, name."""

    @property
    def peers(self) -> PeerTransport:
        """How the student fetches a package or pulls an adapter from a directive's peers
        (the daemon: the peer service over ``ctx``'s mTLS channels)."""

    @property
    def cpm(self) -> CpmReporter:
        """Where the student reports Eq. 3 or its refusal (the daemon: its CPM client)."""

    @property
    def log(self) -> Any:
        """The agent's logger."""

    @property
    def telemetry(self) -> AgentTelemetry:
        """The agent's metrics."""

    @property
    def summary(self) -> AgentSummary:
        """What the agent did, printed when it ends."""

    @property
    def host(self) -> ModelHost:
        """The model host (read on the model thread only: see :meth:`run_model`)."""

    @property
    def config(self) -> RoundConfig:
        """The round configuration (schedules, Eq. 3 coefficients)."""

    @property
    def guardrail(self) -> Any:
        """The agent's input guardrail, which a package's texts pass before learning."""

    @property
    def transfer_prompts(self) -> list[str]:
        """The public transfer set X_u's prompts."""

    @property
    def transfer_digest(self) -> str:
        """X_u's pinned SHA-256."""

    @property
    def train_examples(self) -> list[tuple[str, str]]:
        """The agent's private training pairs."""

    @property
    def val_examples(self) -> list[tuple[str, str]]:
        """The held-out pairs the acceptance gate measures on."""

    @property
    def reward_examples(self) -> list[tuple[str, str]] | None:
        """Where Eq. 3's losses are measured when not on ``val_examples``."""

    @property
    def reward_scope(self) -> Callable[[Sequence[str]], Sequence[tuple[str, str]]] | None:
        """With ``reward_scope: answered``, the probe problems of the categories a package's
        prompts belong to (:class:`~peerlm.agent.exchange.reward_probe.AnsweredProbe`): where
        an AKD package's reward is measured; None: on :attr:`reward_examples` whole."""

    @property
    def public_pairs(self) -> list[tuple[str, str]]:
        """Public (prompt, completion) pairs, D_pub of OnePeFT's HKA."""

    @property
    def slot_learns(self) -> Callable[[Sequence[str]], Sequence[bool]] | None:
        """Which of a package's prompts the peer slot learns (every one, or with
        ``slot_scope: routed`` the router's peer side); None without a slot: the one
        adapter, which falls back to an own-data step when a package teaches nothing."""

    async def run_model(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the model thread."""
        ...

    def integrating(self, what: str) -> ModelRunner:
        """How an integration's model calls run (peer slot or the one adapter)."""
        ...

    def slot_integrated(self, kind: str) -> None:
        """Count the peer slot's integrations since the last call, labelled ``kind``."""
        ...

    def note_interrupted(self, interrupted: bool, t: int, what: str, steps: int) -> None:
        """Record a training call the stop grace cut short."""
        ...

    def prebuild_predictions(self, directive: cpm_pb2.Directive) -> None:
        """As teacher: generate the predictions of ``directive``'s package now, ahead of
        the next round's training, and wait for the student's fetch when lingering."""
        ...

    def expect_adapter_pull(self, student: str) -> None:
        """As teacher: the linger after the last round waits for one more adapter pull by
        ``student``."""
        ...


class ExchangeProtocol(ABC):
    """One knowledge-exchange protocol as the agent executes it (module docstring)."""

    def __init__(self, entry: ProtocolEntry) -> None:
        self.entry = entry

    @property
    def name(self) -> str:
        """The catalogue name, ``Directive.protocol`` on the wire."""
        return self.entry.name

    @abstractmethod
    async def student(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """The student's step for directive ``d`` in round ``t``: fetch or pull, integrate,
        report Eq. 3 (or the refusal). Never raises for a failed exchange: it is counted,
        logged and reported."""

    @abstractmethod
    def teacher(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """The teacher's step for directive ``d``: prepare what the student will fetch."""


class ProtocolRegistry(Mapping[str, ExchangeProtocol]):
    """The protocols this agent can execute, by catalogue name (immutable once built).

    Every protocol must be a catalogue entry and be registered once; :meth:`get_protocol`
    raises :class:`~peerlm.protocols.UnknownProtocolError` for a name the catalogue does
    not hold and ``KeyError`` for one it holds but no module implements."""

    def __init__(self, protocols: Iterable[ExchangeProtocol]) -> None:
        table: dict[str, ExchangeProtocol] = {}
        for protocol in protocols:
            if lookup(protocol.name) is not protocol.entry:
                raise ValueError(f"{protocol.name!r} is registered with another entry")
            if protocol.name in table:
                raise ValueError(f"protocol {protocol.name!r} registered twice")
            table[protocol.name] = protocol
        self._table = MappingProxyType(table)

    def __getitem__(self, name: str) -> ExchangeProtocol:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def get_protocol(self, name: str) -> ExchangeProtocol:
        """The protocol registered as ``name`` (see the class docstring for errors)."""
        lookup(name)
        try:
            return self._table[name]
        except KeyError:
            raise KeyError(f"protocol {name!r} has no implementation in this agent") from None


def log_exchange(
    emit: Callable[..., Any],
    event: str,
    d: cpm_pb2.Directive,
    t: int,
    loss_pre: float,
    loss_post: float,
    reward: float,
    **extra: Any,
) -> None:
    """One line for a student's exchange: rolled back or integrated, AKD or merge."""
    emit(
        event,
        round=t,
        teacher=d.teacher,
        directive=d.directive_id,
        protocol=d.protocol,
        loss_pre=round(loss_pre, 4),
        loss_post=round(loss_post, 4),
        reward=round(reward, 5),
        **extra,
    )


async def report_reward(
    ctx: ExchangeContext,
    d: cpm_pb2.Directive,
    reward: float,
    loss_pre: float,
    loss_post: float,
    kb: float,
    *,
    space_mismatch: Sequence[str] = (),
) -> cpm_pb2.ReportRewardResponse | None:
    """Report Eq. 3 for a directive, naming the senders whose adapter proved to be of
    another parameter space (``space_mismatch``); None (logged, counted) when the CPM
    refuses it."""
    try:
        ack = await ctx.cpm.report_reward(
            d.directive_id,
            reward,
            loss_pre=loss_pre,
            loss_post=loss_post,
            kilobytes=round(kb),
            space_mismatch=space_mismatch,
        )
    except grpc.aio.AioRpcError as err:
        # The knowledge is integrated either way; only the CPM's bandit misses this one.
        ctx.telemetry.exchange_failures.labels("reward_refused").inc()
        ctx.log.warning(
            "reward_refused",
            directive=d.directive_id,
            code=err.code().name,
            detail=err.details(),
        )
        ctx.summary.errors.append(f"reward {d.directive_id[:8]}: {err.code().name}")
        return None
    ctx.telemetry.rewards.inc()
    return ack


async def report_refusal(
    ctx: ExchangeContext,
    d: cpm_pb2.Directive,
    reason: str,
    space_mismatch: Sequence[str] | None = None,
) -> None:
    """Tell the CPM the student refused ``d`` for ``reason``
    (:func:`~peerlm.agent.cpm.directives.refusal_failure`), so that its bandit learns the
    tuple was bad; nothing for a reason that is this agent's own trouble.

    ``space_mismatch``: the senders whose adapter proved to be of another parameter
    space (a merge's own finding); by default the teacher when ``reason`` says its
    package or adapter was (:func:`~peerlm.agent.cpm.directives.space_mismatches`)."""
    from peerlm.agent.cpm.directives import refusal_failure, space_mismatches

    failure = refusal_failure(reason)
    if failure == cpm_pb2.EXCHANGE_FAILURE_UNSPECIFIED:
        return
    if space_mismatch is None:
        space_mismatch = space_mismatches([(d.teacher, reason)])
    try:
        await ctx.cpm.report_reward(
            d.directive_id, 0.0, failure=failure, space_mismatch=space_mismatch
        )
    except grpc.aio.AioRpcError as err:
        ctx.telemetry.exchange_failures.labels("reward_refused").inc()
        ctx.log.warning(
            "refusal_not_reported",
            directive=d.directive_id,
            code=err.code().name,
            detail=err.details(),
        )
        return
    ctx.log.info(
        "refusal_reported",
        directive=d.directive_id,
        teacher=d.teacher,
        reason=reason,
        failure=cpm_pb2.ExchangeFailure.Name(failure),
        space_mismatch=list(space_mismatch),
    )


def exchange_failed(
    ctx: ExchangeContext, d: cpm_pb2.Directive, reason: str, exc: BaseException
) -> None:
    """Count, log and remember a failed exchange (``peerlm_agent_exchange_failures_total``)."""
    ctx.telemetry.exchange_failures.labels(reason).inc()
    ctx.log.warning(
        "exchange_failed",
        directive=d.directive_id,
        teacher=d.teacher,
        reason=reason,
        error=str(exc),
    )
    ctx.summary.errors.append(f"exchange {d.directive_id[:8]}: {exc}")
