"""One node context per process: who it is, how it talks, what it counts.

A :class:`NodeContext` holds everything a peerlm process needs to take part in the
federation's gRPC traffic: its identity and TLS files, the security mode decided for it
(:func:`peerlm.security.mode.resolve_security`, the one decision), the gRPC limits, its
metrics registry and logger, and the sender-proof signer and checker
(:mod:`peerlm.pki.proof`). It is the only place where

* a gRPC server is assembled (:meth:`NodeContext.serve`: metrics and authorisation
  interceptors, the services, health, reflection for the admin role, limits, bind, start);
* a channel to a peer is made (:meth:`NodeContext.dial`: credentials or the loopback-only
  plaintext of insecure-dev, the dev identity, client TLS-failure counting, and the peer's
  identity every transfer from it must prove).

Functions that talk to peers take the context instead of the five to seven connection
parameters (TLS files, mode, registry, dev identity, expected peer) they took before, so
no caller can leave one out: a metric recorded "when a registry is given" is now always
recorded. The models were hivemind's ``P2P`` object (one per process, passed everywhere)
and Flower's single server factory; the code is ours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry, Counter, Gauge

from peerlm.config import GrpcLimits, ServiceSettings, TlsSettings, parse_host_port
from peerlm.metrics import get_collector, get_counter, new_registry
from peerlm.pki.identity import (
    PeerIdentity,
    Role,
    certificate_hosts,
    host_listed,
    identity_from_certificate_pem,
)
from peerlm.pki.proof import ExpectedSender, ProofSigner, SenderCheck
from peerlm.rpc import (
    MetricsInterceptor,
    add_health_and_reflection,
    create_channel,
    create_server,
    set_serving,
)
from peerlm.security.authz import (
    DEV_IDENTITY_METADATA_KEY,
    AuthInterceptor,
    TlsFailureCounter,
    TlsFailureInterceptor,
)
from peerlm.security.credentials import (
    TlsFiles,
    bind_server,
    channel_credentials,
    tls_files_from_settings,
)
from peerlm.security.mode import (
    SecurityConfigError,
    SecurityLogger,
    SecurityMode,
    is_loopback_target,
    resolve_security,
    target_host,
)

__all__ = [
    "REFLECTION_METHODS",
    "NodeContext",
    "NodeServer",
    "PeerChannel",
    "Service",
]

#: The reflection methods: reflection lists every service and method of a server, which is
#: an operator's tool, so only the ``admin`` role may call it.
REFLECTION_METHODS: Final[frozenset[str]] = frozenset(
    {
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
#: Health stays open to any authenticated member (container and peer health checks).
HEALTH_METHODS: Final[frozenset[str]] = frozenset(
    {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
)


@dataclass(frozen=True)
class Service:
    """One gRPC service to serve: its full name, servicer and generated ``add_*`` function."""

    name: str
    servicer: Any
    register: Callable[[Any, grpc.aio.Server], None]


@dataclass
class NodeServer:
    """A node's gRPC server: bound to ``port`` at once, started by :meth:`start`.

    Services are added before the start (gRPC registers nothing afterwards); health and
    reflection are added at the start and list them all. Health says NOT_SERVING until
    :meth:`serving`.
    """

    server: grpc.aio.Server
    port: int
    grace_s: float
    names: list[str] = field(default_factory=list)
    health: HealthServicer | None = None

    def add(self, service: Service) -> None:
        """Register ``service`` (before :meth:`start`)."""
        if self.health is not None:
            raise RuntimeError(f"{service.name}: services are added before the server starts")
        service.register(service.servicer, self.server)
        self.names.append(service.name)

    async def start(self) -> None:
        """Add health and reflection for every added service and start serving calls."""
        self.health = add_health_and_reflection(self.server, self.names)
        await self.server.start()

    async def serving(self, on: bool, names: Iterable[str] | None = None) -> None:
        """Report ``names`` (default: every service of this server) SERVING or NOT_SERVING."""
        assert self.health is not None, "start() the server first"
        await set_serving(self.health, self.names if names is None else names, on)

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, then stop, letting calls in flight end within the grace."""
        if self.health is not None:
            await self.serving(False)
        await self.server.stop(self.grace_s if grace_s is None else grace_s)


@dataclass
class PeerChannel:
    """A channel to one peer, the metadata our calls carry and what the peer must prove.

    ``expected`` is None where nothing is proved: insecure-dev (no certificates), or a peer
    whose messages prove themselves (overlay envelopes carry their own certificates).
    """

    channel: grpc.aio.Channel
    target: str
    metadata: tuple[tuple[str, str], ...]
    expected: ExpectedSender | None

    def verify(self, metadata: Any, kind: str, reference: str, payload: bytes) -> None:
        """Check the sender proof in a call's initial ``metadata`` (``ProofError`` if bad)."""
        if self.expected is not None:
            self.expected.verify(metadata, kind, reference, payload)

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> PeerChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


#: Calls a member of a server's expected population holds at once: two long-lived streams
#: (an agent's directive feed and its reward stream, at the CPM) and a call.
CALLS_PER_MEMBER = 3
#: Room kept for operators' admin calls and health probes above the members' share.
ADMIN_HEADROOM = 64


@dataclass(eq=False)
class NodeContext:
    """Identity, TLS, security mode, limits, metrics, logger and proofs of one process.

    Build it with :meth:`create`; a process makes exactly one and passes it to everything
    that talks to peers. ``component`` labels its metrics and log lines (``cpm``, ``agent``,
    ``overlay``, ``cli``).
    """

    component: str
    identity: PeerIdentity
    mode: SecurityMode
    tls: TlsFiles | None
    limits: GrpcLimits
    registry: CollectorRegistry
    log: Any
    signer: ProofSigner | None = None
    sender_check: SenderCheck | None = None
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    """Presented on every dialled channel; None is plaintext (insecure-dev, loopback only)."""
    tls_failures: TlsFailureCounter = field(init=False, repr=False)
    """``peerlm_grpc_client_tls_failures_total`` for this process's component."""

    def __post_init__(self) -> None:
        self.tls_failures = TlsFailureCounter(self.registry, self.component)

    @classmethod
    def create(
        cls,
        *,
        component: str,
        role: Role,
        federation: str,
        tls: TlsSettings | TlsFiles | None,
        insecure_dev: bool,
        limits: GrpcLimits,
        log: Any,
        listen: str | None = None,
        identity: PeerIdentity | None = None,
        dev_name: str | None = None,
        registry: CollectorRegistry | None = None,
    ) -> NodeContext:
        """Decide the security mode (for a server on ``listen``, or a client only), load the
        kit and the proof keys, and name the process.

        ``identity`` overrides the one read from the certificate (a caller that checked it
        further); without a certificate (insecure-dev) the identity is
        ``spiffe://<federation>/<role>/<dev_name or 'dev-' + role>``. Raises
        :class:`~peerlm.security.mode.SecurityConfigError` for an unsafe or broken setup.
        """
        files = tls_files_from_settings(tls) if isinstance(tls, TlsSettings) else tls
        if listen is not None:
            host, _ = parse_host_port(listen)
            mode = resolve_security(
                insecure_dev=insecure_dev,
                listen_host=host,
                tls=files,
                component=component,
                logger=log,
            )
        else:
            mode = _client_mode(insecure_dev, files, component, log)
        signer = check = credentials = None
        if files is not None and mode is SecurityMode.MTLS:
            bundle = files.load()
            own = identity_from_certificate_pem(bundle.cert)
            identity = identity or own
            # Sender proofs: what we stream carries our certificate's signature, and what we
            # receive must carry that of the peer we meant to reach.
            signer = ProofSigner.from_pem(bundle.cert, bundle.key)
            check = SenderCheck.from_pem(bundle.ca_cert, own.federation)
            credentials = channel_credentials(files)
        if identity is None:
            identity = PeerIdentity(federation, role, dev_name or f"dev-{role.value}")
        reg = registry if registry is not None else new_registry()
        return cls(
            component=component,
            identity=identity,
            mode=mode,
            tls=files if mode is SecurityMode.MTLS else None,
            limits=limits,
            registry=reg,
            log=log,
            signer=signer,
            sender_check=check,
            credentials=credentials,
        )

    @classmethod
    def from_settings(
        cls, settings: ServiceSettings, *, role: Role, log: Any, dev_name: str | None = None
    ) -> NodeContext:
        """The context of a process configured by ``settings`` (a server on its ``listen``);
        the component label is the role's name."""
        return cls.create(
            component=role.value,
            role=role,
            federation=settings.federation,
            tls=settings.tls,
            insecure_dev=settings.insecure_dev,
            limits=settings.limits,
            log=log,
            listen=settings.listen,
            dev_name=dev_name,
        )

    @classmethod
    def client(
        cls, tls: TlsFiles, *, role: Role, component: str = "cli", log: Any = None
    ) -> NodeContext:
        """The context of a tool that only dials with the kit ``tls`` (``peerlm status``,
        ``peerlm up``'s admin calls): default limits, and no log lines of its own unless
        ``log`` is given (the tool reports errors itself)."""
        return cls.create(
            component=component,
            role=role,
            federation="unused-with-a-certificate",
            tls=tls,
            insecure_dev=False,
            limits=GrpcLimits(),
            log=log if log is not None else _Quiet(),
        )

    # -- what others need to know -----------------------------------------------------------

    @property
    def name(self) -> str:
        """This process's name in the federation (its certificate's)."""
        return self.identity.name

    @property
    def federation(self) -> str:
        return self.identity.federation

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter in this process's registry, created on first use."""
        return get_counter(self.registry, name, documentation, labels)

    def dev_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata naming us to an insecure-dev server; empty under mTLS (the
        certificate names us, and an mTLS server ignores the key entirely)."""
        if self.mode is SecurityMode.MTLS:
            return ()
        return ((DEV_IDENTITY_METADATA_KEY, self.identity.spiffe_uri),)

    def expect(self, sender: str | Role | None) -> ExpectedSender | None:
        """The proof a transfer must carry: from agent ``sender`` by name, from any member of
        a role (e.g. ``Role.CPM``), or none (``None``, and always in insecure-dev)."""
        if self.sender_check is None or sender is None:
            return None
        if isinstance(sender, Role):
            return ExpectedSender(self.sender_check, None, self.name, sender)
        return ExpectedSender(self.sender_check, sender, self.name)

    # -- the one server factory -------------------------------------------------------------

    async def serve(
        self,
        services: Sequence[Service],
        policy: Mapping[str, frozenset[Role]],
        *,
        listen: str,
        population: int | None = None,
    ) -> NodeServer:
        """Assemble, bind and start this process's gRPC server on ``listen`` with
        ``services`` (see :meth:`bind`); health reports NOT_SERVING until
        :meth:`NodeServer.serving`."""
        server = self.bind(policy, listen=listen, population=population)
        for service in services:
            server.add(service)
        await server.start()
        return server

    def bind(
        self,
        policy: Mapping[str, frozenset[Role]],
        *,
        listen: str,
        population: int | None = None,
    ) -> NodeServer:
        """Assemble this process's gRPC server and bind it to ``listen``, not started: for a
        caller that needs the bound port before it can build its services.

        Interceptors: metrics first (so refusals by the next are counted, and oversized
        messages are refused), then authentication and ``policy`` (deny by default; health
        open to every member, reflection to ``admin`` only) and the per-identity bound on
        calls in flight (``limits.max_calls_per_identity``). Limits from the context; a
        server that expects ``population`` members holding streams (the CPM: its
        ``max_agents``, a directive feed, a reward stream and one call each) gets room for
        all of them plus :data:`ADMIN_HEADROOM` for operators and probes, whatever
        ``limits.max_concurrent_rpcs`` says.
        """
        admin_only = {method: frozenset({Role.ADMIN}) for method in REFLECTION_METHODS}
        limits = self.limits
        if population is not None:
            needed = population * CALLS_PER_MEMBER + ADMIN_HEADROOM
            if needed > limits.max_concurrent_rpcs:
                limits = limits.model_copy(update={"max_concurrent_rpcs": needed})
        server = create_server(
            limits,
            [
                MetricsInterceptor(self.registry, self.component, self.limits),
                AuthInterceptor(
                    {**admin_only, **policy},
                    federation=self.federation,
                    mode=self.mode,
                    registry=self.registry,
                    component=self.component,
                    public_methods=HEALTH_METHODS,
                    max_calls_per_identity=limits.max_calls_per_identity,
                ),
            ],
        )
        port = bind_server(server, listen, self.mode, self.tls)
        return NodeServer(server, port, self.limits.shutdown_grace_s)

    # -- the one channel factory ------------------------------------------------------------

    def dial(
        self, target: str, *, expect: str | Role | None = None, count_tls: bool = True
    ) -> PeerChannel:
        """A channel to the peer at ``target`` that must prove to be ``expect``.

        ``expect``: an agent's name, a role (any member of it, e.g. the CPM), or None for a
        peer whose messages prove themselves (see :class:`PeerChannel`). Plaintext is only
        possible in insecure-dev and only to a loopback target
        (:class:`~peerlm.security.mode.SecurityConfigError` otherwise). TLS handshake
        failures of unary calls are counted in ``peerlm_grpc_client_tls_failures_total``; a
        caller of a streaming call counts its failures with :attr:`tls_failures` where it
        handles them (a stream's handshake failure surfaces when it is read). ``count_tls``
        False leaves all counting to the caller (a hot path that counts its own failures).
        """
        if self.credentials is None and not is_loopback_target(target):
            raise SecurityConfigError(f"insecure-dev may only dial loopback targets, not {target}")
        interceptors = [_UnaryTlsFailures(self.tls_failures)] if count_tls else None
        channel = create_channel(target, self.limits, self.credentials, interceptors)
        return PeerChannel(channel, target, self.dev_metadata(), self.expect(expect))

    def channel_factory(self) -> Callable[[str], grpc.aio.Channel]:
        """``dial`` for a transport that wants a bare channel per target and counts its own
        handshake failures with :attr:`tls_failures` (the overlay's delivery pool: no
        interceptor on its many small calls)."""
        return lambda target: self.dial(target, count_tls=False).channel

    # -- start-up checks --------------------------------------------------------------------

    def check_advertised(self, address: str) -> bool:
        """Whether our certificate names the host of ``address`` (the address peers dial).

        gRPC checks a server certificate's DNS/IP SANs against the dialled host, so a
        certificate without one for the advertised host makes every inbound exchange fail
        in the peers' handshakes, where this process never sees it. Said once at start: a
        warning log line and ``peerlm_tls_advertised_host_unlisted_count`` set to 1.
        """
        if self.tls is None:
            return True
        hosts = target_host(address)
        if not hosts:
            return True
        host = hosts[0]
        cert = self.tls.load().certificate
        listed = certificate_hosts(cert)
        ok = host_listed(host, listed)
        gauge = _advertised_gauge(self.registry)
        gauge.labels(self.component, host).set(0 if ok else 1)
        if not ok:
            self.log.warning(
                "certificate_san_missing",
                advertised=address,
                certificate=str(self.tls.cert),
                sans=sorted(listed),
                fix=(
                    f"reissue the certificate with `peerlm ca issue ... --san {host}`; "
                    "peers dialling this address will fail the TLS handshake"
                ),
            )
        return ok


if TYPE_CHECKING:
    _UnaryUnaryInterceptor = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
else:
    _UnaryUnaryInterceptor = grpc.aio.UnaryUnaryClientInterceptor


class _UnaryTlsFailures(_UnaryUnaryInterceptor):
    """Counts handshake failures of unary calls (streams are counted where they are read,
    so that no failure is counted twice)."""

    def __init__(self, counter: TlsFailureCounter) -> None:
        self._inner = TlsFailureInterceptor(counter)

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await self._inner.intercept_unary_unary(continuation, client_call_details, request)


class _Quiet:
    """A logger for tools whose security decision is theirs to report."""

    def info(self, event: str, /, **kw: Any) -> None:
        return None

    def warning(self, event: str, /, **kw: Any) -> None:
        return None


def _client_mode(
    insecure_dev: bool, files: TlsFiles | None, component: str, log: SecurityLogger
) -> SecurityMode:
    """The mode of a process that only dials (no listen address to judge): dial checks
    every plaintext target for loopback itself."""
    if insecure_dev:
        if files is not None:
            raise SecurityConfigError(
                f"{component}: insecure-dev was requested but TLS files are configured too"
            )
        return SecurityMode.INSECURE_DEV
    # The same kit checks as a server's, without the listen-host rule.
    return resolve_security(
        insecure_dev=False, listen_host="127.0.0.1", tls=files, component=component, logger=log
    )


def _advertised_gauge(registry: CollectorRegistry) -> Gauge:
    return get_collector(
        Gauge,
        registry,
        "peerlm_tls_advertised_host_unlisted_count",
        "1 when this process's certificate has no SAN for the host it advertises (peers "
        "dialling it fail the TLS handshake), else 0",
        ("component", "host"),
    )
