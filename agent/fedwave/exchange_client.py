"""The client side of ``peerlm.v1.FedWaveExchange``: one round's pulls under a deadline,
and the router aggregate (Eq. 9) over what arrived.

:func:`pull_part` pulls one part from one workflow agent over a channel from
:meth:`~peerlm.node.NodeContext.dial` that must prove to be that agent (the sender proof of
the peer service, kind ``fedwave-router`` / ``fedwave-vclayer``), retrying while the peer
says the round is not published yet (UNAVAILABLE) or cannot be reached, until the time
left. The chunks are assembled by the peer service's receiver
(:func:`~peerlm.agent.peer.client.receive_chunks`): an announced size over the bound is
refused at the first chunk.

:func:`pull_round` runs every pull the round needs
(:func:`~peerlm.agent.fedwave.exchange.plan_pulls`) concurrently under
``fedwave.round_deadline_s`` and goes on with what arrived: a part not there by the
deadline is *missing* (``late``; or ``unavailable``, ``refused``, ``no_endpoint``, ``error``
when the pull ended earlier), counted in
``peerlm_agent_fedwave_missing_parts_total{kind, reason}``; a part that arrived but does not
fit (:func:`~peerlm.agent.fedwave.exchange.accept_part`: wrong shape, NaN/inf, oversized,
wrong round or stage, a sender not in the workflow or not proving to be the agent asked, a
corrupt stream)
is *rejected*, counted in ``peerlm_agent_fedwave_rejected_parts_total{kind, reason}``, and
never used. Nothing of a round changes this agent's state until the caller applies it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.exchange import (
    PartKind,
    PullTarget,
    RoundParts,
    ShapeBounds,
    accept_part,
    aggregate_routers,
    parse_part_content_type,
    plan_pulls,
)
from peerlm.agent.fedwave.exchange_service import proof_kind
from peerlm.agent.fedwave.resume import PeerPosition
from peerlm.agent.fedwave.settings import DEFAULT_MAX_ROUTER_WEIGHT_RATIO, RouterRule
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.peer.client import PeerExchangeError, receive_chunks
from prometheus_client import Gauge

from peerlm.metrics import get_collector
from peerlm.node import NodeContext
from peerlm.pki.proof import ProofError
from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc

__all__ = [
    "aggregate_round_routers",
    "pull_part",
    "pull_round",
    "record_router_aggregate",
    "workflow_positions",
]

_WIRE_KINDS = {
    PartKind.ROUTER: fedwave_pb2.PART_KIND_ROUTER,
    PartKind.VCLAYER: fedwave_pb2.PART_KIND_VCLAYER,
    PartKind.ADAPTER: fedwave_pb2.PART_KIND_ADAPTER,
}
#: Pause between tries while a peer has not published the round (or is not up yet).
DEFAULT_RETRY_S = 0.2
#: Reasons of a pull that arrived and was refused here (the others are "missing").
_REJECTED = frozenset({"unverified_sender", "corrupt", "too_large"})


async def pull_part(
    ctx: NodeContext,
    target: str,
    agent: str,
    round_: int,
    kind: PartKind,
    *,
    max_bytes: int,
    timeout_s: float,
    retry_s: float = DEFAULT_RETRY_S,
) -> bytes:
    """``agent``'s ``kind`` blob of ``round_`` from its server at ``target``, verified as
    sent by ``agent`` (under mTLS). Retries while the round is not published or the peer
    is unreachable, for at most ``timeout_s`` in all; ``PeerExchangeError`` otherwise
    (``timeout`` when the time ran out)."""
    counter = ctx.counter(
        "peerlm_agent_fedwave_bytes_received_total",
        "FedWave part bytes pulled from the workflow's agents",
        ("kind",),
    ).labels(kind.value)
    deadline = time.monotonic() + timeout_s
    last: PeerExchangeError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            detail = f": {last}" if last is not None else ""
            raise PeerExchangeError(
                f"{kind} of round {round_} from {agent!r} did not arrive in {timeout_s:g} s"
                + detail,
                reason="timeout",
            )
        try:
            return await _pull_once(ctx, target, agent, round_, kind, max_bytes, left, counter)
        except PeerExchangeError as err:
            if err.reason != "unavailable":
                raise
            last = err
        await asyncio.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))


async def _pull_once(
    ctx: NodeContext,
    target: str,
    agent: str,
    round_: int,
    kind: PartKind,
    max_bytes: int,
    timeout_s: float,
    counter: Any,
) -> bytes:
    async with ctx.dial(target, expect=agent) as peer:
        stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        call = stub.PullPart(
            fedwave_pb2.PullPartRequest(round=round_, kind=_WIRE_KINDS[kind]),
            timeout=timeout_s,
            metadata=peer.metadata,
        )
        payload, digest, content_type, metadata = await receive_chunks(
            call, max_bytes, counter, ctx.tls_failures, what=f"fedwave {kind}"
        )
    try:
        sent = parse_part_content_type(content_type)
    except ValueError as err:
        raise PeerExchangeError(str(err), reason="corrupt") from None
    if sent != (kind, round_):
        raise PeerExchangeError(
            f"asked for the {kind} of round {round_}, got the {sent[0]} of round {sent[1]}",
            reason="corrupt",
        )
    if peer.expected is not None:
        try:
            peer.expected.verify_digest(metadata, proof_kind(kind), str(round_), digest)
        except ProofError as err:
            raise PeerExchangeError(
                f"{kind} from {agent!r} refused: {err} ({err.reason})", reason="unverified_sender"
            ) from None
    return payload


async def pull_round(
    ctx: NodeContext,
    workflow: Workflow,
    me: str,
    round_: int,
    endpoints: Mapping[str, str],
    bounds: ShapeBounds,
    *,
    deadline_s: float,
    targets: Sequence[PullTarget] | None = None,
    retry_s: float = DEFAULT_RETRY_S,
) -> RoundParts:
    """Pull ``round_``'s parts that agent ``me`` needs (``targets``, default
    :func:`plan_pulls`) from the agents' servers (``endpoints``: agent name → HOST:PORT),
    concurrently, for at most ``deadline_s``; the accepted parts and, per target, why one
    is missing or was rejected (module docstring)."""
    missing = ctx.counter(
        "peerlm_agent_fedwave_missing_parts_total",
        "FedWave parts of a round that did not arrive by the round's deadline or whose pull "
        "failed (the round goes on without them)",
        ("kind", "reason"),
    )
    rejected = ctx.counter(
        "peerlm_agent_fedwave_rejected_parts_total",
        "FedWave parts refused on arrival (sender not in the workflow or not proved, shape, "
        "non-finite, oversized, wrong round or stage); never used",
        ("kind", "reason"),
    )
    plan = list(targets) if targets is not None else plan_pulls(workflow, me)
    parts = RoundParts(round_)
    tasks: dict[asyncio.Task[bytes], PullTarget] = {}
    for target in plan:
        if target.agent not in workflow.agents:
            # Never dialled: only the workflow's agents are asked for parts.
            parts.rejected[target] = "not_in_workflow"
        elif target.agent not in endpoints:
            parts.missing[target] = "no_endpoint"
        else:
            task = asyncio.create_task(
                pull_part(
                    ctx,
                    endpoints[target.agent],
                    target.agent,
                    round_,
                    target.kind,
                    max_bytes=bounds.max_bytes(target.kind),
                    timeout_s=deadline_s,
                    retry_s=retry_s,
                )
            )
            tasks[task] = target
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
            parts.missing[tasks[task]] = "late"
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            target = tasks[task]
            err = task.exception()
            if isinstance(err, PeerExchangeError):
                reason = "late" if err.reason == "timeout" else err.reason
                where = parts.rejected if reason in _REJECTED else parts.missing
                where[target] = reason
                continue
            if err is not None:
                # Not a transfer failure (a dial refused by the security mode, a bug): the
                # round goes on without the part, and the log line says what it was.
                ctx.log.error(
                    "fedwave_pull_failed", round=round_, peer=target.agent, error=repr(err)
                )
                parts.missing[target] = "error"
                continue
            try:
                parts.add(
                    accept_part(workflow, target.agent, target.kind, round_, task.result(), bounds)
                )
            except FedWaveError as refusal:
                parts.rejected[target] = refusal.reason
    for target, reason in parts.missing.items():
        missing.labels(target.kind.value, reason).inc()
    for target, reason in parts.rejected.items():
        rejected.labels(target.kind.value, reason).inc()
    if parts.missing or parts.rejected:
        ctx.log.warning(
            "fedwave_round_incomplete",
            round=round_,
            missing={f"{t.agent}/{t.kind}": r for t, r in sorted(parts.missing.items())},
            rejected={f"{t.agent}/{t.kind}": r for t, r in sorted(parts.rejected.items())},
        )
    ctx.log.info(
        "fedwave_round_pulled",
        round=round_,
        routers=sorted(parts.routers),
        vclayers=sorted(parts.vclayers),
        missing=len(parts.missing),
        rejected=len(parts.rejected),
    )
    return parts


async def workflow_positions(
    ctx: NodeContext,
    endpoints: Mapping[str, str],
    *,
    wait_s: float,
    poll_s: float = 0.5,
    ask_timeout_s: float = 10.0,
) -> dict[str, PeerPosition]:
    """Each agent's position at ``endpoints`` (agent name → HOST:PORT): its newest published
    round, its last concluded round and the round it plays (``DescribeWorkflow``, the
    channel proving it is that agent). Asked concurrently and again every ``poll_s`` until
    every agent's answer is settled (running, or its checkpoint loaded), some agent is
    running (the workflow's round is then known: nobody else is waited for), or ``wait_s``
    has passed; an agent that never answered is left out, one that answered keeps its last
    answer. A restarted expert uses it to find the round to resume at
    (:mod:`~peerlm.agent.fedwave.resume`)."""

    async def ask(agent: str, target: str, timeout_s: float) -> PeerPosition | None:
        async with ctx.dial(target, expect=agent) as peer:
            stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
            reply = await stub.DescribeWorkflow(
                fedwave_pb2.DescribeWorkflowRequest(), timeout=timeout_s, metadata=peer.metadata
            )
        if reply.agent != agent:
            return None  # the certificate proved it; a reply naming another is not used
        return PeerPosition(
            published=max(reply.rounds) if reply.rounds else None,
            concluded=reply.concluded_round if reply.HasField("concluded_round") else None,
            playing=reply.playing_round if reply.HasField("playing_round") else None,
        )

    out: dict[str, PeerPosition] = {}
    deadline = time.monotonic() + wait_s
    while True:
        pending = sorted(a for a in endpoints if a not in out or not out[a].settled)
        if not pending or any(p.running for p in out.values()):
            return out
        left = deadline - time.monotonic()
        timeout_s = max(0.1, min(ask_timeout_s, left))
        answers = await asyncio.gather(
            *(ask(a, endpoints[a], timeout_s) for a in pending), return_exceptions=True
        )
        for agent, answer in zip(pending, answers, strict=True):
            if isinstance(answer, PeerPosition):
                out[agent] = answer
            elif isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # cancellation
        if time.monotonic() + poll_s >= deadline:
            return out
        await asyncio.sleep(poll_s)


def aggregate_round_routers(
    ctx: NodeContext,
    workflow: Workflow,
    own: Mapping[str, Any],
    own_samples: int,
    parts: RoundParts,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    max_weight_ratio: float | None = DEFAULT_MAX_ROUTER_WEIGHT_RATIO,
    rule: RouterRule = "median",
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The router aggregate over this agent's router and the routers ``parts`` brought
    (``rule``: the stage-wise coordinate-wise median, or Eq. 9 with each claimed ``n_i``
    capped by :func:`~peerlm.agent.fedwave.exchange.router_weights`): (the aggregate, the
    agents taken). Counted in ``peerlm_agent_fedwave_router_aggregations_total``
    (``complete``: every agent of the workflow; ``partial``: some missing) and
    ``peerlm_agent_fedwave_router_members_count`` (agents in the last aggregate)."""
    merged, members = aggregate_routers(
        ctx.name,
        own,
        own_samples,
        parts.routers,
        shapes,
        max_weight_ratio=max_weight_ratio,
        rule=rule,
        stages={a: workflow.stage_of(a).name for a in [ctx.name, *parts.routers]},
    )
    record_router_aggregate(ctx, workflow, members, parts.round)
    return merged, members


def record_router_aggregate(
    ctx: NodeContext, workflow: Workflow, members: Sequence[str], round_: int
) -> str:
    """Count one router aggregate of ``round_`` over ``members`` and log it: the outcome,
    ``complete`` (every workflow agent) or ``partial`` (some missing at the deadline)."""
    outcome = "complete" if set(members) == set(workflow.agents) else "partial"
    ctx.counter(
        "peerlm_agent_fedwave_router_aggregations_total",
        "FedWave router aggregations (Eq. 9): complete (every workflow agent's router) or "
        "partial (some missing at the deadline)",
        ("outcome",),
    ).labels(outcome).inc()
    get_collector(
        Gauge,
        ctx.registry,
        "peerlm_agent_fedwave_router_members_count",
        "Agents whose routers the last FedWave router aggregate averaged (this one included)",
    ).set(len(members))
    ctx.log.info("fedwave_router_aggregated", round=round_, outcome=outcome, members=list(members))
    return outcome
