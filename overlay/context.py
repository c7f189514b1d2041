"""State shared by the parts of one :class:`~peerlm.overlay.node.OverlayNode`.

The node is split into components (zone formation, cluster roles and maintenance, search
serving, the querier); they share this context: identity, parameters, the current time,
the outbox, timers, counters, events, this node's signature and VRF tickets.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peerlm.overlay import vrf
from peerlm.overlay.events import Event, Send
from peerlm.overlay.messages import Message, NodeRef, VrfTicket, score_of
from peerlm.overlay.params import OverlayParams

if TYPE_CHECKING:
    from peerlm.overlay.signature import Signature

__all__ = ["KeyResolver", "NodeContext", "Timers", "VrfVerifier"]

KeyResolver = Callable[[str], bytes | None]
"""``node_id -> VRF public key`` bound to that node's certificate (``None``: unknown)."""

VrfVerifier = Callable[[bytes, bytes, bytes], bytes | None]
"""``(public_key, proof, alpha) -> beta | None`` (``peerlm.overlay.vrf.verify`` or a cache)."""


@dataclass(slots=True)
class _Timer:
    at: float
    seq: int
    fn: Callable[[], None]
    cancelled: bool = False


class Timers:
    """A min-heap of callbacks, ordered by (time, arming order); cancellation is lazy."""

    def __init__(self) -> None:
        # (at, seq, timer) tuples: compared in C, where an ordered dataclass's generated
        # __lt__ was a Python call per comparison (a hot spot of the simulator).
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[[], None]) -> _Timer:
        self._seq += 1
        timer = _Timer(when, self._seq, fn)
        heapq.heappush(self._heap, (when, self._seq, timer))
        return timer

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> _Timer | None:
        heap = self._heap
        while heap and (heap[0][2].cancelled or heap[0][0] <= now):
            timer = heapq.heappop(heap)[2]
            if not timer.cancelled:
                return timer
        return None

    def clear(self) -> None:
        self._heap.clear()


class NodeContext:
    """Identity, clock, outbox, timers and counters of one node."""

    def __init__(
        self,
        node_id: str,
        address: str,
        params: OverlayParams,
        secret_key: bytes,
        rng: random.Random,
        key_resolver: KeyResolver | None,
        vrf_verify: VrfVerifier | None,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.ref = NodeRef(node_id, address)
        self.params = params
        self.rng = rng
        self.counters: Counter[str] = Counter()
        self.events: list[Event] = []
        self.now = 0.0
        self.out: list[Send] = []
        self.local: list[Message] = []
        self.timers = Timers()
        self.inert = False
        self.current_kind = "-"
        self._sk = secret_key
        self.public_key = vrf.public_key(secret_key)
        self._key_resolver = key_resolver
        self._verify = vrf_verify or vrf.verify
        self._tickets: dict[int, tuple[VrfTicket, int]] = {}
        self._seeds: dict[int, bytes] = {}
        # The application's signature: current, previous (for the drift rho), P_min report.
        self.signature: Signature | None = None
        self.previous_signature: Signature | None = None
        self.p_min: int | None = None
        self.signature_round = 0

    # ------------------------------------------------------------------ output
    def send(self, ref: NodeRef, msg: Message) -> None:
        """Queue ``msg`` for ``ref``; messages to this node itself are delivered locally."""
        if ref.node_id == self.node_id:
            self.local.append(msg)
            return
        self.out.append(Send(ref.node_id, ref.address, msg))
        self.counters[f"sent.{msg.KIND}"] += 1

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def reject(self, reason: str) -> None:
        """Count a rejected input; the caller returns without changing state."""
        self.counters[f"rejected.{reason}"] += 1
        self.counters[f"rejected_kind.{self.current_kind}"] += 1
        self.counters["rejected"] += 1

    def after(self, delay: float, fn: Callable[[], None]) -> object:
        return self.timers.at(self.now + delay, fn)

    def at(self, when: float, fn: Callable[[], None]) -> object:
        return self.timers.at(when, fn)

    def jitter(self, span: float) -> float:
        """A uniform draw in ``[0, span)`` from the node's seeded rng."""
        return self.rng.random() * span

    # ------------------------------------------------------------------ VRF
    def seed(self, epoch: int) -> bytes:
        if epoch not in self._seeds:
            self._seeds[epoch] = self.params.epoch_seed(epoch)
            if len(self._seeds) > 8:
                del self._seeds[min(self._seeds)]
        return self._seeds[epoch]

    def ticket(self, epoch: int) -> VrfTicket:
        """This node's VRF ticket for ``epoch`` (proved once, then cached)."""
        return self._ticket_and_score(epoch)[0]

    def score(self, epoch: int) -> int:
        """This node's VRF score for ``epoch``."""
        return self._ticket_and_score(epoch)[1]

    def _ticket_and_score(self, epoch: int) -> tuple[VrfTicket, int]:
        if epoch not in self._tickets:
            proof = vrf.prove(self._sk, self.seed(epoch))
            ticket = VrfTicket(self.node_id, self.public_key, proof)
            self._tickets[epoch] = (ticket, score_of(vrf.proof_to_hash(proof)))
            if len(self._tickets) > 4:
                del self._tickets[min(self._tickets)]
        return self._tickets[epoch]

    def verify_ticket(
        self, ticket: VrfTicket, epoch: int, node_id: str | None = None
    ) -> int | None:
        """The score of a valid ``ticket`` for ``epoch``, else ``None`` (caller rejects).

        Valid: the ticket names ``node_id`` (when given), its key is the one bound to that
        node (when a resolver is configured), and the proof verifies on the epoch seed.
        """
        if node_id is not None and ticket.node_id != node_id:
            return None
        if self._key_resolver is not None:
            bound = self._key_resolver(ticket.node_id)
            if bound is None or bound != ticket.public_key:
                return None
        if len(ticket.public_key) != 32 or len(ticket.proof) != 80:
            return None
        beta = self._verify(ticket.public_key, ticket.proof, self.seed(epoch))
        return None if beta is None else score_of(beta)
