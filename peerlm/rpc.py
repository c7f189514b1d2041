"""The one factory for gRPC servers and channels: every limit and keepalive, with reasons.

Every peerlm process builds its servers with :func:`create_server` and its channels with
:func:`create_channel`, so limits are set in one place and can be read in one place.
Health (``grpc.health.v1``) and reflection are registered on every server.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram

from peerlm.config import GrpcLimits
from peerlm.grpc_types import RpcMethodHandler, ServerInterceptor, ServicerContext

__all__ = [
    "MAX_STATUS_DETAILS",
    "MetricsInterceptor",
    "Oversized",
    "add_health_and_reflection",
    "bounded_details",
    "channel_options",
    "create_channel",
    "create_server",
    "hard_receive_limit",
    "metadata_value",
    "server_options",
]


def hard_receive_limit(limits: GrpcLimits) -> int:
    """gRPC's own cap on a received message: twice ``max_message_bytes`` (see above)."""
    return 2 * limits.max_message_bytes


def server_options(limits: GrpcLimits) -> list[tuple[str, int]]:
    """Channel arguments for a server, each with the reason it is set."""
    ms = 1000
    return [
        # Large payloads travel as chunk streams; a single message above a few MiB is a
        # client bug or an attack. Messages up to twice the limit reach MetricsInterceptor,
        # which refuses those above it with RESOURCE_EXHAUSTED and counts them (gRPC's own
        # refusal happens before any Python code runs, so it could not be counted); beyond
        # twice the limit gRPC refuses on its own, before allocating the message.
        ("grpc.max_receive_message_length", hard_receive_limit(limits)),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        # Directive feeds are long-lived and often idle: ping to notice dead peers and to
        # keep NAT and load-balancer state alive.
        ("grpc.keepalive_time_ms", int(limits.keepalive_time_s * ms)),
        ("grpc.keepalive_timeout_ms", int(limits.keepalive_timeout_s * ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Accept client keepalive pings this often, no faster; a client pinging faster is
        # answered with GOAWAY instead of being allowed to burn CPU.
        ("grpc.http2.min_ping_interval_without_data_ms", int(limits.min_ping_interval_s * ms)),
        ("grpc.http2.max_pings_without_data", 0),
        # Bounds the streams one connection can open at once (each directive feed and each
        # chunked transfer is one stream).
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # No max_connection_age: it would cut long-lived directive feeds at random times.
        # gRPC sets SO_REUSEPORT by default, so a second process on a bound address would
        # listen too and take half the connections; off, its bind fails and the error names
        # the address ("Failed to bind to address HOST:PORT").
        ("grpc.so_reuseport", 0),
    ]


def channel_options(limits: GrpcLimits) -> list[tuple[str, int]]:
    """Channel arguments for a client, matching :func:`server_options`."""
    ms = 1000
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        # Must not be shorter than the server's min_ping_interval or the server GOAWAYs us.
        (
            "grpc.keepalive_time_ms",
            int(max(limits.keepalive_time_s, limits.min_ping_interval_s) * ms),
        ),
        ("grpc.keepalive_timeout_ms", int(limits.keepalive_timeout_s * ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a restart of the CPM, but back off under persistent failure.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]


def create_server(
    limits: GrpcLimits, interceptors: Sequence[ServerInterceptor] = ()
) -> grpc.aio.Server:
    """A grpc.aio server with every limit set from ``limits``."""
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=server_options(limits),
        # Beyond this many concurrent RPCs new ones fail fast with RESOURCE_EXHAUSTED instead
        # of queueing without bound.
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )


def create_channel(
    target: str,
    limits: GrpcLimits,
    credentials: grpc.ChannelCredentials | None,
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel: secure when ``credentials`` is given, else plaintext.

    Plaintext is only reachable through peerlm.security.mode's insecure-dev decision.
    """
    options = channel_options(limits)
    chain = list(interceptors) if interceptors else None
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=chain)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=chain)


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> HealthServicer:
    """Register the standard health and reflection services; every service starts NOT_SERVING."""
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def set_serving(servicer: HealthServicer, names: Iterable[str], on: bool) -> None:
    """Flip the health status of ``names`` and of the whole server ("")."""
    status = (
        health_pb2.HealthCheckResponse.SERVING if on else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in [*names, ""]:
        await servicer.set(name, status)


Behaviour = Callable[..., Any]


def metadata_value(context: ServicerContext, key: str) -> str | None:
    """The first value of request metadata ``key`` as text, or None."""
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return None


class Oversized:
    """What the guarded deserializer yields for a message above the size limit."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class Unparsed:
    """A request message whose bytes have not been parsed yet.

    gRPC parses a unary request before any interceptor's behaviour runs, and the servicer
    context (which carries the caller's certificate) only exists in the behaviour, so the
    deserializer cannot know who sent the bytes. :class:`MetricsInterceptor` therefore hands
    gRPC a deserializer that only wraps the bytes in this object; :func:`wrap_handler` parses
    it just before the service's own handler runs, i.e. after every interceptor (the
    authorisation interceptor included) has admitted the call. Bytes from a caller that is
    not authorised for the method are never parsed.
    """

    __slots__ = ("_on_malformed", "_parse", "raw")

    def __init__(
        self,
        raw: bytes,
        parse: Callable[[bytes], Any] | None,
        on_malformed: Callable[[BaseException, ServicerContext], Awaitable[None]],
    ) -> None:
        self.raw = raw
        self._parse = parse
        self._on_malformed = on_malformed

    async def parse(self, context: ServicerContext) -> Any:
        """The parsed message; a parse failure ends the call with INVALID_ARGUMENT."""
        if self._parse is None:
            return self.raw
        try:
            return self._parse(self.raw)
        except Exception as err:  # any parser error is the client's malformed input
            await self._on_malformed(err, context)
            raise  # unreachable: on_malformed aborts the call


class LogLimiter:
    """At most one log line per key per ``interval_s``; counts what it suppressed."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def admit(self, key: str) -> int | None:
        """None to stay silent, else how many lines were suppressed since the last one."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)


#: Seconds between two log lines about malformed requests to the same method.
MALFORMED_LOG_INTERVAL_S = 10.0


class MetricsInterceptor(ServerInterceptor):
    """Counts requests by method and status code, and times them; refuses oversized messages.

    Put it first in the interceptor list so that refusals by later interceptors are counted.
    A request message above ``limits.max_message_bytes`` is never parsed: the call ends
    with RESOURCE_EXHAUSTED and is counted in ``peerlm_grpc_server_oversized_messages_total``
    (and in the requests counter under that code). Request bytes are parsed only after every
    interceptor has admitted the call (see :class:`Unparsed`); bytes that do not parse end the
    call with INVALID_ARGUMENT, are counted in ``peerlm_grpc_server_malformed_messages_total``
    and logged at most once per method per :data:`MALFORMED_LOG_INTERVAL_S`.
    """

    def __init__(
        self, registry: CollectorRegistry, component: str, limits: GrpcLimits | None = None
    ) -> None:
        self._component = component
        self._max_bytes = (limits or GrpcLimits()).max_message_bytes
        self._oversized = Counter(
            "peerlm_grpc_server_oversized_messages_total",
            "Request messages refused for exceeding max_message_bytes, by method.",
            ["component", "method"],
            registry=registry,
        )
        self._malformed = Counter(
            "peerlm_grpc_server_malformed_messages_total",
            "Request messages refused because their bytes do not parse, by method.",
            ["component", "method"],
            registry=registry,
        )
        self._requests = Counter(
            "peerlm_grpc_server_requests_total",
            "gRPC requests handled, by method and status code.",
            ["component", "method", "code"],
            registry=registry,
        )
        self._latency = Histogram(
            "peerlm_grpc_server_handling_seconds",
            "Time from the start of a gRPC call until its last response or error.",
            ["component", "method"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
        )
        self._log_limiter = LogLimiter(MALFORMED_LOG_INTERVAL_S)
        self._log = structlog.get_logger("peerlm.rpc").bind(component=component)

    def _record(
        self,
        method: str,
        context: ServicerContext,
        started: float,
        failed: BaseException | None,
    ) -> None:
        code = _status_name(context, failed)
        self._requests.labels(self._component, method, code).inc()
        self._latency.labels(self._component, method).observe(time.perf_counter() - started)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer
        limit = self._max_bytes

        async def malformed(err: BaseException, context: ServicerContext) -> None:
            await self._refuse_malformed(method, err, context)

        def deferred(raw: bytes) -> Any:
            if len(raw) > limit:
                return Oversized(len(raw))
            return Unparsed(raw, parse, malformed)

        streamed_requests = handler.stream_unary is not None or handler.stream_stream is not None
        return wrap_handler(
            handler,
            lambda behaviour, streaming: self._wrap(
                method, behaviour, streaming, streamed_requests
            ),
            request_deserializer=deferred,
        )

    async def _refuse(self, method: str, size: int, context: ServicerContext) -> None:
        self._oversized.labels(self._component, method).inc()
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request message of {size} bytes exceeds the limit of {self._max_bytes} bytes "
            "(large payloads travel as chunk streams)",
        )

    async def _refuse_malformed(
        self, method: str, err: BaseException, context: ServicerContext
    ) -> None:
        self._malformed.labels(self._component, method).inc()
        suppressed = self._log_limiter.admit(method)
        if suppressed is not None:
            self._log.warning(
                "malformed_request",
                method=method,
                peer=context.peer(),
                error=f"{type(err).__name__}: {err}",
                suppressed_since_last=suppressed,
            )
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request message for {method} does not parse: {type(err).__name__}",
        )

    def _checked(self, method: str, request: Any, context: ServicerContext, streamed: bool) -> Any:
        """The request stream with oversized messages turned into a refusal."""
        if not streamed:
            return request

        async def messages() -> AsyncIterator[Any]:
            async for message in request:
                if isinstance(message, Oversized):
                    await self._refuse(method, message.size, context)
                yield message

        return messages()

    def _wrap(
        self, method: str, behaviour: Behaviour, streaming: bool, streamed_requests: bool
    ) -> Behaviour:
        async def admit(request: Any, context: ServicerContext) -> Any:
            if isinstance(request, Oversized):
                await self._refuse(method, request.size, context)
            return self._checked(method, request, context, streamed_requests)

        if streaming and not inspect.iscoroutinefunction(behaviour):

            async def stream(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
                started = time.perf_counter()
                failed: BaseException | None = None
                try:
                    async for item in _responses(behaviour, await admit(request, context), context):
                        yield item
                except BaseException as exc:
                    failed = exc
                    raise
                finally:
                    self._record(method, context, started, failed)

            return stream

        # Unary responses, and response streams written with context.write() (for example
        # grpc.health.v1.Health/Watch): grpc.aio tells the styles apart by the function's
        # kind, so the wrapper must be a coroutine function too.
        async def unary(request: Any, context: ServicerContext) -> Any:
            started = time.perf_counter()
            failed: BaseException | None = None
            try:
                return await behaviour(await admit(request, context), context)
            except BaseException as exc:
                failed = exc
                raise
            finally:
                self._record(method, context, started, failed)

        return unary


async def _responses(
    behaviour: Behaviour, request: Any, context: ServicerContext
) -> AsyncIterator[Any]:
    """The responses of a response-streaming behaviour, whatever style it is written in."""
    result = behaviour(request, context)
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    elif inspect.isawaitable(result):
        await result  # it writes its responses with context.write()
    elif result is not None:
        for item in result:
            yield item


def _status_name(context: ServicerContext, failed: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if failed is None:
        return "OK"
    if isinstance(failed, (GeneratorExit,)) or type(failed).__name__ == "CancelledError":
        return "CANCELLED"
    return "UNKNOWN"


WrapFn = Callable[[Behaviour, bool], Behaviour]

#: Marks a behaviour made by :func:`wrap_handler`, as opposed to a service's own handler.
_WRAPPED_MARK = "_peerlm_wrapped"


#: Longest status message (characters) a service's refusal carries to the client. Handlers
#: quote request values to say what was wrong; gRPC sends the message percent-encoded in the
#: trailers, and a client drops trailers over its metadata limit (8 KiB soft, 16 KiB hard by
#: default) as RESOURCE_EXHAUSTED "received metadata size exceeds limit", hiding the real
#: status. 512 characters stay under 8 KiB even at 12 encoded bytes per character (4-byte
#: UTF-8, each byte sent as %XX).
MAX_STATUS_DETAILS = 512
_TRUNCATED = " ... [truncated]"


def bounded_details(details: str) -> str:
    """``details`` cut to :data:`MAX_STATUS_DETAILS` characters, marked when cut."""
    if len(details) <= MAX_STATUS_DETAILS:
        return details
    return details[: MAX_STATUS_DETAILS - len(_TRUNCATED)] + _TRUNCATED


class _BoundedDetailsContext:
    """The servicer context a service's handler sees: everything is the real context's,
    except that ``abort`` and ``set_details`` bound the status message
    (:func:`bounded_details`). One place for every handler, instead of trusting each
    message that quotes a request value to have cut it."""

    def __init__(self, context: ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> Any:
        return await self._context.abort(code, bounded_details(details), trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(bounded_details(details))


def _parsing(behaviour: Behaviour, streamed_requests: bool) -> Behaviour:
    """``behaviour`` (a service's own handler) fed parsed messages instead of :class:`Unparsed`.

    Keeps the function's kind (coroutine or async generator), which grpc.aio reads. The
    handler gets a context whose status messages are bounded (:class:`_BoundedDetailsContext`).
    """

    async def parsed(request: Any, context: ServicerContext) -> Any:
        if isinstance(request, Unparsed):
            return await request.parse(context)
        if not streamed_requests:
            return request

        async def messages() -> AsyncIterator[Any]:
            async for message in request:
                yield await message.parse(context) if isinstance(message, Unparsed) else message

        return messages()

    if inspect.isasyncgenfunction(behaviour):

        async def generator(request: Any, context: ServicerContext) -> AsyncIterator[Any]:
            bounded = _BoundedDetailsContext(context)
            async for item in behaviour(await parsed(request, context), bounded):
                yield item

        return generator

    async def coroutine(request: Any, context: ServicerContext) -> Any:
        result = behaviour(await parsed(request, context), _BoundedDetailsContext(context))
        return await result if inspect.isawaitable(result) else result

    return coroutine


def wrap_handler(
    handler: RpcMethodHandler,
    wrap: WrapFn,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> RpcMethodHandler:
    """Rebuild ``handler`` with its behaviour passed through ``wrap(behaviour, streaming)``.

    ``streaming`` is True when the behaviour returns a response stream. Works for all four
    call kinds; serializers are kept unless ``request_deserializer`` replaces the request's.
    The innermost wrapping (the one around the service's own handler) parses
    :class:`Unparsed` requests, so parsing happens after every interceptor has run.
    """
    parse = request_deserializer or handler.request_deserializer
    streamed_requests = handler.stream_unary is not None or handler.stream_stream is not None

    def wrapped(behaviour: Behaviour, streaming: bool) -> Behaviour:
        if not getattr(behaviour, _WRAPPED_MARK, False):
            behaviour = _parsing(behaviour, streamed_requests)
        result = wrap(behaviour, streaming)
        setattr(result, _WRAPPED_MARK, True)
        return result

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrapped(handler.unary_unary, False),
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrapped(handler.unary_stream, True),
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            wrapped(handler.stream_unary, False),
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            wrapped(handler.stream_stream, True),
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    return handler
