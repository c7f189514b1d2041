"""The transport of FedProxy's cohort: ``peerlm.v1.ProxyExchange`` server and client.

Thin: the rounds' rules are :mod:`peerlm.agent.fedproxy.rounds`'s, the payloads
:mod:`peerlm.agent.fedproxy.codec`'s; the chunked, checksummed streaming and the sender proof
are the peer service's (:func:`~peerlm.chunks.iter_chunks`,
:func:`~peerlm.agent.peer.client.receive_chunks`, :mod:`peerlm.pki.proof`), and the server is
assembled by :meth:`~peerlm.node.NodeContext.serve` (or added to the agent's peer server as
one more :class:`~peerlm.node.Service`).

Admission is by certificate name (``current_identity()``), per method and per object:

* ``PullProxy`` is answered only by an owner (a :class:`RoundBoard` of proxies), and only to
  the members of its cohort;
* ``PullUpdate`` only by a member (a board of its trained proxies), and only to its owner.

Anyone else gets PERMISSION_DENIED. A member may pull one round's proxy at most
``max_pulls_per_round`` times (retries included; ``fedproxy.max_pulls_per_round``): one more
is RESOURCE_EXHAUSTED (``pull_limit``), so an admitted member cannot make its owner stream
the proxy without end. A request for round 0 of an update is INVALID_ARGUMENT;
a round that does not exist NOT_FOUND; the next round is waited for up to the call's
deadline (at most ``max_wait_s``), then UNAVAILABLE (``not_ready``: ask again). Each refusal
counts in ``peerlm_agent_fedproxy_refusals_total{rpc, reason}`` and is logged with the peer.

Payloads are streamed through the peer port's :class:`~peerlm.agent.peer.stream.PeerStreamer`
(sender proof, then every chunk under the send budget shared with ``PeerExchange`` and
FedWave on the same port): an admitted member is not trusted to read, so a member whose
streams stall holds at most its identity's share of the budget, and is cut off
(``peerlm_agent_peer_send_cutoffs_total{rpc="PullProxy"|"PullUpdate", reason}``,
RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED) while the other members are served. Its calls in
flight are bounded per identity by the server (``limits.max_calls_per_identity``), as on
every service of the port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any, Final, NoReturn

import grpc
import structlog
from peerlm.agent.fedproxy.codec import (
    PROXY_CONTENT_TYPE,
    UPDATE_CONTENT_TYPE,
    parse_round,
    payload_content_type,
)
from peerlm.agent.fedproxy.proxy import ProxyError
from peerlm.agent.fedproxy.rounds import RoundAnswer, round_answer
from peerlm.agent.peer.client import PeerExchangeError, check_sender, receive_chunks
from peerlm.agent.peer.stream import PeerStreamer
from prometheus_client import CollectorRegistry

from peerlm.chunks import HashedPayload, iter_chunks
from peerlm.grpc_types import ServicerContext
from peerlm.metrics import get_counter
from peerlm.node import NodeContext, NodeServer, Service
from peerlm.pki.identity import Role
from peerlm.pki.proof import ProofSigner
from peerlm.security.authz import current_identity
from peerlm.wire.v1 import common_pb2, fedproxy_pb2, fedproxy_pb2_grpc

__all__ = [
    "FEDPROXY_POLICY",
    "FEDPROXY_SERVICE_NAME",
    "PROXY_PROOF",
    "UPDATE_PROOF",
    "ProxyExchangeService",
    "RoundBoard",
    "fedproxy_service",
    "pull_proxy",
    "pull_update",
    "serve_fedproxy",
]

FEDPROXY_SERVICE_NAME: Final = fedproxy_pb2.DESCRIPTOR.services_by_name["ProxyExchange"].full_name
_METHOD = f"/{FEDPROXY_SERVICE_NAME}/"

#: Which certificate roles may call which method (the per-name admission is the service's).
FEDPROXY_POLICY: dict[str, frozenset[Role]] = {
    _METHOD + "PullProxy": frozenset({Role.AGENT}),
    _METHOD + "PullUpdate": frozenset({Role.AGENT}),
}

#: Sender-proof kinds (the statement names what is sent; the reference is the round).
PROXY_PROOF: Final = "fedproxy-proxy"
UPDATE_PROOF: Final = "fedproxy-update"


class RoundBoard:
    """The payload of the current round, and the readers waiting for a later one.

    ``horizon``: how many rounds ahead a reader may wait (None: any), see
    :func:`~peerlm.agent.fedproxy.rounds.round_answer`. Only the current round is kept.
    """

    def __init__(self, *, horizon: int | None) -> None:
        self._horizon = horizon
        self._round = 0
        self._payload: HashedPayload | None = None
        self._served: set[str] = set()  # who has been sent the current round in full
        self._pulls: dict[str, int] = {}  # how often each reader was served the current round
        self._changed = asyncio.Condition()

    @property
    def round(self) -> int:
        """The round published last (0: none yet)."""
        return self._round

    async def publish(self, round_: int, payload: bytes | HashedPayload) -> None:
        """Make ``payload`` round ``round_`` (later than the current) and wake its readers."""
        if round_ <= self._round:
            raise ValueError(f"round {round_} is not after the current {self._round}")
        hashed = payload if isinstance(payload, HashedPayload) else HashedPayload.of(payload)
        async with self._changed:
            self._round, self._payload, self._served = round_, hashed, set()
            self._pulls = {}
            self._changed.notify_all()

    def count_pull(self, round_: int, reader: str) -> int:
        """Count one serving of round ``round_`` to ``reader``; how many it has had of it
        (this one included). Only the current round is counted (an older one is not
        served: :meth:`get` answers NOT_FOUND)."""
        if round_ != self._round:
            return 0
        self._pulls[reader] = self._pulls.get(reader, 0) + 1
        return self._pulls[reader]

    async def served(self, round_: int, reader: str) -> None:
        """Record that ``reader`` was sent round ``round_`` in full."""
        async with self._changed:
            if round_ == self._round:
                self._served.add(reader)
                self._changed.notify_all()

    async def wait_served(self, readers: Collection[str], wait_s: float) -> frozenset[str]:
        """Wait up to ``wait_s`` until every one of ``readers`` has been sent the current
        round; those who have not."""
        wanted = frozenset(readers)
        try:
            async with asyncio.timeout(wait_s):
                async with self._changed:
                    await self._changed.wait_for(lambda: wanted <= self._served)
        except TimeoutError:
            pass
        return wanted - self._served

    async def get(self, wanted: int, wait_s: float) -> tuple[RoundAnswer, HashedPayload | None]:
        """(SERVE, payload) of round ``wanted``; (NOT_FOUND, None) for a round that does not
        exist; (WAIT, None) when the round it may wait for did not come within ``wait_s``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, wait_s)
        async with self._changed:
            while True:
                answer = round_answer(wanted, self._round, horizon=self._horizon)
                if answer is RoundAnswer.SERVE:
                    return answer, self._payload
                left = end - loop.time()
                if answer is RoundAnswer.NOT_FOUND or left <= 0:
                    return answer, None
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return RoundAnswer.WAIT, None


class ProxyExchangeService(fedproxy_pb2_grpc.ProxyExchangeServicer):
    """Implements ``peerlm.v1.ProxyExchange`` for an owner (``proxies`` and the ``cohort``
    it admits) or a member (``updates`` and its ``owner``'s name); the other method of each
    role is refused to everyone. ``streamer``: the peer port's (module docstring); None: one
    of this service's own with the default send budget (a service served alone)."""

    def __init__(
        self,
        *,
        proxies: RoundBoard | None = None,
        cohort: Collection[str] = (),
        updates: RoundBoard | None = None,
        owner: str | None = None,
        chunk_bytes: int,
        max_wait_s: float,
        registry: CollectorRegistry,
        signer: ProofSigner | None = None,
        log: Any = None,
        streamer: PeerStreamer | None = None,
        max_pulls_per_round: int | None = None,
    ) -> None:
        if (proxies is None) == (updates is None):
            raise ValueError("a FedProxy service is an owner's (proxies) or a member's (updates)")
        if updates is not None and not owner:
            raise ValueError("a member's service needs its owner's name")
        if chunk_bytes <= 0 or max_wait_s <= 0:
            raise ValueError("chunk_bytes and max_wait_s must be positive")
        self._proxies, self._cohort = proxies, frozenset(cohort)
        self._updates, self._owner = updates, owner
        self._chunk_bytes, self._max_wait = chunk_bytes, max_wait_s
        self._max_pulls = max_pulls_per_round
        self._signer = signer
        self._log: Any = log if log is not None else structlog.get_logger("peerlm.agent.fedproxy")
        self._streamer = streamer if streamer is not None else PeerStreamer(registry, log=log)
        self._refusals = get_counter(
            registry,
            "peerlm_agent_fedproxy_refusals_total",
            "ProxyExchange requests refused (not admitted, no such round, not ready)",
            ("rpc", "reason"),
        )
        self._sent = get_counter(
            registry,
            "peerlm_agent_fedproxy_bytes_sent_total",
            "Proxy and update bytes streamed to the cohort",
            ("rpc",),
        )

    @property
    def chunk_bytes(self) -> int:
        """Size of the chunks payloads are streamed in."""
        return self._chunk_bytes

    # A ``context.write`` handler, which the generated stub's return type does not list.
    async def PullProxy(  # type: ignore[override]
        self, request: fedproxy_pb2.PullProxyRequest, context: ServicerContext
    ) -> None:
        rpc, caller = "PullProxy", current_identity().name
        if self._proxies is None:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.PERMISSION_DENIED,
                "not_owner",
                "this agent owns no proxy",
                caller,
            )
        if caller not in self._cohort:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.PERMISSION_DENIED,
                "not_admitted",
                f"{caller!r} is not in this owner's cohort",
                caller,
            )
        wanted = int(request.round) or self._proxies.round or 1
        await self._serve(
            context, rpc, caller, self._proxies, wanted, PROXY_CONTENT_TYPE, PROXY_PROOF
        )

    # A ``context.write`` handler, which the generated stub's return type does not list.
    async def PullUpdate(  # type: ignore[override]
        self, request: fedproxy_pb2.PullUpdateRequest, context: ServicerContext
    ) -> None:
        rpc, caller = "PullUpdate", current_identity().name
        if self._updates is None:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.PERMISSION_DENIED,
                "not_member",
                "this agent is a cohort's owner and serves no update",
                caller,
            )
        if caller != self._owner:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.PERMISSION_DENIED,
                "not_owner",
                f"{caller!r} is not this member's owner",
                caller,
            )
        if request.round < 1:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_round",
                "an update is asked for by its round (>= 1)",
                caller,
            )
        await self._serve(
            context,
            rpc,
            caller,
            self._updates,
            int(request.round),
            UPDATE_CONTENT_TYPE,
            UPDATE_PROOF,
        )

    # ------------------------------------------------------------- internals

    async def _serve(
        self,
        context: ServicerContext,
        rpc: str,
        caller: str,
        board: RoundBoard,
        wanted: int,
        content_type: str,
        proof: str,
    ) -> None:
        remaining = context.time_remaining()
        # Answer just before the caller's deadline so that it hears "not ready", not silence.
        wait = self._max_wait if remaining is None else min(self._max_wait, remaining - 0.25)
        answer, payload = await board.get(wanted, wait)
        if answer is RoundAnswer.NOT_FOUND:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.NOT_FOUND,
                "no_round",
                f"round {wanted} does not exist here (current: {board.round})",
                caller,
            )
        if payload is None:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.UNAVAILABLE,
                "not_ready",
                f"round {wanted} is not ready yet; ask again",
                caller,
            )
        if board is self._proxies and self._max_pulls is not None:
            pulls = board.count_pull(wanted, caller)
            if pulls > self._max_pulls:
                await self._refuse(
                    context,
                    rpc,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "pull_limit",
                    f"round {wanted} was already served {pulls - 1} times to {caller!r}; the "
                    f"limit is {self._max_pulls} a round (fedproxy.max_pulls_per_round)",
                    caller,
                )
        content_type = payload_content_type(content_type, wanted)
        await self._streamer.stream(
            context,
            rpc=rpc,
            caller=caller,
            payload=payload,
            chunks=iter_chunks(payload, self._chunk_bytes, content_type),
            chunk_bytes=self._chunk_bytes,
            signer=self._signer,
            proof=(proof, str(wanted)),
            sent=self._sent.labels(rpc),
        )
        await board.served(wanted, caller)
        self._log.info(
            f"fedproxy_{proof.split('-')[1]}_sent",
            round=wanted,
            peer=caller,
            bytes=len(payload.data),
        )

    async def _refuse(
        self,
        context: ServicerContext,
        rpc: str,
        code: grpc.StatusCode,
        reason: str,
        detail: str,
        caller: str,
    ) -> NoReturn:
        self._refusals.labels(rpc, reason).inc()
        self._log.warning(
            "fedproxy_request_refused",
            rpc=rpc,
            reason=reason,
            code=code.name,
            peer=caller,
            detail=detail,
        )
        await context.abort(code, detail)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover


def fedproxy_service(service: ProxyExchangeService) -> Service:
    """``service`` as one more service of a node's server (the agent's peer server)."""
    return Service(
        FEDPROXY_SERVICE_NAME, service, fedproxy_pb2_grpc.add_ProxyExchangeServicer_to_server
    )


async def serve_fedproxy(
    ctx: NodeContext, service: ProxyExchangeService, *, listen: str
) -> NodeServer:
    """Build, bind and start a server of ``service`` alone on ``ctx``; SERVING once started."""
    server = await ctx.serve([fedproxy_service(service)], FEDPROXY_POLICY, listen=listen)
    await server.serving(True)
    return server


# ----------------------------------------------------------------------------- client


async def _pull(
    ctx: NodeContext,
    target: str,
    round_: int,
    *,
    expect: str,
    max_bytes: int,
    timeout_s: float,
    rpc: str,
) -> tuple[int, bytes]:
    counter = ctx.counter(
        "peerlm_agent_fedproxy_bytes_received_total",
        "Proxy and update bytes pulled from the cohort",
        ("rpc",),
    ).labels(rpc)
    async with ctx.dial(target, expect=expect) as peer:
        stub = fedproxy_pb2_grpc.ProxyExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        call: grpc.aio.UnaryStreamCall[Any, common_pb2.Chunk]
        if rpc == "PullProxy":
            call = stub.PullProxy(
                fedproxy_pb2.PullProxyRequest(round=round_),
                timeout=timeout_s,
                metadata=peer.metadata,
            )
            base, proof = PROXY_CONTENT_TYPE, PROXY_PROOF
        else:
            call = stub.PullUpdate(
                fedproxy_pb2.PullUpdateRequest(round=round_),
                timeout=timeout_s,
                metadata=peer.metadata,
            )
            base, proof = UPDATE_CONTENT_TYPE, UPDATE_PROOF
        payload, digest, content_type, metadata = await receive_chunks(
            call, max_bytes, counter, ctx.tls_failures, what=proof
        )
    try:
        sent = parse_round(content_type, base)
    except ProxyError as err:
        raise PeerExchangeError(str(err), reason="corrupt") from None
    if round_ and sent != round_:
        raise PeerExchangeError(f"asked for round {round_}, got {sent}", reason="corrupt")
    check_sender(peer.expected, metadata, proof, str(sent), digest)
    return sent, payload


async def pull_proxy(
    ctx: NodeContext, target: str, round_: int, *, owner: str, max_bytes: int, timeout_s: float
) -> tuple[int, bytes]:
    """A member pulls its owner's proxy of ``round_`` (0: the current); (round, payload).
    Under mTLS the payload must carry ``owner``'s sender proof. Failures are
    :class:`~peerlm.agent.peer.client.PeerExchangeError`, as for adapters."""
    return await _pull(
        ctx, target, round_, expect=owner, max_bytes=max_bytes, timeout_s=timeout_s, rpc="PullProxy"
    )


async def pull_update(
    ctx: NodeContext, target: str, round_: int, *, member: str, max_bytes: int, timeout_s: float
) -> bytes:
    """The owner pulls ``member``'s proxy trained in ``round_`` (waited for up to
    ``timeout_s``); must carry ``member``'s sender proof under mTLS."""
    _, payload = await _pull(
        ctx,
        target,
        round_,
        expect=member,
        max_bytes=max_bytes,
        timeout_s=timeout_s,
        rpc="PullUpdate",
    )
    return payload
