"""The real-process transport of the overlay: one :class:`OverlayNode` on asyncio and gRPC.

The protocol core is sans-IO; this module is the thin adapter around it (DESIGN principle 1):

* :class:`OverlayHost` owns the node. Every input (a delivered batch, a timer, the
  application's ``set_signature``/``search``/``join``/``leave``) runs synchronously on the
  event-loop thread, so the core never sees two calls at once; the ``Send`` instructions it
  returns go to the :class:`PeerPool`, its events to the host application (an asyncio
  queue, listeners, and the futures of pending searches).
* A timer task drives ``on_tick`` at ``next_deadline()``: it sleeps until the absolute
  deadline (recomputed after every input, which may arm an earlier timer), so the schedule
  does not drift with the time a tick takes.
* :class:`PeerPool` delivers: one bounded queue and one worker per destination, batches of
  consecutive messages in one ``Deliver`` call with a deadline, retries with exponential
  backoff on transient failures (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``,
  ``RESOURCE_EXHAUSTED``), and drop-and-count on anything else, on overflow and on age.
  The pool holds at most ``max_peers`` channels (least recently used is closed first).
  Loss is fine: the protocol tolerates loss, duplication and reordering.
* :class:`KeyDirectory` is the node's key resolver: ``node id -> VRF public key`` taken
  only from certificates issued by the federation CA, either the one the TLS handshake
  verified on an incoming call (``x509_pem_cert``) or one attached to a relayed VRF ticket
  and verified here (chain, validity, federation, role, name). A VRF proof is therefore
  always verified against the key certified for the node it names.

Clock: the core's schedule (epochs, build phases) is absolute, and every node of an overlay
must agree on it, so the host feeds ``wall-clock time at start + monotonic time since``:
Unix seconds as synchronised by NTP across hosts, yet never going backwards within a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from peerlm.overlay import codec
from peerlm.overlay.dialcheck import AddressCheck, AddressVerifier
from peerlm.overlay.events import Event, LeaseTakeover, QueryCompleted, Send
from peerlm.overlay.messages import Candidate, Message, NodeRef
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.signature import Signature

from peerlm.pki.identity import PeerIdentity, Role
from peerlm.pki.proof import ProofError, verify_member_certificate
from peerlm.security.authz import TlsFailureCounter, describe_rpc_error
from peerlm.wire.v1 import overlay_pb2, overlay_pb2_grpc

__all__ = [
    "CertificateRefused",
    "DeliveryPolicy",
    "KeyDirectory",
    "OverlayClock",
    "OverlayHost",
    "PeerPool",
]

#: Roles whose certificates may speak for an overlay node.
NODE_ROLES: Final = frozenset({Role.AGENT, Role.OVERLAY})

_RETRYABLE: Final = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class OverlayClock:
    """Unix time at construction, advanced by the monotonic clock (never goes backwards)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall0 = wall()
        self._mono0 = time.monotonic()

    def __call__(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0)


# --------------------------------------------------------------------------- keys


class CertificateRefused(ValueError):
    """An attached certificate does not bind the named node to a VRF key of ours."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class _KeyEntry:
    key: bytes
    der: bytes
    not_before: datetime


class KeyDirectory:
    """Certified VRF keys by node id, bounded (least recently used entries go first).

    Args:
        federation: only identities of this federation are admitted.
        ca_certificate: the federation CA that must have issued attached certificates
            (``None``: attached certificates are refused; keys come only from handshakes).
        own: this node's ``(name, vrf public key, certificate DER)``; pinned.
        capacity: most entries kept besides our own.
        now: the current time, for the validity window of attached certificates.
    """

    def __init__(
        self,
        *,
        federation: str,
        ca_certificate: x509.Certificate | None,
        own: tuple[str, bytes, bytes | None],
        capacity: int = 4096,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._federation = federation
        self._ca = ca_certificate
        self._own_name, self._own_key, self._own_der = own
        self._capacity = capacity
        self._now = now
        self._entries: OrderedDict[str, _KeyEntry] = OrderedDict()
        self._pem_seen: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, node_id: str) -> bytes | None:
        """The VRF public key certified for ``node_id`` (the core's ``KeyResolver``)."""
        if node_id == self._own_name:
            return self._own_key
        entry = self._entries.get(node_id)
        if entry is None:
            return None
        self._entries.move_to_end(node_id)
        return entry.key

    def certificate(self, node_id: str) -> bytes | None:
        """DER certificate of ``node_id`` to attach to its relayed tickets, if known."""
        if node_id == self._own_name:
            return self._own_der
        entry = self._entries.get(node_id)
        return None if entry is None else entry.der

    def learn_authenticated(self, identity: PeerIdentity, pem: bytes | None) -> None:
        """Record the key of a peer whose certificate the TLS handshake just verified."""
        if identity.vrf_public_key is None or identity.role not in NODE_ROLES:
            return
        if identity.name == self._own_name or pem is None:
            return
        if self._pem_seen.get(identity.name) == pem and identity.name in self._entries:
            self._entries.move_to_end(identity.name)
            return
        cert = x509.load_pem_x509_certificate(pem)
        self._store(
            identity.name,
            _KeyEntry(
                identity.vrf_public_key, cert.public_bytes(Encoding.DER), cert.not_valid_before_utc
            ),
        )
        self._pem_seen[identity.name] = pem
        if len(self._pem_seen) > self._capacity:
            self._pem_seen.pop(next(iter(self._pem_seen)))

    def admit(self, node_id: str, der: bytes) -> None:
        """Verify a certificate attached to a relayed ticket of ``node_id`` and keep its key.

        Raises :class:`CertificateRefused` (reason ``bad_certificate``) when it does not
        parse, was not issued by the federation CA, is outside its validity window, names
        another federation, role or node, or certifies no VRF key.
        """
        known = self._entries.get(node_id)
        if node_id == self._own_name or (known is not None and known.der == der):
            return
        if self._ca is None:
            raise CertificateRefused("bad_certificate", "this node accepts no certificates")
        try:
            identity, cert = verify_member_certificate(
                der, self._ca, federation=self._federation, now=self._now()
            )
        except ProofError as err:
            raise CertificateRefused(
                "bad_certificate", f"certificate attached for {node_id!r}: {err}"
            ) from None
        if identity.role not in NODE_ROLES:
            raise CertificateRefused(
                "bad_certificate",
                f"certificate attached for {node_id!r} is {identity.spiffe_uri}, not an overlay "
                f"node of federation {self._federation!r}",
            )
        if identity.name != node_id or identity.vrf_public_key is None:
            raise CertificateRefused(
                "bad_certificate",
                f"certificate attached for {node_id!r} names {identity.name!r} or has no VRF key",
            )
        if known is not None and known.not_before > cert.not_valid_before_utc:
            return  # we hold a newer certificate of that node; keep its key
        self._store(node_id, _KeyEntry(identity.vrf_public_key, der, cert.not_valid_before_utc))

    def _store(self, node_id: str, entry: _KeyEntry) -> None:
        self._entries[node_id] = entry
        self._entries.move_to_end(node_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


# --------------------------------------------------------------------------- delivery


@dataclass(frozen=True, slots=True)
class DeliveryPolicy:
    """Bounds of outgoing delivery (every one a setting, see docs/configuration.md)."""

    max_peers: int = 256
    """Destinations with an open channel; the least recently used is closed beyond this."""
    queue_depth: int = 1024
    """Messages waiting per destination; further ones are dropped (``queue_full``)."""
    max_batch: int = 64
    """Messages per Deliver call."""
    max_batch_bytes: int = 3 * 1024 * 1024
    """Encoded bytes per Deliver call (below the gRPC message limit)."""
    timeout_s: float = 2.0
    """Deadline of one Deliver call."""
    retries: int = 3
    """Further attempts after a transient failure."""
    backoff_s: float = 0.05
    """First retry delay; doubled on every further attempt."""
    max_age_s: float = 5.0
    """A message waiting longer than this is dropped (``stale``) rather than sent late."""


@dataclass
class _Peer:
    node_id: str
    address: str
    channel: grpc.aio.Channel
    stub: Any  # grpc.aio stub (the generated stubs type it as a synchronous one)
    queue: deque[tuple[float, Message]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
    failing: bool = False
    certified: bool = False


ChannelFactory = Callable[[str], grpc.aio.Channel]


class PeerPool:
    """Per-destination queues and workers delivering ``Send`` instructions over gRPC."""

    def __init__(
        self,
        sender_id: str,
        channel_factory: ChannelFactory,
        policy: DeliveryPolicy,
        metrics: OverlayMetrics,
        log: Any,
        *,
        certificate_for: codec.CertificateLookup | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        tls_failures: TlsFailureCounter | None = None,
        verify_address: AddressVerifier | None = None,
    ) -> None:
        self._sender = sender_id
        # With a verifier, nothing is sent to an address until the server there proved to
        # hold the destination's certificate (peerlm.overlay.dialcheck); None only where
        # there are no certificates (insecure-dev).
        self._verify = verify_address
        self._factory = channel_factory
        self._policy = policy
        self._m = metrics
        self._log = log
        self._certificate_for = certificate_for
        self._metadata = metadata
        self._tls_failures = tls_failures
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._closing = False
        self._closers: set[asyncio.Task[None]] = set()

    @property
    def size(self) -> int:
        """Destinations with an open channel."""
        return len(self._peers)

    @property
    def queued(self) -> int:
        """Messages waiting in all queues."""
        return sum(len(p.queue) for p in self._peers.values())

    def send(self, dst_id: str, address: str, msg: Message) -> None:
        """Queue ``msg`` for ``dst_id`` at ``address`` (never blocks, never raises)."""
        if self._closing:
            self._m.dropped.labels(msg.KIND, "closing").inc()
            return
        try:
            peer = self._peer(dst_id, address)
        except (ValueError, OSError) as err:  # e.g. a target insecure-dev may not dial
            self._m.dropped.labels(msg.KIND, "refused").inc()
            self._log.warning("overlay_cannot_dial", peer=dst_id, address=address, error=str(err))
            return
        if len(peer.queue) >= self._policy.queue_depth:
            self._m.dropped.labels(msg.KIND, "queue_full").inc()
            return
        peer.queue.append((time.monotonic(), msg))
        if peer.task is None:
            peer.task = asyncio.get_running_loop().create_task(self._drain(peer))

    def _peer(self, dst_id: str, address: str) -> _Peer:
        peer = self._peers.get(dst_id)
        if peer is not None and peer.address == address:
            self._peers.move_to_end(dst_id)
            return peer
        carried: deque[tuple[float, Message]] = deque()
        if peer is not None:
            # The node moved: keep what was queued for it and dial the new address.
            carried = peer.queue
            peer.queue = deque()
            self._retire(peer)
        channel = self._factory(address)
        fresh = _Peer(dst_id, address, channel, overlay_pb2_grpc.OverlayStub(channel))  # type: ignore[no-untyped-call]
        fresh.queue = carried
        self._peers[dst_id] = fresh
        while len(self._peers) > self._policy.max_peers:
            self._evict()
        if carried and fresh.task is None:
            fresh.task = asyncio.get_running_loop().create_task(self._drain(fresh))
        return fresh

    def _evict(self) -> None:
        idle = next((p for p in self._peers.values() if not p.queue and p.task is None), None)
        victim = idle or next(iter(self._peers.values()))
        for _, msg in victim.queue:
            self._m.dropped.labels(msg.KIND, "evicted").inc()
        victim.queue.clear()
        self._retire(victim)

    def _retire(self, peer: _Peer) -> None:
        if self._peers.get(peer.node_id) is peer:
            del self._peers[peer.node_id]
        if peer.task is not None:
            peer.task.cancel()
        closer = asyncio.get_running_loop().create_task(peer.channel.close(None))
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)

    async def _certify(self, peer: _Peer) -> bool:
        """Whether ``peer``'s address is certified for it; drops its queue when not."""
        if self._verify is None or peer.certified:
            return True
        for attempt in range(self._policy.retries + 1):
            check = await self._verify(peer.node_id, peer.address)
            if check is AddressCheck.CERTIFIED:
                peer.certified = True
                return True
            if check is AddressCheck.MISMATCH or self._closing:
                break
            if attempt < self._policy.retries:
                self._m.retries.inc()
                await asyncio.sleep(self._policy.backoff_s * (2**attempt))
        reason = "unverified_address" if check is AddressCheck.MISMATCH else "unavailable"
        for _, msg in peer.queue:
            self._m.dropped.labels(msg.KIND, reason).inc()
        peer.queue.clear()
        self._log.warning(
            "overlay_address_refused", peer=peer.node_id, address=peer.address, reason=reason
        )
        if check is AddressCheck.MISMATCH:
            # Forget the claim: a later send for this node dials (and checks) afresh. This
            # runs in the peer's own task, which ends right after; do not cancel it.
            peer.task = None
            self._retire(peer)
        return False

    async def _drain(self, peer: _Peer) -> None:
        try:
            if not await self._certify(peer):
                return
            while peer.queue:
                batch = self._take(peer)
                if not batch:
                    continue
                try:
                    await self._deliver(peer, batch)
                except Exception:  # a bug must not leave this queue without a worker
                    for kind, _ in batch:
                        self._m.dropped.labels(kind, "internal").inc()
                    self._log.exception("overlay_delivery_error", peer=peer.node_id)
        except asyncio.CancelledError:
            for _, msg in peer.queue:
                self._m.dropped.labels(msg.KIND, "closing").inc()
            peer.queue.clear()
            raise
        finally:
            peer.task = None

    def _take(self, peer: _Peer) -> list[tuple[str, overlay_pb2.OverlayMessage]]:
        batch: list[tuple[str, overlay_pb2.OverlayMessage]] = []
        size = 0
        oldest = time.monotonic() - self._policy.max_age_s
        while peer.queue and len(batch) < self._policy.max_batch:
            queued_at, msg = peer.queue[0]
            if queued_at < oldest:
                peer.queue.popleft()
                self._m.dropped.labels(msg.KIND, "stale").inc()
                continue
            try:
                pb = codec.encode_message(
                    msg, sender=self._sender, certificate_for=self._certificate_for
                )
            except Exception as err:  # CodecError, or a bug: drop this message, keep going
                peer.queue.popleft()
                self._m.dropped.labels(msg.KIND, "unencodable").inc()
                self._log.error("overlay_unencodable", kind=msg.KIND, error=str(err))
                continue
            cost = pb.ByteSize() + 8
            if cost > self._policy.max_batch_bytes:
                peer.queue.popleft()
                self._m.dropped.labels(msg.KIND, "oversized").inc()
                self._log.error("overlay_message_too_large", kind=msg.KIND, bytes=cost)
                continue
            if batch and size + cost > self._policy.max_batch_bytes:
                break
            peer.queue.popleft()
            batch.append((msg.KIND, pb))
            size += cost
        return batch

    async def _deliver(
        self, peer: _Peer, batch: list[tuple[str, overlay_pb2.OverlayMessage]]
    ) -> None:
        env = overlay_pb2.OverlayEnvelope(recipient=peer.node_id)
        env.messages.extend(pb for _, pb in batch)
        for attempt in range(self._policy.retries + 1):
            try:
                await peer.stub.Deliver(
                    env, timeout=self._policy.timeout_s, metadata=self._metadata or None
                )
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if self._tls_failures is not None:
                    self._tls_failures.observe(err)
                if code in _RETRYABLE and attempt < self._policy.retries and not self._closing:
                    self._m.retries.inc()
                    await asyncio.sleep(self._policy.backoff_s * (2**attempt))
                    continue
                reason = code.name.lower()
                for kind, _ in batch:
                    self._m.dropped.labels(kind, reason).inc()
                if not peer.failing or code not in _RETRYABLE:
                    self._log.warning(
                        "overlay_delivery_failed",
                        peer=peer.node_id,
                        address=peer.address,
                        messages=len(batch),
                        reason=reason,
                        error=describe_rpc_error(err),
                    )
                peer.failing = True
                return
            if peer.failing:
                self._log.info("overlay_delivery_restored", peer=peer.node_id)
                peer.failing = False
            for kind, _ in batch:
                self._m.sent.labels(kind).inc()
            return

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every queue is empty."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tasks = [p.task for p in self._peers.values() if p.task is not None]
            if not tasks:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(asyncio.gather(*tasks, return_exceptions=True)),
                    max(0.0, deadline - time.monotonic()),
                )

    async def close(self) -> None:
        """Drop what is queued, stop the workers and close every channel."""
        self._closing = True
        for peer in list(self._peers.values()):
            self._retire(peer)
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)


# --------------------------------------------------------------------------- the host

EventListener = Callable[[Event], None]


class OverlayHost:
    """Runs one :class:`OverlayNode` on the event loop and exposes it to the application.

    Create it inside a running event loop, then :meth:`start` it. All methods must be called
    from the loop's thread.
    """

    def __init__(
        self,
        node: OverlayNode,
        pool: PeerPool,
        metrics: OverlayMetrics,
        log: Any,
        *,
        clock: Callable[[], float] | None = None,
        event_queue_depth: int = 1024,
        metrics_interval_s: float = 1.0,
    ) -> None:
        self.node = node
        self._pool = pool
        self._m = metrics
        self._log = log
        self._clock = clock or OverlayClock()
        self._events: asyncio.Queue[Event] = asyncio.Queue(maxsize=event_queue_depth)
        self._listeners: list[EventListener] = []
        self._queries: dict[str, asyncio.Future[QueryCompleted]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_interval = metrics_interval_s
        self._has_signature = False
        self._stopped = False

    # ------------------------------------------------------------------ properties
    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def address(self) -> str:
        return self.node.address

    @property
    def has_signature(self) -> bool:
        """Whether this node publishes a signature (else it routes but is never a result)."""
        return self._has_signature

    def now(self) -> float:
        """The clock the core is fed."""
        return self._clock()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the timer and metrics tasks."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._timer_loop(), name="overlay-timer"),
            loop.create_task(self._metrics_loop(), name="overlay-metrics"),
        ]

    async def stop(self, grace_s: float = 2.0) -> None:
        """Leave gracefully (resign primaries, tell the leaf cluster), deliver that for at
        most ``grace_s`` seconds, then stop every task and channel."""
        if self._stopped:
            return
        self._call("leave", self.node.leave)
        await self._pool.flush(grace_s)
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._queries.values():
            if not fut.done():
                fut.cancel()
        await self._pool.close()
        self._observe()

    # ------------------------------------------------------------------ application
    def join(self, bootstrap: Sequence[NodeRef]) -> None:
        """Enter the overlay through ``bootstrap`` peers."""
        self._call("join", lambda now: self.node.join(list(bootstrap), now))

    @property
    def signature(self) -> Signature | None:
        """The signature this node last published (None before the first): what its
        searches are scored against."""
        return self.node.ctx.signature

    def set_signature(self, sig: Signature, p_min: int | None = None) -> None:
        """Publish this round's signature; raises ``ValueError`` if the core refuses it."""
        self._call("set_signature", lambda now: self.node.set_signature(sig, now, p_min), True)
        self._has_signature = True

    async def search(self, k: int, timeout: float | None = None) -> QueryCompleted:
        """Top-``k`` search from this node's signature; the full :class:`QueryCompleted`.

        Raises ``ValueError`` (no signature, ``k`` out of range, node left) and
        ``TimeoutError`` when no completion arrives within ``timeout`` (default: the
        soft barrier plus a margin; the core completes every query by then).
        """
        if self._stopped:
            raise ValueError("the overlay host is stopped")
        now = self._clock()
        try:
            qid, sends = self.node.start_query(k, now)
        except ValueError:
            raise
        except Exception:
            self._m.core_errors.labels("start_query").inc()
            self._log.exception("overlay_core_error", operation="start_query")
            raise
        fut: asyncio.Future[QueryCompleted] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        self._after(sends)
        limit = timeout if timeout is not None else self.node.params.query_timeout * 2 + 5.0
        try:
            return await asyncio.wait_for(fut, limit)
        finally:
            self._queries.pop(qid, None)

    async def query(self, k: int, timeout: float | None = None) -> list[Candidate]:
        """The ``k`` peers most similar to this node: ``(node_id, address, similarity)``,
        best first (:meth:`search` without the statistics)."""
        return list((await self.search(k, timeout)).results)

    def events(self) -> asyncio.Queue[Event]:
        """Every event of the core, in order (bounded: the oldest is dropped when full)."""
        return self._events

    def add_listener(self, listener: EventListener) -> None:
        """Call ``listener(event)`` for every event (on the loop thread; must not block)."""
        self._listeners.append(listener)

    def describe(self) -> Mapping[str, Any]:
        """The core's description of this node, plus transport facts."""
        out = dict(self.node.describe())
        out.setdefault("address", self.address)
        out["has_signature"] = self._has_signature
        out["client_peers"] = self._pool.size
        return out

    # ------------------------------------------------------------------ transport input
    def deliver(self, src_id: str, msgs: Iterable[Message]) -> int:
        """Hand messages from the authenticated ``src_id`` to the core, in order."""
        count = 0
        for msg in msgs:
            self._m.received.labels(msg.KIND).inc()
            self._call("on_message", functools.partial(self._on_message, src_id, msg))
            count += 1
        return count

    def _on_message(self, src_id: str, msg: Message, now: float) -> list[Send]:
        return self.node.on_message(src_id, msg, now)

    # ------------------------------------------------------------------ internals
    def _call(
        self, operation: str, fn: Callable[[float], list[Send]], reraise: bool = False
    ) -> None:
        if self._stopped:
            return
        try:
            sends = fn(self._clock())
        except ValueError:
            if reraise:
                raise
            self._m.core_errors.labels(operation).inc()
            self._log.exception("overlay_core_error", operation=operation)
            return
        except Exception:
            self._m.core_errors.labels(operation).inc()
            self._log.exception("overlay_core_error", operation=operation)
            return
        self._after(sends)

    def _after(self, sends: list[Send]) -> None:
        for send in sends:
            if send.dst_id == self.node_id:
                self._m.dropped.labels(send.msg.KIND, "self").inc()
                continue
            self._pool.send(send.dst_id, send.dst_address, send.msg)
        for event in self.node.pop_events():
            try:
                self._on_event(event)
            except Exception:  # an event must never take the timer or a call down
                self._log.exception("overlay_event_failed", kind=type(event).__name__)
        self._wake.set()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, QueryCompleted):
            self._m.observe_query(event)
            self._log.info(
                "overlay_query_completed",
                qid=event.qid,
                round=event.round,
                complete=event.complete,
                results=len(event.results),
                latency_s=round(event.latency, 4),
                tau=round(event.tau, 4),
                prototypes=event.stats.prototypes,
                members=event.stats.members,
                visited=event.stats.visited,
                failed_branches=event.stats.failed_branches,
            )
            fut = self._queries.get(event.qid)
            if fut is not None and not fut.done():
                fut.set_result(event)
        elif isinstance(event, LeaseTakeover):
            self._m.observe_takeover(event)
            self._log.info(
                "overlay_takeover",
                cluster=event.cluster_id,
                level=event.level,
                previous=event.previous_primary,
                reason=event.reason,
                epoch=event.epoch,
            )
        else:
            self._log.info("overlay_event", kind=type(event).__name__, **_fields(event))
        if self._events.full():
            self._events.get_nowait()
        self._events.put_nowait(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                self._log.exception("overlay_listener_failed")

    async def _timer_loop(self) -> None:
        while not self._stopped:
            try:
                deadline = self.node.next_deadline()
            except Exception:
                self._m.core_errors.labels("next_deadline").inc()
                self._log.exception("overlay_core_error", operation="next_deadline")
                deadline = self._clock() + 1.0  # keep ticking; the error is counted
            now = self._clock()
            if deadline is not None and now >= deadline:
                self._call("on_tick", self.node.on_tick)
                # Let deliveries and calls run between bursts of due timers.
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            delay = None if deadline is None else deadline - now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _metrics_loop(self) -> None:
        while not self._stopped:
            self._observe()
            await asyncio.sleep(self._metrics_interval)

    def _observe(self) -> None:
        try:
            self._m.observe_node(self.node.describe(), self.node.counters)
        except Exception:
            self._m.core_errors.labels("describe").inc()
            self._log.exception("overlay_core_error", operation="describe")
        self._m.peers.set(self._pool.size)
        self._m.queued.set(self._pool.queued)


def _fields(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in getattr(event, "__slots__", ()):
        value = getattr(event, name, None)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
