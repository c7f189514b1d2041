"""The client side of ``peerlm.v1.PeerExchange``: fetch a package, pull an adapter.

Each call opens its own channel to the peer (exchanges are ephemeral and peers change
every round), streams the payload's chunks into a :class:`~peerlm.chunks.ChunkAssembler`
and returns the verified bytes. Every failure is a :class:`PeerExchangeError` whose
``reason`` says what went wrong:

* ``too_large``: the first chunk announced more than ``max_bytes``; the call is cancelled
  there, before any further chunk is accepted.
* ``corrupt``: gaps, changed totals, surplus bytes, a wrong SHA-256 or content type.
* ``timeout``: the deadline (``timeout_s``, for the whole stream) passed.
* ``unavailable``: the peer cannot be reached, or the TLS handshake failed.
* ``refused``: the peer answered with an error status (``code`` holds it).
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import grpc
from peerlm.agent.exchange.package import PACKAGE_CONTENT_TYPE
from prometheus_client import Counter

from peerlm.chunks import ChunkAssembler, ChunkError
from peerlm.node import NodeContext, PeerChannel
from peerlm.pki.proof import ExpectedSender, ProofError
from peerlm.security.authz import TlsFailureCounter, describe_rpc_error
from peerlm.wire.v1 import common_pb2, peer_pb2, peer_pb2_grpc

__all__ = [
    "ADAPTER_CONTENT_TYPE",
    "PACKAGE_CONTENT_TYPE",
    "STUDENT_TOKENIZER_METADATA",
    "ExpectedSender",
    "PeerExchangeError",
    "adapter_content_type",
    "check_sender",
    "fetch_package",
    "parse_adapter_round",
    "pull_adapter",
    "pull_adapter_with_round",
    "receive_chunks",
]

#: Request metadata announcing a student's tokenizer (see peer_service, which reads it).
STUDENT_TOKENIZER_METADATA: Final = "peerlm-student-tokenizer-sha256"

#: Media type of an adapter; the server appends ``; round=N`` naming the round it sent.
ADAPTER_CONTENT_TYPE: Final = "application/vnd.peerlm.adapter+safetensors"


class PeerExchangeError(Exception):
    """A peer transfer failed; ``reason`` classifies it, ``code`` is the gRPC status if any."""

    def __init__(self, message: str, *, reason: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


def adapter_content_type(round_: int) -> str:
    """The content type naming the round of an adapter payload."""
    return f"{ADAPTER_CONTENT_TYPE}; round={round_}"


def parse_adapter_round(content_type: str) -> int:
    """The round in an adapter content type; raises ``ValueError`` if it is not one."""
    base, _, params = content_type.partition(";")
    if base.strip() != ADAPTER_CONTENT_TYPE:
        raise ValueError(f"content type {content_type!r} is not {ADAPTER_CONTENT_TYPE}")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key == "round" and value.isdigit():
            return int(value)
    raise ValueError(f"content type {content_type!r} names no round")


def _metadata(
    peer: PeerChannel, tokenizer_sha256: str | None = None
) -> tuple[tuple[str, str], ...]:
    # Only an insecure-dev server reads the dev identity; an mTLS server ignores it entirely.
    hint = ((STUDENT_TOKENIZER_METADATA, tokenizer_sha256),) if tokenizer_sha256 else ()
    return peer.metadata + hint


async def fetch_package(
    ctx: NodeContext,
    target: str,
    directive_id: str,
    *,
    expect: str | None,
    max_bytes: int,
    timeout_s: float,
    tokenizer_sha256: str | None = None,
) -> bytes:
    """Fetch the knowledge package ``directive_id`` entitles us to from teacher ``target``.

    The channel comes from ``ctx`` (:meth:`~peerlm.node.NodeContext.dial`); under mTLS the
    package must carry the sender proof of agent ``expect`` (reason ``unverified_sender``
    otherwise; None: no proof asked). ``tokenizer_sha256`` announces our tokenizer (request
    metadata ``peerlm-student-tokenizer-sha256``) so the teacher may send logits when it
    shares it. Received bytes count in ``peerlm_agent_package_bytes_received_total`` and
    handshake failures in ``peerlm_grpc_client_tls_failures_total``.
    """
    counter = ctx.counter(
        "peerlm_agent_package_bytes_received_total",
        "Knowledge-package bytes received from teachers",
    )
    async with ctx.dial(target, expect=expect) as peer:
        stub = peer_pb2_grpc.PeerExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        call = stub.FetchPackage(
            peer_pb2.FetchPackageRequest(directive_id=directive_id),
            timeout=timeout_s,
            metadata=_metadata(peer, tokenizer_sha256),
        )
        payload, digest, content_type, metadata = await _receive(
            call, max_bytes, counter, ctx.tls_failures, what="package"
        )
    if content_type != PACKAGE_CONTENT_TYPE:
        raise PeerExchangeError(
            f"teacher sent content type {content_type!r}, expected {PACKAGE_CONTENT_TYPE}",
            reason="corrupt",
        )
    _check_sender(peer.expected, metadata, "package", directive_id, digest)
    return payload


def _check_sender(
    expect: ExpectedSender | None, metadata: Any, kind: str, reference: str, sha256: bytes
) -> None:
    # Checked against the digest the assembler computed while the chunks arrived.
    if expect is None:
        return
    try:
        expect.verify_digest(metadata, kind, reference, sha256)
    except ProofError as err:
        raise PeerExchangeError(
            f"{kind} from {expect.sender!r} refused: {err} ({err.reason})",
            reason="unverified_sender",
        ) from None


async def pull_adapter_with_round(
    ctx: NodeContext,
    target: str,
    round_: int,
    *,
    expect: str | None,
    max_bytes: int,
    timeout_s: float | None = None,
) -> tuple[int, bytes]:
    """Pull a peer's adapter (``round_`` 0 = its latest); returns (round sent, safetensors).

    ``timeout_s`` defaults to the context's ``rpc_timeout_s``. Under mTLS the adapter must
    carry the sender proof of agent ``expect`` (None: no proof asked). Counted in
    ``peerlm_agent_adapter_bytes_received_total``.
    """
    if round_ < 0:
        raise ValueError(f"round must be >= 0, got {round_}")
    counter = ctx.counter(
        "peerlm_agent_adapter_bytes_received_total", "Adapter bytes pulled from peers"
    )
    async with ctx.dial(target, expect=expect) as peer:
        stub = peer_pb2_grpc.PeerExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        call = stub.PullAdapter(
            peer_pb2.PullAdapterRequest(round=round_),
            timeout=ctx.limits.rpc_timeout_s if timeout_s is None else timeout_s,
            metadata=_metadata(peer),
        )
        payload, digest, content_type, metadata = await _receive(
            call, max_bytes, counter, ctx.tls_failures, what="adapter"
        )
    try:
        sent_round = parse_adapter_round(content_type)
    except ValueError as err:
        raise PeerExchangeError(str(err), reason="corrupt") from None
    if round_ and sent_round != round_:
        raise PeerExchangeError(
            f"asked for the adapter of round {round_}, got round {sent_round}", reason="corrupt"
        )
    _check_sender(peer.expected, metadata, "adapter", str(sent_round), digest)
    return sent_round, payload


async def pull_adapter(
    ctx: NodeContext,
    target: str,
    round_: int,
    *,
    expect: str | None = None,
    max_bytes: int,
    timeout_s: float | None = None,
) -> bytes:
    """Pull a peer's adapter as safetensors bytes; see :func:`pull_adapter_with_round`."""
    _, payload = await pull_adapter_with_round(
        ctx, target, round_, expect=expect, max_bytes=max_bytes, timeout_s=timeout_s
    )
    return payload


async def receive_chunks(
    call: grpc.aio.UnaryStreamCall[Any, common_pb2.Chunk],
    max_bytes: int,
    counter: Counter | None,
    tls_failures: TlsFailureCounter | None,
    *,
    what: str,
) -> tuple[bytes, bytes, str, Any]:
    """Assemble a chunk stream of another peer service exactly as adapters are (FedWave's
    parts, FedProxy's proxies and updates): the payload, its verified SHA-256, its content
    type and the call's initial metadata; every failure a :class:`PeerExchangeError` with
    the reasons above."""
    return await _receive(call, max_bytes, counter, tls_failures, what=what)


async def _receive(
    call: grpc.aio.UnaryStreamCall[Any, common_pb2.Chunk],
    max_bytes: int,
    counter: Counter | None,
    tls_failures: TlsFailureCounter | None,
    *,
    what: str,
) -> tuple[bytes, bytes, str, Any]:
    """Assemble the call's chunks; map every failure to :class:`PeerExchangeError`.
    Returns the payload, its verified SHA-256, its content type and the call's initial
    metadata.

    A teacher refusing our certificate does so in the handshake, before any of its code
    runs: ``tls_failures`` (``peerlm_grpc_client_tls_failures_total``) is the only count.
    """
    hasher = BackgroundSha256()
    assembler = ChunkAssembler(max_bytes, hasher)
    first = True
    try:
        async for chunk in call:
            if first and chunk.total_size > max_bytes:
                if counter is not None:  # it was taken off the wire all the same
                    counter.inc(len(chunk.data))
                call.cancel()
                raise PeerExchangeError(
                    f"peer announced a {what} of {chunk.total_size} bytes, over our limit "
                    f"of {max_bytes}; refused at the first chunk",
                    reason="too_large",
                )
            first = False
            try:
                received = assembler.add(chunk)
            except ChunkError as err:
                call.cancel()
                raise PeerExchangeError(f"{what} stream corrupt: {err}", reason="corrupt") from None
            if counter is not None:
                counter.inc(received)
        await hasher.drained()
        payload = assembler.finish()
        metadata = await call.initial_metadata()
    except ChunkError as err:
        raise PeerExchangeError(f"{what} stream corrupt: {err}", reason="corrupt") from None
    except grpc.aio.AioRpcError as err:
        if tls_failures is not None:
            tls_failures.observe(err)
        code = err.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = "timeout"
        elif code == grpc.StatusCode.UNAVAILABLE:
            reason = "unavailable"
        else:
            reason = "refused"
        raise PeerExchangeError(
            f"{what} transfer failed: {describe_rpc_error(err)}", reason=reason, code=code
        ) from None
    finally:
        hasher.close()
    return payload, assembler.sha256, assembler.content_type, metadata


def check_sender(
    expect: ExpectedSender | None, metadata: Any, kind: str, reference: str, sha256: bytes
) -> None:
    """Check a stream's sender proof against the digest the assembler computed
    (:class:`PeerExchangeError` ``unverified_sender`` if it does not hold)."""
    _check_sender(expect, metadata, kind, reference, sha256)


class BackgroundSha256:
    """A SHA-256 fed on a worker thread, in order: ``hashlib`` releases the GIL while it
    hashes, so the event loop goes on receiving the next chunk while this one is hashed,
    and the digest is ready shortly after the last chunk (await :meth:`drained`)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        # One worker: updates must apply in the order the chunks arrived.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peerlm-sha256")
        self._last: Future[None] | None = None

    def update(self, data: bytes, /) -> None:
        self._last = self._pool.submit(self._hash.update, data)

    async def drained(self) -> None:
        """Wait (without blocking the loop) until every update so far is hashed."""
        if self._last is not None:
            await asyncio.wrap_future(self._last)

    def digest(self) -> bytes:
        if self._last is not None:
            self._last.result()  # done after drained(); raises what the worker raised
        return self._hash.digest()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
