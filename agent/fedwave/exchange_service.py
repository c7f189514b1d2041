"""The server side of ``peerlm.v1.FedWaveExchange``: a workflow agent's parts, streamed.

A thin transport over :mod:`~peerlm.agent.fedwave.exchange`: the caller's name comes from
its certificate (``current_identity()``, set by
:class:`~peerlm.security.authz.AuthInterceptor` under :data:`FEDWAVE_POLICY`), and
:func:`~peerlm.agent.fedwave.exchange.decide_pull` decides what it gets. A refusal answers
the decision's status with its message and counts in
``peerlm_agent_fedwave_refusals_total{rpc, reason}``: ``not_in_workflow``
(PERMISSION_DENIED), ``not_yet`` (UNAVAILABLE: the round is not published; the client
retries until its deadline), ``gone`` / ``no_part`` (NOT_FOUND), ``same_stage``
(PERMISSION_DENIED: an adapter asked for by an agent of our own stage), ``bad_kind``
(INVALID_ARGUMENT), ``too_large`` (RESOURCE_EXHAUSTED: a part over this agent's own bound).
A served part is streamed in chunks (:func:`~peerlm.chunks.iter_chunks`) after a sender
proof in the initial metadata (kind ``fedwave-router``, ``fedwave-vclayer`` or
``fedwave-adapter``, reference the round, as the peer service's adapters); bytes count in
``peerlm_agent_fedwave_bytes_sent_total{kind}``.

The parts are small (a router is tens of KiB, a VCLayer on the tiny models 130-200 KiB,
both bounded by ``fedwave.max_*_bytes``), but a workflow member that opens many pulls and
reads none would still make this agent hold every one of them. So the stream goes
through the peer port's :class:`~peerlm.agent.peer.stream.PeerStreamer`, under the send
budget shared with ``PeerExchange`` and FedProxy: one identity's share and one total, cut-offs
in ``peerlm_agent_peer_send_cutoffs_total{rpc="PullPart", reason}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NoReturn

import grpc
import structlog
from peerlm.agent.fedwave.exchange import (
    PartKind,
    PartStore,
    PullRefusal,
    decide_pull,
    part_content_type,
)
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.peer.stream import PeerStreamer
from prometheus_client import CollectorRegistry

from peerlm.chunks import iter_chunks
from peerlm.grpc_types import ServicerContext
from peerlm.metrics import get_counter
from peerlm.node import NodeContext, NodeServer, Service
from peerlm.pki.identity import Role
from peerlm.pki.proof import ProofSigner
from peerlm.security.authz import current_identity
from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc

__all__ = [
    "FEDWAVE_POLICY",
    "FEDWAVE_SERVICE_NAME",
    "FedWaveExchangeService",
    "fedwave_service",
    "proof_kind",
    "serve_fedwave",
]

FEDWAVE_SERVICE_NAME: Final = fedwave_pb2.DESCRIPTOR.services_by_name["FedWaveExchange"].full_name
_METHOD = f"/{FEDWAVE_SERVICE_NAME}/"

#: Which certificate roles may call which method (membership of the workflow is checked
#: per call on top). Anything not listed is denied.
FEDWAVE_POLICY: dict[str, frozenset[Role]] = {
    _METHOD + "PullPart": frozenset({Role.AGENT}),
    _METHOD + "DescribeWorkflow": frozenset({Role.AGENT, Role.ADMIN}),
}

_WIRE_KINDS: Final = {
    fedwave_pb2.PART_KIND_ROUTER: PartKind.ROUTER,
    fedwave_pb2.PART_KIND_VCLAYER: PartKind.VCLAYER,
    fedwave_pb2.PART_KIND_ADAPTER: PartKind.ADAPTER,
}


def proof_kind(kind: PartKind) -> str:
    """The ``kind`` of the sender proof over a part (:mod:`peerlm.pki.proof`)."""
    return f"fedwave-{kind.value}"


class FedWaveExchangeService(fedwave_pb2_grpc.FedWaveExchangeServicer):
    """Implements ``peerlm.v1.FedWaveExchange`` for agent ``me`` of ``workflow`` over the
    parts in ``store`` (the caller publishes into it each round).

    ``max_bytes`` (kind → bytes) bounds what is sent: a larger part is refused rather than
    streamed (the agent sets the same bounds it accepts). ``streamer``: the peer port's
    (module docstring); None: one of this service's own with the default send budget.
    """

    def __init__(
        self,
        workflow: Workflow,
        me: str,
        store: PartStore,
        *,
        chunk_bytes: int,
        registry: CollectorRegistry,
        max_bytes: Mapping[PartKind, int] | None = None,
        signer: ProofSigner | None = None,
        log: Any = None,
        streamer: PeerStreamer | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._workflow = workflow
        self._me = me
        self._stage = workflow.stage_of(me).name  # KeyError: we are not in it
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._max = dict(max_bytes or {})
        self._signer = signer
        self._log: Any = log if log is not None else structlog.get_logger("peerlm.agent.fedwave")
        self._streamer = streamer if streamer is not None else PeerStreamer(registry, log=log)
        self._refusals = get_counter(
            registry,
            "peerlm_agent_fedwave_refusals_total",
            "FedWaveExchange requests refused (caller not in the workflow, round not "
            "published or no longer kept, bad request, part over the bound)",
            ("rpc", "reason"),
        )
        # The last round this agent concluded; None until its checkpoint (if any) is loaded.
        self._concluded: int | None = None
        # The round it plays; None until it has decided (restarted agents agree first).
        self._playing: int | None = None
        # Distinct callers served each (round, kind): the agent lingers after its last round
        # until its neighbours have their parts (bounded by the round's deadline).
        self._served: dict[tuple[int, PartKind], set[str]] = {}
        self._sent = get_counter(
            registry,
            "peerlm_agent_fedwave_bytes_sent_total",
            "FedWave part bytes streamed to the workflow's agents",
            ("kind",),
        )

    def served(self, round_: int, kind: PartKind) -> frozenset[str]:
        """The callers that were streamed this agent's ``kind`` of ``round_``."""
        return frozenset(self._served.get((round_, kind), ()))

    def set_concluded(self, round_: int) -> None:
        """Say (in ``DescribeWorkflow``) that this agent's state is that of the end of
        ``round_`` (0: a fresh start); until it is said, agents restarted together wait."""
        if round_ < 0:
            raise ValueError(f"round must be >= 0, got {round_}")
        self._concluded = round_

    def set_playing(self, round_: int) -> None:
        """Say (in ``DescribeWorkflow``) that this agent has decided to play ``round_``
        (and is playing it): an agent that restarts later joins that round."""
        if round_ < 1:
            raise ValueError(f"round must be >= 1, got {round_}")
        self._playing = round_

    @property
    def store(self) -> PartStore:
        """The parts served (publish each round's here)."""
        return self._store

    # A ``context.write`` handler (so a write that does not finish can be seen), which the
    # generated stub's return type does not list.
    async def PullPart(  # type: ignore[override]
        self, request: fedwave_pb2.PullPartRequest, context: ServicerContext
    ) -> None:
        rpc, caller = "PullPart", current_identity().name
        round_ = int(request.round)
        kind = _WIRE_KINDS.get(request.kind)
        decision = decide_pull(self._workflow, caller, self._store, round_, kind, me=self._me)
        if isinstance(decision, PullRefusal):
            await self._refuse(context, rpc, decision, caller, round_)
        assert kind is not None  # decide_pull refuses an unknown kind
        limit = self._max.get(kind)
        if limit is not None and len(decision.data) > limit:
            await self._refuse(
                context,
                rpc,
                PullRefusal(
                    "RESOURCE_EXHAUSTED",
                    "too_large",
                    f"this agent's {kind} of {len(decision.data)} bytes exceeds its bound "
                    f"of {limit}",
                ),
                caller,
                round_,
            )
        content_type = part_content_type(kind, round_)
        await self._streamer.stream(
            context,
            rpc=rpc,
            caller=caller,
            payload=decision,
            chunks=iter_chunks(decision, self._chunk_bytes, content_type),
            chunk_bytes=self._chunk_bytes,
            signer=self._signer,
            proof=(proof_kind(kind), str(round_)),
            sent=self._sent.labels(kind.value),
        )
        served = self._served.setdefault((round_, kind), set())
        served.add(caller)
        for key in [k for k in self._served if k[0] < round_ - 2]:
            del self._served[key]  # bounded: the store keeps the newest rounds only
        self._log.info(
            "fedwave_part_sent",
            round=round_,
            kind=kind.value,
            peer=caller,
            bytes=len(decision.data),
        )

    async def DescribeWorkflow(
        self, request: fedwave_pb2.DescribeWorkflowRequest, context: ServicerContext
    ) -> fedwave_pb2.WorkflowDescription:
        identity = current_identity()
        if identity.role is not Role.ADMIN and identity.name not in self._workflow.agents:
            refusal = PullRefusal(
                "PERMISSION_DENIED", "not_in_workflow", f"{identity.name!r} is not in this workflow"
            )
            await self._refuse(context, "DescribeWorkflow", refusal, identity.name, None)
        return fedwave_pb2.WorkflowDescription(
            stages=[
                fedwave_pb2.WorkflowStage(name=s.name, agents=list(s.agents))
                for s in self._workflow.stages
            ],
            agent=self._me,
            stage=self._stage,
            rounds=list(self._store.rounds),
            concluded_round=self._concluded,
            playing_round=self._playing,
        )

    async def _refuse(
        self,
        context: ServicerContext,
        rpc: str,
        refusal: PullRefusal,
        caller: str,
        round_: int | None,
    ) -> NoReturn:
        self._refusals.labels(rpc, refusal.reason).inc()
        # A pull before the round is published is routine (the client retries): debug.
        level = self._log.debug if refusal.reason == "not_yet" else self._log.warning
        level(
            "fedwave_request_refused",
            rpc=rpc,
            reason=refusal.reason,
            code=refusal.status,
            peer=caller,
            round=round_,
            detail=refusal.message,
        )
        await context.abort(grpc.StatusCode[refusal.status], refusal.message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover


def fedwave_service(service: FedWaveExchangeService) -> Service:
    """``service`` as a :class:`~peerlm.node.Service` to add to a node's server (with
    :data:`FEDWAVE_POLICY` in the server's policy)."""
    return Service(
        FEDWAVE_SERVICE_NAME, service, fedwave_pb2_grpc.add_FedWaveExchangeServicer_to_server
    )


async def serve_fedwave(
    ctx: NodeContext, service: FedWaveExchangeService, *, listen: str
) -> NodeServer:
    """Build, bind and start a server with the FedWave service alone on ``ctx``
    (:meth:`NodeContext.serve`); health reports SERVING. The caller stops it."""
    server = await ctx.serve([fedwave_service(service)], FEDWAVE_POLICY, listen=listen)
    await server.serving(True)
    ctx.log.info(
        "fedwave_server_started",
        listen=listen.rsplit(":", 1)[0] + f":{server.port}",
        security_mode=ctx.mode.value,
    )
    return server
