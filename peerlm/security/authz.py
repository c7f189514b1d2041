"""Per-method authorisation from the peer's certificate, and client-side TLS diagnostics.

Server side: :class:`AuthInterceptor` runs in front of every handler. It takes the peer's
identity from the verified client certificate (``x509_pem_cert`` in the gRPC auth context),
checks the federation and the role against a per-method policy (deny by default), and makes
the identity available to the handler through :func:`current_identity`. Per-object checks
("only the receiver of a directive may report its reward") belong in the handler, which
reads :func:`current_identity`.

grpc.aio server interceptors cannot see the auth context in ``intercept_service`` (there is
no servicer context yet), so the interceptor wraps the handler it is given and performs the
check as the first step of the call.

Client side: handshake refusals (certificate from another CA, no certificate, expired
certificate) happen inside gRPC core before any server Python code runs, so servers cannot
count them. The *client* sees them as ``UNAVAILABLE``; :func:`describe_rpc_error` turns those
into readable messages and :class:`TlsFailureCounter` counts them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

import grpc
import structlog
from prometheus_client import CollectorRegistry

from peerlm.metrics import get_counter
from peerlm.pki.identity import PeerIdentity, Role, identity_from_certificate_pem, parse_spiffe_uri
from peerlm.rpc import wrap_handler
from peerlm.security.mode import SecurityMode

if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
    _UnaryUnaryClientInterceptor = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamClientInterceptor = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _Context = grpc.aio.ServicerContext[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor
    _UnaryUnaryClientInterceptor = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStreamClientInterceptor = grpc.aio.UnaryStreamClientInterceptor
    _Context = grpc.aio.ServicerContext

__all__ = [
    "DEV_IDENTITY_METADATA_KEY",
    "HEALTH_AND_REFLECTION_METHODS",
    "AuthInterceptor",
    "TlsFailureCounter",
    "TlsFailureInterceptor",
    "current_identity",
    "describe_rpc_error",
    "dev_identity_metadata",
    "tls_failure_reason",
    "use_identity",
]

HEALTH_AND_REFLECTION_METHODS: Final[frozenset[str]] = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)

# Dev-only: in insecure-dev mode there is no certificate, so a client names itself with this
# metadata key (a spiffe:// URI). It is ignored entirely in mTLS mode.
DEV_IDENTITY_METADATA_KEY: Final = "peerlm-dev-identity"

# Parsing a PEM certificate costs far more than a dict lookup, and a long-lived peer presents
# the same certificate on every call. Bounded so a stream of distinct certificates cannot
# grow memory without limit (principle 4).
_IDENTITY_CACHE_SIZE: Final = 1024

_current_identity: ContextVar[PeerIdentity | None] = ContextVar(
    "peerlm_current_identity", default=None
)


def current_identity() -> PeerIdentity:
    """The authenticated caller of the RPC being handled.

    Raises ``RuntimeError`` outside a call authorised by :class:`AuthInterceptor` (or a
    :func:`use_identity` block).
    """
    identity = _current_identity.get()
    if identity is None:
        raise RuntimeError(
            "no authenticated peer identity here: current_identity() is only available "
            "inside a gRPC handler behind AuthInterceptor"
        )
    return identity


@contextlib.contextmanager
def use_identity(identity: PeerIdentity) -> Iterator[PeerIdentity]:
    """Run a block as ``identity``; for in-memory transports and tests that bypass gRPC."""
    token = _current_identity.set(identity)
    try:
        yield identity
    finally:
        _current_identity.reset(token)


def dev_identity_metadata(identity: PeerIdentity) -> tuple[tuple[str, str], ...]:
    """Call metadata naming ``identity`` to an insecure-dev server (dev only)."""
    return ((DEV_IDENTITY_METADATA_KEY, identity.spiffe_uri),)


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.reason = reason
        self.details = details


class AuthInterceptor(_ServerInterceptor):
    """Authenticate the caller and authorise the method before every handler runs.

    ``policy`` maps full method names (``"/peerlm.v1.Matchmaker/SubmitProfile"``) to the
    roles allowed to call them. Methods absent from the policy are refused
    (``PERMISSION_DENIED``) unless listed in ``public_methods``, which any authenticated
    member of the federation may call (health and reflection by default).
    """

    def __init__(
        self,
        policy: Mapping[str, frozenset[Role]],
        *,
        federation: str,
        mode: SecurityMode,
        registry: CollectorRegistry,
        component: str,
        public_methods: frozenset[str] = HEALTH_AND_REFLECTION_METHODS,
        max_calls_per_identity: int | None = None,
    ) -> None:
        self._policy = {method: frozenset(roles) for method, roles in policy.items()}
        # Calls in flight per caller (its SPIFFE URI), bounded by max_calls_per_identity.
        self._max_calls = max_calls_per_identity
        self._in_flight: dict[str, int] = {}
        self._federation = federation
        self._mode = SecurityMode(mode)
        self._component = component
        self._public_methods = frozenset(public_methods)
        self._identities: dict[bytes, PeerIdentity | str] = {}
        self._refusals = get_counter(
            registry,
            "peerlm_auth_refusals_total",
            "RPCs refused by the authorisation interceptor (handshake refusals happen in "
            "gRPC core and are not counted here)",
            ("component", "method", "reason"),
        )
        self._log = structlog.get_logger("peerlm.security.authz").bind(component=component)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None:
            # Unknown method: let gRPC answer UNIMPLEMENTED. Nothing runs, so nothing to guard,
            # and not counting it keeps the metric's method label bounded.
            return handler
        return self._wrap(handler, handler_call_details.method)

    # -- authentication and authorisation -------------------------------------------------

    def _identity_from_pem(self, pem: bytes) -> PeerIdentity | str:
        cached = self._identities.get(pem)
        if cached is not None:
            return cached
        try:
            result: PeerIdentity | str = identity_from_certificate_pem(pem)
        except ValueError as err:
            result = str(err)
        if len(self._identities) >= _IDENTITY_CACHE_SIZE:
            # Drop the oldest entry (dicts keep insertion order).
            del self._identities[next(iter(self._identities))]
        self._identities[pem] = result
        return result

    def _authenticate(self, context: _Context) -> PeerIdentity:
        if self._mode is SecurityMode.MTLS:
            pems = list(context.auth_context().get("x509_pem_cert", ()))
            if not pems:
                raise _Refusal(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no_certificate",
                    "no verified client certificate on this connection; connect with mTLS",
                )
            parsed = self._identity_from_pem(pems[0])
        else:
            values = [
                value
                for key, value in (context.invocation_metadata() or ())
                if key == DEV_IDENTITY_METADATA_KEY
            ]
            if not values:
                raise _Refusal(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no_dev_identity",
                    f"insecure-dev server: send your spiffe:// identity in the "
                    f"{DEV_IDENTITY_METADATA_KEY!r} metadata key",
                )
            value = values[0]
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            try:
                parsed = parse_spiffe_uri(text)
            except ValueError as err:
                parsed = str(err)
        if isinstance(parsed, str):
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "bad_identity",
                f"peer presents no valid federation identity: {parsed}",
            )
        if parsed.federation != self._federation:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong_federation",
                f"peer {parsed.spiffe_uri} belongs to federation {parsed.federation!r}, "
                f"this server serves {self._federation!r}",
            )
        return parsed

    def _authorise(self, identity: PeerIdentity, method: str) -> None:
        if method in self._public_methods:
            return
        allowed = self._policy.get(method)
        if allowed is None:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "method_not_in_policy",
                f"{method} is not in this server's authorisation policy, so no role may call it",
            )
        if identity.role not in allowed:
            roles = ", ".join(sorted(r.value for r in allowed)) or "none"
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "role_not_allowed",
                f"{method} may not be called by role {identity.role.value!r} "
                f"({identity.spiffe_uri}); allowed roles: {roles}",
            )

    def _take_slot(self, identity: PeerIdentity) -> None:
        if self._max_calls is None:
            return
        key = identity.spiffe_uri
        held = self._in_flight.get(key, 0)
        if held >= self._max_calls:
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "identity_limit",
                f"{key} already has {held} calls in flight on this server "
                f"(limit {self._max_calls} per identity); retry when one has ended",
            )
        self._in_flight[key] = held + 1

    def _release(self, identity: PeerIdentity) -> None:
        if self._max_calls is None:
            return
        key = identity.spiffe_uri
        left = self._in_flight.get(key, 1) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)

    async def _admit(self, context: _Context, method: str) -> PeerIdentity:
        """Authenticate, authorise and take one of the caller's call slots, or abort the RPC
        (counting the refusal; logging it unless it is a flood's ``identity_limit``). The
        caller must :meth:`_release` the identity when the call ends."""
        identity: PeerIdentity | None = None
        try:
            identity = self._authenticate(context)
            self._authorise(identity, method)
            self._take_slot(identity)
            return identity
        except _Refusal as refusal:
            self._refusals.labels(self._component, method, refusal.reason).inc()
            if refusal.reason == "identity_limit":
                # A flood is counted, not logged call by call (the log would be the flood).
                await context.abort(refusal.code, refusal.details)
            self._log.warning(
                "auth_refused",
                method=method,
                reason=refusal.reason,
                code=refusal.code.name,
                peer=context.peer(),
                # Not `identity`: that key names this process on every log line.
                peer_identity=identity.spiffe_uri if identity else None,
                detail=refusal.details,
            )
            await context.abort(refusal.code, refusal.details)

    # -- handler wrapping -----------------------------------------------------------------

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        def guard(behaviour: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            if streaming:
                return self._wrap_stream_response(behaviour, method)
            return self._wrap_unary_response(behaviour, method)

        wrapped = wrap_handler(handler, guard)
        if wrapped is handler:
            # A handler with no behaviour cannot run anything; refuse rather than pass it on.
            raise RuntimeError(f"handler for {method} has no behaviour")
        return wrapped

    def _wrap_unary_response(
        self, behaviour: Callable[..., Any], method: str
    ) -> Callable[[Any, _Context], Awaitable[Any]]:
        async def guarded(request: Any, context: _Context) -> Any:
            identity = await self._admit(context, method)
            token = _current_identity.set(identity)
            try:
                result = behaviour(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            finally:
                _current_identity.reset(token)
                self._release(identity)

        return guarded

    def _wrap_stream_response(
        self, behaviour: Callable[..., Any], method: str
    ) -> Callable[[Any, _Context], Any]:
        if inspect.iscoroutinefunction(behaviour):
            # A coroutine handler writes with context.write(); grpc.aio tells the two styles
            # apart by the function's kind, so the wrapper must be a coroutine function too.
            async def guarded_writer(request: Any, context: _Context) -> None:
                identity = await self._admit(context, method)
                token = _current_identity.set(identity)
                try:
                    await behaviour(request, context)
                finally:
                    _current_identity.reset(token)
                    self._release(identity)

            return guarded_writer

        async def guarded_generator(request: Any, context: _Context) -> AsyncIterator[Any]:
            # The generator body runs in the RPC's task, so the identity set here is what the
            # wrapped handler sees. No reset: the RPC's context dies with its task, and a
            # generator may be finalised from another context, where reset() would fail.
            identity = await self._admit(context, method)
            _current_identity.set(identity)
            try:
                result = behaviour(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                elif inspect.isawaitable(result):
                    await result
                elif result is not None:
                    for item in result:
                        yield item
            finally:
                self._release(identity)

        return guarded_generator


# -- client side ------------------------------------------------------------------------------

_HANDSHAKE_MARKERS: Final = (
    "handshake",
    "certificate_verify_failed",
    "hostname verification",
    "ssl_error",
    "tsi_",
    "wrong_version_number",
    "socket closed",
    "connection reset",
)


def tls_failure_reason(err: grpc.aio.AioRpcError) -> str | None:
    """Classify a failed RPC as a TLS handshake failure, or ``None`` if it is not one.

    Reasons: ``untrusted_server``, ``hostname_mismatch``, ``server_not_tls``,
    ``refused_by_server`` (the server hung up during the handshake: with TLS 1.3 the client
    finishes first, so a refused client certificate shows up as a closed socket) and
    ``handshake_failed``.
    """
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    detail = (err.details() or "").lower()
    if not any(marker in detail for marker in _HANDSHAKE_MARKERS):
        return None
    if "certificate_verify_failed" in detail:
        return "untrusted_server"
    if "hostname verification" in detail:
        return "hostname_mismatch"
    if "wrong_version_number" in detail:
        return "server_not_tls"
    if any(m in detail for m in ("socket closed", "connection reset", "handshake read failed")):
        return "refused_by_server"
    return "handshake_failed"


_EXPLANATIONS: Final = {
    "untrusted_server": (
        "TLS handshake failed: we do not trust the server's certificate (it is not issued "
        "by our federation CA, or it has expired)"
    ),
    "hostname_mismatch": (
        "TLS handshake failed: the server's certificate does not list the host we dialled; "
        "reissue it with `peerlm ca issue ... --san <host-or-ip>`"
    ),
    "server_not_tls": (
        "TLS handshake failed: the server does not speak TLS (is it running --insecure-dev?)"
    ),
    "refused_by_server": (
        "TLS handshake failed: the server closed the connection, most likely because it did "
        "not accept our certificate (issued by another CA, expired, or none presented) or "
        "because it expects TLS and we sent plaintext"
    ),
    "handshake_failed": "TLS handshake failed",
}


def describe_rpc_error(err: grpc.aio.AioRpcError) -> str:
    """A one-line, human-readable account of a failed RPC, explaining TLS failures."""
    details = err.details() or ""
    reason = tls_failure_reason(err)
    if reason is not None:
        return f"{_EXPLANATIONS[reason]} [grpc: {details}]"
    code = err.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the server did not accept our identity: {details}"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"the server refused this call for our role: {details}"
    return f"{code.name}: {details}" if details else code.name


class TlsFailureCounter:
    """Counts client-side TLS handshake failures in ``peerlm_grpc_client_tls_failures_total``."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        self._component = component
        self._counter = get_counter(
            registry,
            "peerlm_grpc_client_tls_failures_total",
            "RPCs that failed in the TLS handshake, as seen by this client",
            ("component", "reason"),
        )

    def observe(self, err: grpc.aio.AioRpcError) -> str | None:
        """Count ``err`` if it is a handshake failure; return its reason (or ``None``)."""
        reason = tls_failure_reason(err)
        if reason is not None:
            self._counter.labels(self._component, reason).inc()
        return reason


class TlsFailureInterceptor(_UnaryUnaryClientInterceptor, _UnaryStreamClientInterceptor):
    """Client interceptor feeding :class:`TlsFailureCounter` for unary-request RPCs.

    The call is returned unchanged, so the caller still sees the original error.
    Streaming-request RPCs are not intercepted; use :meth:`TlsFailureCounter.observe`.
    """

    def __init__(self, counter: TlsFailureCounter) -> None:
        self._counter = counter

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        call = await continuation(client_call_details, request)
        try:
            await call
        except grpc.aio.AioRpcError as err:
            self._counter.observe(err)
        return call

    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        call = await continuation(client_call_details, request)
        try:
            # Handshake failures surface before the first response; don't consume messages.
            await call.wait_for_connection()
        except grpc.aio.AioRpcError as err:
            self._counter.observe(err)
        return call
