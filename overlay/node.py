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
from collections.abc import Mapping
from typing import Any

from peerlm.overlay.context import KeyResolver, NodeContext, VrfVerifier
from peerlm.overlay.dispatch import Dispatcher, Handler, Route
from peerlm.overlay.events import Event, RoleChanged, Send
from peerlm.overlay.hierarchy import ClusterRole
from peerlm.overlay.maintenance import Roles
from peerlm.overlay.membership import Membership
from peerlm.overlay.messages import (
    ClusterDescriptor,
    ClusterState,
    DescriptorUpdate,
    ElectionTicket,
    EpochAnnounce,
    Heartbeat,
    JoinRequest,
    LeaseAck,
    LeaseRenew,
    Leave,
    MemberAssign,
    Message,
    Neighbor,
    NodeRef,
    ParentUpdate,
    PeerExchange,
    Probe,
    Query,
    QueryDown,
    QueryPartial,
    QueryResult,
    Register,
    Resign,
    SignatureUpdate,
    SigProbe,
    SigReply,
    Split,
    Takeover,
    ZoneInfo,
    ZoneInfoRequest,
)
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.peers import Neighbours
from peerlm.overlay.querier import Querier
from peerlm.overlay.search import SearchServer
from peerlm.overlay.signature import Signature
from peerlm.overlay.zones import ZoneFormation

__all__ = ["KeyResolver", "OverlayNode", "VrfVerifier"]

_MAX_LOCAL_STEPS = 10_000


class OverlayNode:
    """One overlay peer: member, and possibly zone initiator and super-peer at any level.

    Args:
        node_id: this node's identity (its certificate name).
        address: opaque transport address other nodes use to reach it.
        params: the overlay's parameters (must agree network-wide).
        vrf_secret_key: 32-byte ECVRF secret key; the public key is derived from it.
        rng: seeded randomness (an ``int`` seed or a ``random.Random``); the only source
            of randomness the node uses (timer jitter).
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
        rnd = rng if isinstance(rng, random.Random) else random.Random(rng)
        self.ctx = NodeContext(
            node_id, address, params, vrf_secret_key, rnd, key_resolver, vrf_verify
        )
        self.node_id = node_id
        self.address = address
        self.params = params
        self.peers = Neighbours(self.ctx)
        self._started = False
        self._scheduled: set[int] = set()
        self.membership = Membership(self.ctx, lambda: self.peers.refs)
        self.zones = ZoneFormation(self.ctx, lambda: self.peers.refs, self._roles_changed)
        self.roles = Roles(
            self.ctx,
            self._roles_changed,
            self._on_announce,
            self.membership.root,
            self.membership.leaf,
            self.membership.on_takeover,
            lambda: self.peers.refs,
        )
        self.search = SearchServer(
            self.ctx,
            self.roles.get,
            self.roles.root_role,
            self._top_role,
            self.membership.root,
            self.membership.leaf,
        )
        self.querier = Querier(
            self.ctx,
            self._query_entry,
            self.membership.note_root,
            self._depth,
            self.peers.by_recency,
        )
        self._last_roles: tuple[str, ...] = ()
        self._dispatcher = Dispatcher(self._routes(), self._unowned)

    def _routes(self) -> list[Route]:
        """The dispatch table: every routing key and its one owner (see
        :mod:`peerlm.overlay.dispatch`)."""
        roles = self.roles
        table: list[tuple[type[Any] | str, str, Handler]] = [
            (PeerExchange, "peers", self.peers.on_exchange),
            (ElectionTicket, "zones", self.zones.on_election),
            (Probe, "zones", self.zones.on_probe),
            (Register, "zones", self.zones.on_register),
            (Neighbor, "zones", self.zones.on_neighbor),
            (Split, "zones", self.zones.on_split),
            (ZoneInfoRequest, "zones", self.zones.on_zone_info_request),
            (ZoneInfo, "zones", self.zones.on_zone_info),
            (SigProbe, "zones", self.zones.on_sig_probe),
            (SigReply, "zones", self.zones.on_sig_reply),
            (MemberAssign, "membership", self.membership.on_member_assign),
            ("HEARTBEAT_ACK/leaf", "membership", self.membership.on_heartbeat_ack),
            ("JOIN_ACCEPT/member", "membership", self.membership.on_join_accept),
            (ClusterState, "roles.sync", roles.sync.on_cluster_state),
            (ParentUpdate, "roles.sync", roles.sync.on_parent_update),
            (EpochAnnounce, "roles.announce", roles.announce.on_epoch_announce),
            (LeaseRenew, "roles.leases", roles.leases.on_lease_renew),
            (LeaseAck, "roles.leases", roles.leases.on_lease_ack),
            (Takeover, "roles.leases", roles.leases.on_takeover),
            (Resign, "roles.leases", roles.leases.on_resign),
            (Heartbeat, "roles.links", roles.links.on_heartbeat),
            ("HEARTBEAT_ACK/parent", "roles.links", roles.links.on_heartbeat_ack),
            (DescriptorUpdate, "roles.links", roles.links.on_descriptor_update),
            (SignatureUpdate, "roles.links", roles.links.on_signature_update),
            (Leave, "roles.links", roles.links.on_leave),
            (JoinRequest, "roles.placement", roles.placement.on_join),
            ("JOIN_ACCEPT/cluster", "roles.placement", roles.placement.on_join_accept),
            (Query, "search", self.search.on_query),
            (QueryDown, "search", self.search.on_query_down),
            ("QUERY_ACK/child", "search", self.search.on_query_ack),
            (QueryPartial, "search", self.search.on_query_partial),
            ("QUERY_ACK/root", "querier", self.querier.on_ack),
            (QueryResult, "querier", self.querier.on_result),
        ]
        return [
            Route(key if isinstance(key, str) else key.KIND, owner, handler)
            for key, owner, handler in table
        ]

    def _unowned(self, key: str) -> None:
        # A kind the wire decoder knows but no component owns (or an object that is no
        # message at all): count it under its own key and drop it.
        self.ctx.reject("unowned_kind")
        self.ctx.counters[f"unowned.{key}"] += 1

    # ------------------------------------------------------------------ identity
    @property
    def ref(self) -> NodeRef:
        """This node's :class:`NodeRef`."""
        return self.ctx.ref

    @property
    def counters(self) -> Counter[str]:
        """Messages sent per kind, rejections per reason, protocol events."""
        return self.ctx.counters

    @property
    def public_key(self) -> bytes:
        """The VRF public key (bound to this node's certificate on a real transport)."""
        return self.ctx.public_key

    @property
    def message_owners(self) -> Mapping[str, str]:
        """Routing key -> the component that owns it (:mod:`peerlm.overlay.dispatch`)."""
        return self._dispatcher.owners

    # ------------------------------------------------------------------ plumbing
    def _begin(self, now: float) -> None:
        if now < self.ctx.now:
            raise ValueError(f"time went backwards: {now} < {self.ctx.now}")
        self.ctx.now = now
        if not self._started:
            self._started = True
            epoch = max(0, self.params.epoch_of(now))
            if now <= self.params.level_start(epoch, 1):
                self._schedule_epoch(epoch)
            else:
                self._schedule_epoch(epoch + 1)

    def _schedule_epoch(self, epoch: int) -> None:
        if epoch in self._scheduled:
            return
        self._scheduled.add(epoch)
        params = self.params
        self.zones.schedule_epoch(epoch)
        self.ctx.at(
            params.level_start(epoch, 2) + params.hop_time, lambda: self._after_level1(epoch)
        )
        self.ctx.at(params.epoch_start(epoch + 1), lambda: self._schedule_epoch(epoch + 1))

    def _after_level1(self, epoch: int) -> None:
        self.membership.check_placed(epoch)

    def _drain(self) -> list[Send]:
        steps = 0
        while self.ctx.local and not self.ctx.inert:
            msg = self.ctx.local.pop(0)
            self._dispatch(self.node_id, msg)
            steps += 1
            if steps > _MAX_LOCAL_STEPS:
                raise RuntimeError("local message loop did not settle")
        self.ctx.local.clear()
        out, self.ctx.out = self.ctx.out, []
        return out

    def _roles_changed(self) -> None:
        epoch = self.membership.active_epoch()
        if epoch is None:
            epoch = max(0, self.params.epoch_of(self.ctx.now))
        roles = tuple(self._role_strings())
        if roles != self._last_roles:
            self._last_roles = roles
            self.ctx.emit(RoleChanged(epoch, roles))

    def _role_strings(self) -> list[str]:
        out = []
        for (epoch, level), zl in sorted(self.zones.levels.items()):
            if zl.is_initiator:
                out.append(f"initiator@{level}:e{epoch}")
        for role in sorted(self.roles.roles.values(), key=lambda r: (r.level, r.cluster_id)):
            tag = "primary" if self.roles.is_primary(role) else "replica"
            root = ",root" if role.is_root else ""
            out.append(f"super-peer@{role.level}:{role.cluster_id}({tag}{root})")
        return out

    def _on_announce(self, msg: EpochAnnounce) -> None:
        self.membership.on_epoch_announce(msg)
        grace = self.params.level_duration
        self.ctx.after(grace, lambda: self._forget_before(msg.epoch))

    def _forget_before(self, epoch: int) -> None:
        if self.membership.active_epoch() != epoch:
            return
        self.zones.forget_before(epoch)
        self.roles.forget_before(epoch)
        self.membership.forget_before(epoch)

    def _depth(self) -> int:
        epoch = self.membership.active_epoch()
        if epoch is None:
            return self.params.max_levels
        view = self.membership.views[epoch]
        if view.depth:
            return view.depth
        return view.root.level if view.root is not None else self.params.max_levels

    def _top_role(self, epoch: int) -> ClusterRole | None:
        roles = [r for r in self.roles.roles.values() if r.descriptor.epoch == epoch]
        return max(roles, key=lambda r: (r.level, r.cluster_id)) if roles else None

    def _query_entry(self) -> tuple[int, ClusterDescriptor | None, ClusterDescriptor | None]:
        epoch = self.membership.active_epoch()
        if epoch is None:
            epoch = self.membership.placed_epoch()
        if epoch is None:
            # A node that is never placed (no signature) still forms zones, and may lead one.
            epoch = max((e for e, _ in self.zones.levels), default=None)
        if epoch is None:
            epoch = max(0, self.params.epoch_of(self.ctx.now))
        return epoch, self.membership.root(epoch), self.membership.leaf(epoch)

    def _holds_epoch(self, epoch: int) -> bool:
        """Whether this node holds state for ``epoch``: the current epoch (and the next one
        within a level of its start), or an epoch of a view, zone level or role. Cheapest
        checks first: this runs for every message."""
        params = self.params
        current = params.epoch_of(self.ctx.now)
        if epoch == current or epoch in self.membership.views:
            return True
        if epoch == current + 1 and params.epoch_start(current + 1) - self.ctx.now < (
            params.level_duration
        ):
            return True
        if any(e == epoch for e, _ in self.zones.levels):
            return True
        return any(r.descriptor.epoch == epoch for r in self.roles.roles.values())

    # ------------------------------------------------------------------ inputs
    def on_message(self, src_id: str, msg: Message, now: float) -> list[Send]:
        """Handle one message from the authenticated sender ``src_id``."""
        self._begin(now)
        if self.ctx.inert:
            self.ctx.reject("inert")
            return []
        if src_id == self.node_id:
            self.ctx.reject("self")
            return []
        self.ctx.counters[f"received.{msg.KIND}"] += 1
        self._dispatch(src_id, msg)
        return self._drain()

    def _dispatch(self, src: str, msg: Message) -> None:
        self.ctx.current_kind = msg.KIND
        epoch = getattr(msg, "epoch", None)
        if epoch is not None and not self._holds_epoch(epoch):
            self.ctx.reject("wrong_epoch")
            return
        try:
            self._dispatcher.dispatch(src, msg)
        except (ValueError, TypeError, KeyError, IndexError) as err:
            # A malformed field that slipped past the handler's checks: reject, stay up.
            self.ctx.reject("malformed")
            self.ctx.counters[f"malformed.{type(err).__name__}"] += 1

    def on_tick(self, now: float) -> list[Send]:
        """Fire every timer due at ``now`` (call when ``now >= next_deadline()``)."""
        self._begin(now)
        if self.ctx.inert:
            self.ctx.timers.clear()
            return []
        while True:
            timer = self.ctx.timers.pop_due(now)
            if timer is None:
                break
            timer.fn()
            # Local deliveries a timer caused are handled at the same instant.
            while self.ctx.local and not self.ctx.inert:
                self._dispatch(self.node_id, self.ctx.local.pop(0))
        return self._drain()

    def next_deadline(self) -> float | None:
        """The earliest time ``on_tick`` has work to do (``None``: no timer armed)."""
        if self.ctx.inert:
            return None
        return self.ctx.timers.next_deadline()

    def set_neighbours(self, refs: list[NodeRef], now: float) -> list[Send]:
        """Replace the physical neighbour set (the first ``d_max`` distinct refs are kept)."""
        self._begin(now)
        self.peers.replace(refs)
        return self._drain()

    def neighbours(self) -> list[NodeRef]:
        """The current physical neighbours."""
        return list(self.peers.refs.values())

    def set_signature(self, sig: Signature, now: float, p_min: int | None = None) -> list[Send]:
        """Publish this round's signature (and optionally this node's ``P_min``).

        Before the build the signature is what the zone initiator's SigProbe collects; once
        placed, it is pushed to the leaf cluster's replicas so searches score fresh values.
        """
        self._begin(now)
        if sig.p > self.params.max_signature_p:
            raise ValueError(f"signature has P = {sig.p} > max_signature_p")
        if p_min is not None and p_min < 1:
            raise ValueError("p_min must be >= 1")
        if self.ctx.inert:
            return []
        self.ctx.previous_signature = self.ctx.signature
        self.ctx.signature = sig
        self.ctx.signature_round += 1
        if p_min is not None:
            self.ctx.p_min = p_min
        self.membership.signature_changed()
        return self._drain()

    def start_query(self, k: int, now: float) -> tuple[str, list[Send]]:
        """Ask the overlay for the ``k`` peers most similar to this node's signature.

        Returns the query id; the answer arrives as a
        :class:`~peerlm.overlay.events.QueryCompleted` event (at the latest after
        ``Delta_t``). Raises ``ValueError`` without a signature or with ``k`` out of range.
        """
        self._begin(now)
        if self.ctx.inert:
            raise ValueError("the node has left the overlay")
        qid = self.querier.start(k)
        return qid, self._drain()

    def join(self, bootstrap: list[NodeRef], now: float) -> list[Send]:
        """Enter the overlay through ``bootstrap`` peers (neighbours and join entry).

        Before an epoch's build the node simply takes part in it; once a tree exists the
        request goes to the root (through a bootstrap peer) and is placed top-down.
        """
        self._begin(now)
        self.peers.contact(bootstrap)
        epoch = self.params.epoch_of(now)
        if (
            epoch >= 0
            and now > self.params.level_start(epoch, 1)
            and self.membership.leaf(epoch) is None
        ):
            self.membership.start_join(epoch)
        return self._drain()

    def leave(self, now: float) -> list[Send]:
        """Graceful leave: resign primaries, notify leaf replicas; the node goes inert."""
        self._begin(now)
        if self.ctx.inert:
            return []
        held = set(self.roles.roles)
        self.roles.resign_all()
        self.membership.leave(skip=held)
        out = self._drain()
        self.ctx.inert = True
        self.ctx.timers.clear()
        self.ctx.counters["left"] += 1
        return out

    # ------------------------------------------------------------------ outputs
    def pop_events(self) -> list[Event]:
        """Events since the last call (query results, role changes, takeovers)."""
        events, self.ctx.events = self.ctx.events, []
        return events

    def describe(self) -> Mapping[str, Any]:
        """Role, level, zone, cluster, parent and children of this node, for metrics."""
        epoch = self.membership.active_epoch()
        if epoch is None:
            epoch = self.membership.placed_epoch()
        if epoch is None:
            # A node that is never placed (no signature) still forms zones, and may lead one.
            epoch = max((e for e, _ in self.zones.levels), default=None)
        leaf = self.membership.leaf(epoch) if epoch is not None else None
        root = self.membership.root(epoch) if epoch is not None else None
        zone = self.zones.level_state(epoch, 1) if epoch is not None else None
        roles = self.roles.describe()
        top = max((int(str(r["level"])) for r in roles), default=0)
        initiator_levels = [
            level for (e, level), zl in self.zones.levels.items() if e == epoch and zl.is_initiator
        ]
        if any(r["root"] for r in roles):
            role = "root"
        elif roles:
            role = "super-peer"
        elif initiator_levels:
            role = "initiator"
        elif leaf is not None:
            role = "member"
        else:
            role = "unplaced"
        top_role = next((r for r in roles if r["level"] == top), None)
        own_zone = self.zones.levels.get((epoch, 1)) if epoch is not None else None
        return {
            "node_id": self.node_id,
            "epoch": epoch,
            "role": "left" if self.ctx.inert else role,
            "level": top,
            "zone": zone.initiator.node_id if zone is not None and zone.initiator else None,
            "initiator_levels": sorted(initiator_levels),
            "zone_size": len(own_zone.members) if own_zone and own_zone.is_initiator else 0,
            # Queries can be answered once the root of an epoch is known.
            "ready": self.membership.active_epoch() is not None and not self.ctx.inert,
            "cluster": leaf.cluster_id if leaf is not None else None,
            "parent": top_role["parent"] if top_role else None,
            "children": top_role["children"] if top_role else [],
            "roles": roles,
            "root": root.cluster_id if root is not None else None,
            "depth": self.membership.views[epoch].depth if epoch in self.membership.views else 0,
            # Sec. 3.2: the network-wide signature cardinality announced with the epoch.
            "network_p": (
                self.membership.views[epoch].network_p if epoch in self.membership.views else None
            ),
            "neighbours": sorted(self.peers.refs),
            "tau": self.querier.threshold.tau,
            "pending_queries": self.querier.pending(),
        }
