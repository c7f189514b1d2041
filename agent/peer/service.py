"""The server side of ``peerlm.v1.PeerExchange``: knowledge packages and adapters, streamed.

``FetchPackage``: the caller's name comes from its certificate (``current_identity()``,
set by :class:`~peerlm.security.authz.AuthInterceptor`); the :class:`DirectiveBook` decides
whether a directive this agent holds as teacher names that caller as its student. Refusals
answer with the book's status code and count in
``peerlm_agent_peer_refusals_total{rpc, reason}``. An authorised request gets the package
from the provider (built once per directive and cached: concurrent and retried fetches
share one build), streamed with :func:`~peerlm.chunks.iter_chunks`.

``PullAdapter``: any authenticated agent may pull this agent's current adapter (round 0 =
latest, else exactly that round) as safetensors; ``NOT_FOUND`` when there is none. The
first chunk's content type names the round sent (``...; round=N``). An agent whose adapter
must not leave by this method (``adapter_closed``: a FedWave expert, whose adapter is served
only over the FedWave exchange to the workflow's other stages) refuses every pull with
PERMISSION_DENIED, counted under the given reason, before anything is encoded or sent.

Both methods stream through the peer port's :class:`~peerlm.agent.peer.stream.PeerStreamer`
(the send budget shared with FedProxy's and FedWave's services on the same port,
configured by :class:`~peerlm.agent.settings.PeerSendSettings`): a chunk's bytes are
reserved before it is handed to gRPC and come back when gRPC is done with it, so readers
that stop consuming hold at most the budget, whatever their number. A stream that gets no
bytes within ``wait_s`` is refused with RESOURCE_EXHAUSTED (``busy``); a reader that takes
no written chunk within ``stall_s`` is cut off (``stalled``). Both count in
``peerlm_agent_peer_send_cutoffs_total{rpc, reason}``.

Both methods start their stream with a sender proof in the initial metadata when the
service has a ``signer`` (mTLS): this agent's certificate and its signature over what is
sent, to whom, and its SHA-256 (:mod:`peerlm.pki.proof`). Both methods are for the
``agent`` role only (:data:`PEER_POLICY`). Bytes sent count in
``peerlm_agent_package_bytes_sent_total`` and ``peerlm_agent_adapter_bytes_sent_total``.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, NoReturn

import grpc
import structlog
from peerlm.agent.cpm.directives import DirectiveBook, DirectiveError
from peerlm.agent.exchange.package import PACKAGE_CONTENT_TYPE
from peerlm.agent.peer.client import STUDENT_TOKENIZER_METADATA, adapter_content_type
from peerlm.agent.peer.stream import PeerStreamer
from prometheus_client import CollectorRegistry

from peerlm.chunks import HashedPayload, iter_chunks
from peerlm.grpc_types import ServicerContext
from peerlm.metrics import get_counter
from peerlm.node import NodeContext, NodeServer, Service
from peerlm.pki.identity import Role
from peerlm.pki.proof import ProofSigner
from peerlm.rpc import metadata_value
from peerlm.security.authz import current_identity
from peerlm.wire.v1 import common_pb2, cpm_pb2, peer_pb2, peer_pb2_grpc

__all__ = [
    "PEER_POLICY",
    "PEER_SERVICE_NAME",
    "STUDENT_TOKENIZER_METADATA",
    "AdapterProvider",
    "PackageProvider",
    "PeerExchangeService",
    "serve_peer",
]

PEER_SERVICE_NAME: Final = peer_pb2.DESCRIPTOR.services_by_name["PeerExchange"].full_name
_METHOD = f"/{PEER_SERVICE_NAME}/"

#: Which certificate roles may call which method. Anything not listed is denied.
PEER_POLICY: dict[str, frozenset[Role]] = {
    _METHOD + "FetchPackage": frozenset({Role.AGENT}),
    _METHOD + "PullAdapter": frozenset({Role.AGENT}),
}

#: Builds the package a verified directive entitles its student to (encoded bytes), given
#: the tokenizer SHA-256 the student announced (None if it announced none).
PackageProvider = Callable[[cpm_pb2.Directive, str | None], Awaitable[bytes]]

# STUDENT_TOKENIZER_METADATA (from peer_client): a student announces its tokenizer (SHA-256
# of its id -> token map, 64 hex digits) so the teacher can choose logits mode for a student
# that can use logits. A hint, not an identity: a wrong value only gets the student a
# package it cannot use, which it checks itself.
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
#: The adapter of a round (0 = latest) as (round, safetensors bytes), or None if absent. A
#: :class:`~peerlm.chunks.HashedPayload` (the model host's cached encoding of its current
#: adapter version) is streamed and proved with its known digest: no hashing per pull.
AdapterProvider = Callable[[int], Awaitable[tuple[int, bytes | HashedPayload] | None]]

_DIRECTIVE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


class _PeerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refusals = get_counter(
            registry,
            "peerlm_agent_peer_refusals_total",
            "PeerExchange requests refused by per-object checks or missing content",
            ("rpc", "reason"),
        )
        self.package_bytes = get_counter(
            registry,
            "peerlm_agent_package_bytes_sent_total",
            "Knowledge-package bytes streamed to students",
        )
        self.adapter_bytes = get_counter(
            registry, "peerlm_agent_adapter_bytes_sent_total", "Adapter bytes streamed to peers"
        )
        self.builds = get_counter(
            registry,
            "peerlm_agent_package_builds_total",
            "Knowledge packages built by the provider (cache misses)",
        )


#: Callers whose adapter pulls are counted (least recently served forgotten first).
_PULL_COUNT_ENTRIES = 4096


class PeerExchangeService(peer_pb2_grpc.PeerExchangeServicer):
    """Implements ``peerlm.v1.PeerExchange`` over a directive book and two providers.

    ``max_package_bytes`` and ``max_adapter_bytes`` bound what this agent sends: a provider
    returning more is refused with ``RESOURCE_EXHAUSTED`` rather than streamed. The agent
    sets ``max_adapter_bytes`` to the largest adapter its model can produce
    (:meth:`~peerlm.agent.adapter_codec.AdapterSpec.max_encoded_bytes`); None: no bound.
    Up to ``cache_entries`` built packages are kept (least recently used evicted first).
    ``streamer`` streams under the peer port's send budget (module docstring); None: one of
    this service's own with the default :class:`~peerlm.agent.settings.PeerSendSettings`.
    ``adapter_closed``: ``(reason, message)`` to refuse every ``PullAdapter`` with
    (PERMISSION_DENIED, counted under ``reason``); None: the adapter is served.
    """

    def __init__(
        self,
        book: DirectiveBook,
        package_provider: PackageProvider,
        adapter_provider: AdapterProvider,
        *,
        chunk_bytes: int,
        max_package_bytes: int,
        max_adapter_bytes: int | None = None,
        registry: CollectorRegistry,
        log: Any = None,
        cache_entries: int = 4,
        signer: ProofSigner | None = None,
        streamer: PeerStreamer | None = None,
        adapter_closed: tuple[str, str] | None = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if cache_entries < 1:
            raise ValueError(f"cache_entries must be at least 1, got {cache_entries}")
        self._book = book
        self._package_provider = package_provider
        self._adapter_provider = adapter_provider
        self._chunk_bytes = chunk_bytes
        self._max_package = max_package_bytes
        self._max_adapter = max_adapter_bytes
        # (reason, message): every PullAdapter refused (module docstring); None: served.
        self._adapter_closed = adapter_closed
        self._cache_entries = cache_entries
        self._signer = signer
        self._builds: collections.OrderedDict[str, asyncio.Future[HashedPayload]] = (
            collections.OrderedDict()
        )
        self._chunk_cache: tuple[HashedPayload, str, list[common_pb2.Chunk]] | None = None
        # Adapters sent per caller (the daemon lingers for a merge student's pull), the
        # most recently served _PULL_COUNT_ENTRIES callers only.
        self._adapter_pulls: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._m = _PeerMetrics(registry)
        self._log: Any = log if log is not None else structlog.get_logger("peerlm.agent.peer")
        self._streamer = streamer if streamer is not None else PeerStreamer(registry, log=log)

    @property
    def chunk_bytes(self) -> int:
        """Size of the chunks payloads are streamed in."""
        return self._chunk_bytes

    # ------------------------------------------------------------------ RPCs

    # A ``context.write`` handler (grpc.aio's other response-stream form), which the generated
    # stub's return type does not list.
    async def FetchPackage(  # type: ignore[override]
        self, request: peer_pb2.FetchPackageRequest, context: ServicerContext
    ) -> None:
        rpc, caller = "FetchPackage", current_identity().name
        directive_id = request.directive_id
        if not _DIRECTIVE_ID.fullmatch(directive_id):
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_directive_id",
                "directive_id must be 1-128 characters of [A-Za-z0-9_-]",
                caller,
            )
        tokenizer = metadata_value(context, STUDENT_TOKENIZER_METADATA)
        if tokenizer is not None and not _HEX64.fullmatch(tokenizer):
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_tokenizer_hash",
                f"{STUDENT_TOKENIZER_METADATA} must be 64 lower-case hex digits",
                caller,
            )
        try:
            directive = self._book.teaching_for(directive_id, caller)
        except DirectiveError as err:
            await self._refuse(context, rpc, err.code, err.reason, err.message, caller)
        try:
            payload = await self._package(directive, tokenizer)
        except Exception as err:  # the provider's failure is ours, not the caller's
            self._book.refund(directive_id)
            self._log.error(
                "package_build_failed",
                directive=directive_id,
                round=directive.matchmaking_round,
                peer=caller,
                error=repr(err),
            )
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.UNAVAILABLE,
                "build_failed",
                "the teacher could not build the package; retry later",
                caller,
            )
        if len(payload.data) > self._max_package:
            self._book.refund(directive_id)
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "package_too_large",
                f"package of {len(payload.data)} bytes exceeds this teacher's limit "
                f"of {self._max_package}",
                caller,
            )
        chunks = await self._streamer.stream(
            context,
            rpc=rpc,
            caller=caller,
            payload=payload,
            chunks=iter_chunks(payload, self._chunk_bytes, PACKAGE_CONTENT_TYPE),
            chunk_bytes=self._chunk_bytes,
            signer=self._signer,
            proof=("package", directive_id),
            sent=self._m.package_bytes,
            # Refused for other readers' load: the teacher's side, so not one of the
            # student's fetches (a reader that stalls has used its fetch).
            on_busy=lambda: self._book.refund(directive_id),
        )
        self._log.info(
            "package_sent",
            directive=directive_id,
            round=directive.matchmaking_round,
            peer=caller,
            bytes=len(payload.data),
            chunks=chunks,
            fetch=self._book.fetches(directive_id),
        )

    # A ``context.write`` handler (grpc.aio's other response-stream form), which the generated
    # stub's return type does not list.
    async def PullAdapter(  # type: ignore[override]
        self, request: peer_pb2.PullAdapterRequest, context: ServicerContext
    ) -> None:
        rpc, caller = "PullAdapter", current_identity().name
        if self._adapter_closed is not None:
            reason, message = self._adapter_closed
            await self._refuse(
                context, rpc, grpc.StatusCode.PERMISSION_DENIED, reason, message, caller
            )
        wanted = int(request.round)
        found = await self._adapter_provider(wanted)
        if found is None or (wanted and found[0] != wanted):
            what = "no adapter yet" if wanted == 0 else f"no adapter of round {wanted}"
            await self._refuse(context, rpc, grpc.StatusCode.NOT_FOUND, "no_adapter", what, caller)
        sent_round, raw = found
        payload = raw if isinstance(raw, HashedPayload) else HashedPayload.of(raw)
        if self._max_adapter is not None and len(payload.data) > self._max_adapter:
            await self._refuse(
                context,
                rpc,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "adapter_too_large",
                f"adapter of {len(payload.data)} bytes exceeds this agent's limit "
                f"of {self._max_adapter}",
                caller,
            )
        await self._streamer.stream(
            context,
            rpc=rpc,
            caller=caller,
            payload=payload,
            chunks=self._adapter_chunks(payload, adapter_content_type(sent_round)),
            chunk_bytes=self._chunk_bytes,
            signer=self._signer,
            proof=("adapter", str(sent_round)),
            sent=self._m.adapter_bytes,
        )
        self._log.info("adapter_sent", round=sent_round, peer=caller, bytes=len(payload.data))
        self._adapter_pulls[caller] = self._adapter_pulls.pop(caller, 0) + 1
        while len(self._adapter_pulls) > _PULL_COUNT_ENTRIES:
            self._adapter_pulls.popitem(last=False)

    def adapter_pulls(self, caller: str) -> int:
        """Adapters fully sent to ``caller`` so far (0 if none, or forgotten)."""
        return self._adapter_pulls.get(caller, 0)

    # ------------------------------------------------------------- internals

    def _adapter_chunks(self, payload: HashedPayload, content_type: str) -> list[common_pb2.Chunk]:
        """The chunk messages of ``payload``, built once per adapter version: every pull of
        that version streams the same messages, so a pull costs gRPC's serialisation and no
        slicing or message building. Only the latest version is kept (one adapter's size)."""
        cached = self._chunk_cache
        # The same version: the same object from a caching provider, or equal bytes from one
        # that returns fresh bytes per pull (which would otherwise hold a chunk list each).
        if (
            cached is not None
            and cached[1] == content_type
            and (cached[0] is payload or cached[0].sha256 == payload.sha256)
        ):
            return cached[2]
        chunks = list(iter_chunks(payload, self._chunk_bytes, content_type))
        self._chunk_cache = (payload, content_type, chunks)
        return chunks

    async def _refuse(
        self,
        context: ServicerContext,
        rpc: str,
        code: grpc.StatusCode,
        reason: str,
        detail: str,
        caller: str,
    ) -> NoReturn:
        self._m.refusals.labels(rpc, reason).inc()
        self._log.warning(
            "peer_request_refused",
            rpc=rpc,
            reason=reason,
            code=code.name,
            peer=caller,
            detail=detail,
        )
        await context.abort(code, detail)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    async def _package(self, directive: cpm_pb2.Directive, tokenizer: str | None) -> HashedPayload:
        """The package for ``directive``, built (and hashed) at most once however many fetch
        it at once.

        The first fetch's tokenizer hint decides the build; retries get the same package.
        """
        key = directive.directive_id
        build = self._builds.get(key)
        if build is None:
            self._m.builds.inc()
            build = asyncio.ensure_future(self._hashed_package(directive, tokenizer))
            build.add_done_callback(lambda done: self._forget_failed(key, done))
            self._builds[key] = build
            while len(self._builds) > self._cache_entries:
                self._builds.popitem(last=False)
        else:
            self._builds.move_to_end(key)
        # shield: a student hanging up must not cancel a build others (or its retry) await.
        return await asyncio.shield(build)

    async def _hashed_package(
        self, directive: cpm_pb2.Directive, tokenizer: str | None
    ) -> HashedPayload:
        return HashedPayload.of(await self._package_provider(directive, tokenizer))

    def _forget_failed(self, key: str, done: asyncio.Future[HashedPayload]) -> None:
        # Retrieve the exception (no "never retrieved" warning when nobody awaits any more)
        # and drop the failed build so that the next fetch tries again.
        failed = done.cancelled() or done.exception() is not None
        if failed and self._builds.get(key) is done:
            del self._builds[key]


async def serve_peer(
    ctx: NodeContext,
    service: PeerExchangeService,
    *,
    listen: str,
    extra: Sequence[tuple[Service, Mapping[str, frozenset[Role]]]] = (),
) -> NodeServer:
    """Build, bind and start the peer server on ``ctx`` (:meth:`NodeContext.serve`: metrics
    first, then authentication and :data:`PEER_POLICY`); returns it with its bound port.
    ``extra``: more services on the same port, each with its policy (FedWave's exchange).
    Health reports SERVING once started; the caller stops it (``await server.stop()``).
    """
    policy = dict(PEER_POLICY)
    for _, more in extra:
        policy.update(more)
    server = await ctx.serve(
        [
            Service(PEER_SERVICE_NAME, service, peer_pb2_grpc.add_PeerExchangeServicer_to_server),
            *(svc for svc, _ in extra),
        ],
        policy,
        listen=listen,
    )
    await server.serving(True)
    ctx.log.info(
        "peer_server_started",
        listen=listen.rsplit(":", 1)[0] + f":{server.port}",
        security_mode=ctx.mode.value,
        chunk_bytes=service.chunk_bytes,
    )
    return server
