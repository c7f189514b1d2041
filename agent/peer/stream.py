"""Streaming a payload to a peer under the peer port's send budget, with the sender proof.

Every service on an agent's peer port that streams a :class:`~peerlm.chunks.HashedPayload`
(``PeerExchange``'s packages and adapters, FedProxy's proxies and updates, FedWave's parts)
streams it through one :class:`PeerStreamer`, built once per port: so a member is metered by
one per-identity share and all readers by one total (:mod:`peerlm.agent.peer.send_budget`,
configured by :class:`~peerlm.agent.settings.PeerSendSettings`), whichever service it pulls
from (memory is bounded per stream and in total; an admitted cohort or workflow member
can be a slow reader too).

What a stream does, in order:

1. the sender proof (:mod:`peerlm.pki.proof`) in the initial metadata when the service has a
   signer: the caller cannot see our certificate in TLS, so it checks this instead, signed
   over the payload's known digest (no hashing per request);
2. each chunk's bytes reserved from the budget before it is handed to gRPC, given back when
   gRPC is done with it. A stream that gets no bytes within ``wait_s`` is refused with
   RESOURCE_EXHAUSTED (``busy``); a reader that takes no written chunk within ``stall_s`` is
   cut off (``stalled``: no more chunks, DEADLINE_EXCEEDED after what was queued). Both
   count in ``peerlm_agent_peer_send_cutoffs_total{rpc, reason}``;
   ``peerlm_agent_peer_send_in_flight_bytes`` shows the bytes reserved now, all services
   together.

Handlers that use it are ``context.write`` handlers, not generators, because only then can
the service see a write that does not finish.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import structlog
from peerlm.agent.peer.send_budget import SendBudget
from peerlm.agent.settings import PeerSendSettings
from prometheus_client import CollectorRegistry, Counter, Gauge

from peerlm.chunks import HashedPayload
from peerlm.grpc_types import ServicerContext
from peerlm.metrics import get_collector, get_counter
from peerlm.pki.proof import ProofSigner, digest_statement
from peerlm.wire.v1 import common_pb2

__all__ = ["PeerStreamer"]


class PeerStreamer:
    """Streams payloads to the readers of one peer port under one send budget.

    Build one per server and hand it to every service on that server; a service built alone
    (no streamer given) builds its own with the default :class:`PeerSendSettings`.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        settings: PeerSendSettings | None = None,
        *,
        log: Any = None,
    ) -> None:
        self.settings = settings if settings is not None else PeerSendSettings()
        self.budget = SendBudget(self.settings.budget_bytes, self.settings.identity_bytes)
        self._log: Any = log if log is not None else structlog.get_logger("peerlm.agent.peer")
        self._cutoffs = get_counter(
            registry,
            "peerlm_agent_peer_send_cutoffs_total",
            "Payload streams of the peer port (packages, adapters, FedProxy proxies and "
            "updates, FedWave parts) ended by the send budget: no bytes within wait_s (busy) "
            "or a reader that took no chunk within stall_s (stalled)",
            ("rpc", "reason"),
        )
        self._in_flight = get_collector(
            Gauge,
            registry,
            "peerlm_agent_peer_send_in_flight_bytes",
            "Chunk bytes handed to gRPC and not yet written to their readers, all services "
            "of the peer port together",
        )

    async def prove(
        self,
        context: ServicerContext,
        signer: ProofSigner | None,
        kind: str,
        reference: str,
        caller: str,
        payload: HashedPayload,
    ) -> None:
        """Send the sender proof over ``payload`` (``kind``, ``reference``, to ``caller``)
        as initial metadata; nothing without a ``signer`` (insecure-dev)."""
        if signer is not None:
            statement = digest_statement(kind, reference, caller, payload.sha256)
            await context.send_initial_metadata(signer.metadata(statement))

    async def stream(
        self,
        context: ServicerContext,
        *,
        rpc: str,
        caller: str,
        payload: HashedPayload,
        chunks: Iterable[common_pb2.Chunk],
        chunk_bytes: int,
        signer: ProofSigner | None,
        proof: tuple[str, str],
        sent: Counter,
        on_busy: Callable[[], None] | None = None,
    ) -> int:
        """The proof (``proof`` = (kind, reference)) then ``chunks`` (``payload`` cut in
        ``chunk_bytes`` by :func:`~peerlm.chunks.iter_chunks`, best a lazy iterator or a
        list shared by every stream of the payload) under the budget; the count of chunks
        written. ``sent`` counts the bytes written; ``on_busy`` runs before a stream is
        refused for want of budget. Ends the call with RESOURCE_EXHAUSTED or
        DEADLINE_EXCEEDED (module docstring).

        A chunk is taken from ``chunks`` only once its bytes are reserved: a lazy iterator
        builds the message (a copy of the chunk's bytes) then, so a stream waiting for the
        budget holds no chunk (a thousand waiting streams would otherwise hold a thousand).

        A write runs as its own task so that a reader that stops can be seen (the handler
        waits at most ``stall_s`` for it) while the chunk's bytes stay reserved until gRPC
        is done with the message: when the reader takes it, or when the call or connection
        ends (the reader hangs up or its process dies, the server stops). The write task is
        never cancelled from here (shielded), so the bytes come back exactly then."""
        await self.prove(context, signer, proof[0], proof[1], caller, payload)
        settings, budget = self.settings, self.budget
        pending = iter(chunks)
        total = len(payload.data)
        count = 0
        for offset in range(0, max(total, 1), chunk_bytes):
            nbytes = min(chunk_bytes, total - offset)
            if not await budget.reserve(caller, nbytes, settings.wait_s):
                self._cutoffs.labels(rpc, "busy").inc()
                if on_busy is not None:
                    on_busy()
                ledger = budget.ledger
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this agent's send budget is taken by other readers "
                    f"({ledger.in_flight} of {ledger.total_bytes} bytes unwritten, "
                    f"{ledger.held(caller)} of them yours); got none in "
                    f"{settings.wait_s:g} s, retry later",
                )
            self._in_flight.set(budget.ledger.in_flight)
            write = asyncio.ensure_future(context.write(next(pending)))
            write.add_done_callback(functools.partial(self._written, caller, nbytes))
            try:
                await asyncio.wait_for(asyncio.shield(write), settings.stall_s)
            except TimeoutError:
                self._cutoffs.labels(rpc, "stalled").inc()
                self._log.debug("peer_reader_stalled", rpc=rpc, peer=caller, chunk=count)
                # grpc.aio cannot reset one stream: the chunk stays queued (and reserved)
                # until the reader takes it or its connection ends; then the stream ends.
                await asyncio.shield(write)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"this reader took no data for {settings.stall_s:g} s and was cut "
                    f"off after {count + 1} chunks; pull again",
                )
            sent.inc(nbytes)
            count += 1
        return count

    def _written(self, caller: str, nbytes: int, write: asyncio.Future[None]) -> None:
        # Retrieve the outcome (a failed write is the call's end, reported by gRPC) and
        # give the bytes back: gRPC no longer holds the message.
        if not write.cancelled():
            write.exception()
        self.budget.release(caller, nbytes)
        self._in_flight.set(self.budget.ledger.in_flight)
