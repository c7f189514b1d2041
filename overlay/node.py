"""``OverlayNode``: one peer of the semantic overlay as a pure state machine (sans-IO).

The node never reads a clock, opens a socket or draws from global randomness. Its host (the
in-memory simulator in :mod:`peerlm.overlay.sim`, or the gRPC transport) feeds it

* ``on_message(src_id, msg, now)`` for every message that arrived, where ``src_id`` is the
  *authenticated* sender (the certificate name on a real transport),
* ``on_tick(now)`` whenever ``now >= next_deadline()`` (timers: the diameter timeout
  ``R * t_a``, build phases, leases and heartbeats, the soft barrier ``Delta_t``),
* ``set_signature``, ``start_query``, ``join`` and ``leave`` from the application,

and delivers the returned :class:`~peerlm.overlay.events.Send` instructions. Results and
notifications are drained with ``pop_events()``.

Invalid input (a message of an epoch the node holds no state for, a VRF proof that does not
verify, a message from a node that is not a member of the cluster it talks about, a
malformed field) is rejected: the state is unchanged, nothing is sent, and
``counters["rejected.<reason>"]`` grows.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from peerlm.overlay.events import Event, Send
from peerlm.overlay.messages import Message, NodeRef
from peerlm.overlay.params import OverlayParams

if TYPE_CHECKING:
    from peerlm.overlay.signature import Signature

__all__ = ["KeyResolver", "OverlayNode", "VrfVerifier"]

KeyResolver = Callable[[str], bytes | None]
"""``node_id -> VRF public key`` bound to that node's certificate (``None``: unknown)."""

VrfVerifier = Callable[[bytes, bytes, bytes], bytes | None]
"""``(public_key, proof, alpha) -> beta | None`` (``peerlm.overlay.vrf.verify`` or a cache)."""


class OverlayNode:
    """One overlay peer: member, and possibly zone initiator and super-peer at any level.

    Args:
        node_id: this node's identity (its certificate name).
        address: opaque transport address other nodes use to reach it.
        params: the overlay's parameters (must agree network-wide).
        vrf_secret_key: 32-byte ECVRF secret key; the public key is derived from it.
        rng: seeded randomness (an ``int`` seed or a ``random.Random``); the only source
            of randomness the node uses (jitter of timers, sampling).
        key_resolver: maps a node id to its certificate-bound VRF public key. Tickets whose
            key differs are rejected. ``None`` trusts the key carried in the ticket (only
            for tests of the core alone).
        vrf_verify: proof verifier (default :func:`peerlm.overlay.vrf.verify`); the
            simulator passes a memoising wrapper.
    """

    def __init__(
        self,
        node_id: str,
        address: str,
        params: OverlayParams,
        vrf_secret_key: bytes,
        *,
        rng: random.Random | int = 0,
        key_resolver: KeyResolver | None = None,
        vrf_verify: VrfVerifier | None = None,
    ) -> None:
        if not node_id:
            raise ValueError("node_id must be non-empty")
        if len(vrf_secret_key) != 32:
            raise ValueError("vrf_secret_key must be 32 bytes")
        self.node_id = node_id
        self.address = address
        self.params = params
        self.counters: Counter[str] = Counter()
        self._rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self._sk = vrf_secret_key
        self._key_resolver = key_resolver
        self._vrf_verify = vrf_verify
        self._events: list[Event] = []

    # ------------------------------------------------------------------ identity
    @property
    def ref(self) -> NodeRef:
        """This node's :class:`NodeRef`."""
        return NodeRef(self.node_id, self.address)

    # ------------------------------------------------------------------ inputs
    def on_message(self, src_id: str, msg: Message, now: float) -> list[Send]:
        """Handle one message from the authenticated sender ``src_id``."""
        raise NotImplementedError

    def on_tick(self, now: float) -> list[Send]:
        """Fire every timer due at ``now`` (call when ``now >= next_deadline()``)."""
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        """The earliest time ``on_tick`` has work to do (``None``: no timer armed)."""
        raise NotImplementedError

    def set_neighbours(self, refs: list[NodeRef], now: float) -> list[Send]:
        """Replace the physical neighbour set (at most ``d_max`` are kept)."""
        raise NotImplementedError

    def set_signature(self, sig: Signature, now: float, p_min: int | None = None) -> list[Send]:
        """Publish this round's signature (and optionally this node's ``P_min``).

        Before the build the signature is what the zone initiator's SigProbe collects; once
        placed, it is pushed to the leaf cluster's replicas so searches score fresh values.
        """
        raise NotImplementedError

    def start_query(self, k: int, now: float) -> tuple[str, list[Send]]:
        """Ask the overlay for the ``k`` peers most similar to this node's signature.

        Returns the query id; the answer arrives as a
        :class:`~peerlm.overlay.events.QueryCompleted` event (at the latest after
        ``Delta_t``). Raises ``ValueError`` without a signature or with ``k`` out of range.
        """
        raise NotImplementedError

    def join(self, bootstrap: list[NodeRef], now: float) -> list[Send]:
        """Enter the overlay through ``bootstrap`` peers (neighbours and join entry).

        Before an epoch's build the node simply takes part in it; once a tree exists the
        request is forwarded to the root and placed top-down (Sec. 3.7).
        """
        raise NotImplementedError

    def leave(self, now: float) -> list[Send]:
        """Graceful leave: resign primaries, notify leaf replicas; the node goes inert."""
        raise NotImplementedError

    # ------------------------------------------------------------------ outputs
    def pop_events(self) -> list[Event]:
        """Events since the last call (query results, role changes, takeovers)."""
        events, self._events = self._events, []
        return events

    def describe(self) -> Mapping[str, Any]:
        """Role, level, zone, cluster, parent and children of this node, for metrics."""
        raise NotImplementedError
