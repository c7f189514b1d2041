"""Every message of the semantic-overlay protocol, as frozen dataclasses.

The core (:mod:`peerlm.overlay.node`) consumes and produces these objects; a transport maps
them to its wire format (the gRPC transport to protobuf, with signatures serialised by
``Signature.to_bytes``) and back. Each message class has a stable ``KIND`` name, which the
transport may use as a discriminator and the simulator uses to count traffic.

Conventions:

* ``epoch`` is the overlay epoch the message belongs to; a node rejects messages of an epoch
  it does not hold state for (counted as ``wrong_epoch``).
* ``level`` is the hierarchy level: level 1 zones group peers, level ``l > 1`` zones group the
  initiators of level ``l - 1``; a level-``l`` cluster has level-``(l-1)`` clusters (or, at
  level 1, peers) as children.
* A node's identity is its ``node_id`` (on a real transport: the name in its certificate);
  the sender of a message is given to the core by the transport, never read from a field.
  Fields such as ``Register.member`` describe *other* nodes (or the sender's own address,
  which the transport cannot know) and are checked against the authenticated sender where
  they must match.

:func:`wire_size` estimates the bytes a message takes on the wire (field payloads plus a
small per-field framing), so the simulator can count control bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from peerlm.overlay.signature import Signature

__all__ = [
    "MESSAGE_TYPES",
    "Candidate",
    "ClusterDescriptor",
    "ClusterState",
    "DescriptorUpdate",
    "ElectionTicket",
    "EpochAnnounce",
    "Heartbeat",
    "HeartbeatAck",
    "JoinAccept",
    "JoinRequest",
    "LeaseAck",
    "LeaseRenew",
    "Leave",
    "MemberAssign",
    "MemberEntry",
    "Message",
    "Neighbor",
    "NodeRef",
    "ParentUpdate",
    "PeerExchange",
    "Probe",
    "Query",
    "QueryAck",
    "QueryDown",
    "QueryPartial",
    "QueryResult",
    "Register",
    "Resign",
    "SearchStats",
    "SigProbe",
    "SigReply",
    "SignatureUpdate",
    "Split",
    "Takeover",
    "VrfTicket",
    "ZoneInfo",
    "ZoneInfoRequest",
    "ZoneMember",
    "score_of",
    "wire_size",
]


def score_of(beta: bytes) -> int:
    """The VRF score used for ordering: the first 8 bytes of ``beta`` as a big-endian
    integer (ordering by it equals ordering the full 64-byte output except on a 2**-64
    prefix tie, which ``node_id`` then breaks)."""
    return int.from_bytes(beta[:8], "big")


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class NodeRef:
    """How to reach a node: its id (certificate name) and an opaque transport address."""

    node_id: str
    address: str


@dataclass(frozen=True, slots=True)
class VrfTicket:
    """A node's VRF evaluation on the epoch seed: ``proof = VRF.prove(sk, seed)``.

    The score ``sigma = VRF.proof_to_hash(proof)`` (64 bytes, compared as big-endian
    integers, i.e. bytewise) orders nodes for initiator election and replica succession,
    ties broken by ``node_id``. Receivers verify the proof against the public key bound to
    ``node_id`` (the node's key resolver) before using it.
    """

    node_id: str
    public_key: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class ZoneMember:
    """A zone member as its initiator knows it: reference, VRF ticket, probe hop count."""

    ref: NodeRef
    ticket: VrfTicket
    hops: int


@dataclass(frozen=True, slots=True)
class ClusterDescriptor:
    """``CD_j = (j, e_j, u_bar_j, R_j, |C_j|, zoneID)`` plus the level and epoch it lives in.

    ``replicas`` is the replica set ``R_j`` in succession order: ``replicas[0]`` is the
    primary (lease holder), the next live one takes over; ``scores`` are the replicas' VRF
    score prefixes (see :func:`score_of`), which order the successors. ``size`` counts the
    peers in the cluster's subtree. ``version`` grows with every change the primary makes.
    """

    cluster_id: str
    level: int
    exemplar: str
    prototype: Signature
    replicas: tuple[NodeRef, ...]
    scores: tuple[int, ...]
    size: int
    zone_id: str
    epoch: int
    version: int = 0


@dataclass(frozen=True, slots=True)
class MemberEntry:
    """A leaf-cluster member with its latest signature (``None`` until it sent one)."""

    ref: NodeRef
    signature: Signature | None
    score: int
    round: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One search result: a peer and the cosine similarity of its signature to the query."""

    node_id: str
    address: str
    similarity: float


@dataclass(frozen=True, slots=True)
class SearchStats:
    """Work done for one query (summed over the subtree that produced a partial result).

    ``prototypes`` and ``members`` count signature comparisons (prototype scores at inner
    super-peers, member scores at leaves); ``accepted`` counts scored edges that met
    ``tau``; ``visited`` counts super-peers that handled the query; ``samples`` is a small
    deterministic sample of the similarities scored, for the querier's streaming quantile.
    """

    prototypes: int = 0
    members: int = 0
    accepted: int = 0
    visited: int = 0
    failed_branches: int = 0
    samples: tuple[float, ...] = ()

    @property
    def scored(self) -> int:
        return self.prototypes + self.members


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class PeerExchange:
    """Neighbour discovery: the sender's known peers (``d_max`` graph maintenance)."""

    KIND: ClassVar[str] = "PEER_EXCHANGE"
    sender: NodeRef
    refs: tuple[NodeRef, ...]
    want_reply: bool = False


@dataclass(frozen=True, slots=True)
class ElectionTicket:
    """Initiator election (Alg. 2): a VRF ticket flooded at most ``R`` hops.

    Relayed only while it improves what the relay already forwarded, so each node learns the
    minimum ``(sigma, id)`` within its ``R``-hop ball at ``O(R * |E|)`` messages.
    """

    KIND: ClassVar[str] = "ELECTION"
    epoch: int
    level: int
    ticket: VrfTicket
    hops: int


@dataclass(frozen=True, slots=True)
class Probe:
    """PROBE (Alg. 3): an initiator's TTL-bounded flood; first valid probe wins.

    With ``handed_by`` set it is the re-probe after a split: the receiver moves to the new
    initiator only if ``handed_by`` is its current initiator.
    """

    KIND: ClassVar[str] = "PROBE"
    epoch: int
    level: int
    initiator: NodeRef
    ticket: VrfTicket
    ttl: int
    hops: int
    handed_by: str | None = None


@dataclass(frozen=True, slots=True)
class Register:
    """REGISTER: a peer joins the zone of the initiator whose probe it adopted."""

    KIND: ClassVar[str] = "REGISTER"
    epoch: int
    level: int
    member: NodeRef
    ticket: VrfTicket
    hops: int


@dataclass(frozen=True, slots=True)
class Neighbor:
    """NEIGHBOR adjacency notice: an assigned peer saw a probe of ``initiator``, so the
    receiving initiator's zone borders that initiator's zone."""

    KIND: ClassVar[str] = "NEIGHBOR"
    epoch: int
    level: int
    initiator: NodeRef
    ticket: VrfTicket


@dataclass(frozen=True, slots=True)
class Split:
    """SPLIT hand-off: an over-full zone's initiator gives ``members`` (BFS order) to the
    lowest-VRF among them, which re-probes them as a new zone."""

    KIND: ClassVar[str] = "SPLIT"
    epoch: int
    level: int
    members: tuple[ZoneMember, ...]
    neighbours: tuple[NodeRef, ...]


@dataclass(frozen=True, slots=True)
class ZoneInfoRequest:
    """An orphan (no probe reached it) asks a neighbour which zone it is in."""

    KIND: ClassVar[str] = "ZONE_INFO_REQUEST"
    epoch: int
    level: int


@dataclass(frozen=True, slots=True)
class ZoneInfo:
    """Answer to :class:`ZoneInfoRequest`; ``initiator`` is ``None`` when unassigned."""

    KIND: ClassVar[str] = "ZONE_INFO"
    epoch: int
    level: int
    initiator: NodeRef | None
    ticket: VrfTicket | None
    hops: int


@dataclass(frozen=True, slots=True)
class SigProbe:
    """SigProbe: the zone initiator asks a member for what it clusters on."""

    KIND: ClassVar[str] = "SIG_PROBE"
    epoch: int
    level: int
    zone_id: str


@dataclass(frozen=True, slots=True)
class SigReply:
    """Reply to :class:`SigProbe`.

    At level 1: the member's signature and its ``P_min`` report. At level ``l > 1``: the
    descriptors of the level-``(l-1)`` clusters the participant formed, and the ``P_min``
    values it aggregated (a bounded, evenly spaced sample of order statistics).
    """

    KIND: ClassVar[str] = "SIG_REPLY"
    epoch: int
    level: int
    zone_id: str
    signature: Signature | None = None
    items: tuple[ClusterDescriptor, ...] = ()
    p_mins: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Descriptor publication / replica synchronisation: the full state of one cluster.

    Sent by the zone initiator to every replica when the cluster is formed, and by the
    primary to a replica whenever the state changes (join, leave, backfill). Leaf clusters
    carry ``members`` (with signatures), inner clusters ``children``.
    """

    KIND: ClassVar[str] = "CLUSTER_STATE"
    epoch: int
    descriptor: ClusterDescriptor
    children: tuple[ClusterDescriptor, ...]
    members: tuple[MemberEntry, ...]
    parent: ClusterDescriptor | None
    term: int
    root: ClusterDescriptor | None = None


@dataclass(frozen=True, slots=True)
class MemberAssign:
    """A level-1 member learns its leaf cluster (after clustering, or after a join)."""

    KIND: ClassVar[str] = "MEMBER_ASSIGN"
    epoch: int
    cluster: ClusterDescriptor


@dataclass(frozen=True, slots=True)
class ParentUpdate:
    """Parent pointer update: the replicas of ``child_id`` learn (or re-learn after a
    takeover) the descriptor of their parent cluster."""

    KIND: ClassVar[str] = "PARENT_UPDATE"
    epoch: int
    child_id: str
    parent: ClusterDescriptor


@dataclass(frozen=True, slots=True)
class DescriptorUpdate:
    """Child pointer update: a child cluster's primary tells its parent's replicas that its
    descriptor changed (size, prototype, replica set); ``removed`` drops the child."""

    KIND: ClassVar[str] = "DESCRIPTOR_UPDATE"
    epoch: int
    parent_id: str
    child: ClusterDescriptor
    removed: bool = False


@dataclass(frozen=True, slots=True)
class EpochAnnounce:
    """Sent down the tree once the root exists: the epoch's seed, the root's descriptor
    (entry points for queries and joins), the hierarchy depth and the network-wide ``P``."""

    KIND: ClassVar[str] = "EPOCH_ANNOUNCE"
    epoch: int
    seed: bytes
    root: ClusterDescriptor
    depth: int
    network_p: int | None


@dataclass(frozen=True, slots=True)
class Query:
    """``Q_i = <u_i, K, qid>`` sent by the querier to a top-level super-peer (or, with
    ``ascend``, to its leaf super-peer or a neighbour, which forward it up the parent
    pointers). ``budget`` is how many seconds the querier still waits for the answer
    (each forwarding hop subtracts ``t_a``); the root spends at most that, less a return
    trip."""

    KIND: ClassVar[str] = "QUERY"
    qid: str
    epoch: int
    querier: NodeRef
    signature: Signature
    k: int
    tau: float | None
    round: int
    ascend: bool = False
    budget: float = 0.0


@dataclass(frozen=True, slots=True)
class QueryDown:
    """The query descending to child cluster ``cluster_id`` with the round threshold."""

    KIND: ClassVar[str] = "QUERY_DOWN"
    qid: str
    epoch: int
    cluster_id: str
    querier_id: str
    signature: Signature
    k: int
    tau: float
    attempt: int
    reply_to: NodeRef
    budget: float


@dataclass(frozen=True, slots=True)
class QueryAck:
    """An inner super-peer confirms a QUERY_DOWN at once, so its parent can fail over to
    another replica after one round trip instead of after the child's whole budget."""

    KIND: ClassVar[str] = "QUERY_ACK"
    qid: str
    cluster_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class QueryPartial:
    """A subtree's size-K candidate list (a max-heap merge, de-duplicated) going up.

    ``frontier`` is the best similarity among prototypes the subtree scored but did not
    expand (``-2.0`` when none), so the root knows whether relaxing ``tau`` can reach more.
    """

    KIND: ClassVar[str] = "QUERY_PARTIAL"
    qid: str
    cluster_id: str
    attempt: int
    candidates: tuple[Candidate, ...]
    frontier: float
    stats: SearchStats


@dataclass(frozen=True, slots=True)
class QueryResult:
    """QUERY_RESULT: the final top-K to the querier (ids, addresses, similarities).

    ``tau`` is the threshold the round ended with (after relaxing); ``complete`` is false if
    a branch failed or the visit budget ran out before K candidates passed.
    """

    KIND: ClassVar[str] = "QUERY_RESULT"
    qid: str
    epoch: int
    candidates: tuple[Candidate, ...]
    stats: SearchStats
    tau: float
    complete: bool
    root: ClusterDescriptor | None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Member -> leaf primary liveness (also carries nothing else: signatures travel in
    :class:`SignatureUpdate`)."""

    KIND: ClassVar[str] = "HEARTBEAT"
    epoch: int
    cluster_id: str


@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    """Leaf primary -> member: alive, with the current descriptor (replica changes)."""

    KIND: ClassVar[str] = "HEARTBEAT_ACK"
    epoch: int
    cluster: ClusterDescriptor


@dataclass(frozen=True, slots=True)
class LeaseRenew:
    """Primary -> other replicas: lease renewal for ``term``; ``version`` lets a replica
    notice it missed a :class:`ClusterState`."""

    KIND: ClassVar[str] = "LEASE_RENEW"
    epoch: int
    cluster_id: str
    term: int
    version: int
    replicas: tuple[NodeRef, ...]


@dataclass(frozen=True, slots=True)
class LeaseAck:
    """Replica -> primary: alive and at ``version``."""

    KIND: ClassVar[str] = "LEASE_ACK"
    epoch: int
    cluster_id: str
    term: int
    version: int


@dataclass(frozen=True, slots=True)
class Takeover:
    """A replica took over ``cluster_id`` (lease expiry or resignation): the new
    descriptor (new primary first) for parents, children, members and replicas."""

    KIND: ClassVar[str] = "TAKEOVER"
    epoch: int
    cluster: ClusterDescriptor
    term: int
    previous_primary: str


@dataclass(frozen=True, slots=True)
class Resign:
    """Graceful leave of a primary: the successor takes over at once."""

    KIND: ClassVar[str] = "RESIGN"
    epoch: int
    cluster_id: str
    term: int


@dataclass(frozen=True, slots=True)
class SignatureUpdate:
    """Member -> leaf replicas: the member's refreshed signature for ``round``."""

    KIND: ClassVar[str] = "SIGNATURE_UPDATE"
    epoch: int
    cluster_id: str
    signature: Signature
    round: int
    p_min: int | None = None


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """JOIN, travelling up the parent pointers to the root, then down (top-down placement).

    For a peer: ``item`` is ``None`` and ``target_level`` 1 (it becomes a member of a leaf
    cluster). For a re-attaching orphaned cluster: ``item`` is its descriptor and
    ``target_level`` the level of the parent it needs.
    """

    KIND: ClassVar[str] = "JOIN"
    epoch: int
    joiner: NodeRef
    signature: Signature
    ticket: VrfTicket | None
    target_level: int
    descending: bool
    cluster_id: str | None = None
    item: ClusterDescriptor | None = None
    hops: int = 0


@dataclass(frozen=True, slots=True)
class JoinAccept:
    """The joiner's new leaf cluster (for an item: its new parent)."""

    KIND: ClassVar[str] = "JOIN_ACCEPT"
    epoch: int
    cluster: ClusterDescriptor
    root: ClusterDescriptor | None
    item_id: str | None = None


@dataclass(frozen=True, slots=True)
class Leave:
    """LEAVE: graceful departure of a member from its leaf cluster."""

    KIND: ClassVar[str] = "LEAVE"
    epoch: int
    cluster_id: str


Message = (
    PeerExchange
    | ElectionTicket
    | Probe
    | Register
    | Neighbor
    | Split
    | ZoneInfoRequest
    | ZoneInfo
    | SigProbe
    | SigReply
    | ClusterState
    | MemberAssign
    | ParentUpdate
    | DescriptorUpdate
    | EpochAnnounce
    | Query
    | QueryDown
    | QueryAck
    | QueryPartial
    | QueryResult
    | Heartbeat
    | HeartbeatAck
    | LeaseRenew
    | LeaseAck
    | Takeover
    | Resign
    | SignatureUpdate
    | JoinRequest
    | JoinAccept
    | Leave
)

MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.KIND: cls
    for cls in (
        PeerExchange,
        ElectionTicket,
        Probe,
        Register,
        Neighbor,
        Split,
        ZoneInfoRequest,
        ZoneInfo,
        SigProbe,
        SigReply,
        ClusterState,
        MemberAssign,
        ParentUpdate,
        DescriptorUpdate,
        EpochAnnounce,
        Query,
        QueryDown,
        QueryAck,
        QueryPartial,
        QueryResult,
        Heartbeat,
        HeartbeatAck,
        LeaseRenew,
        LeaseAck,
        Takeover,
        Resign,
        SignatureUpdate,
        JoinRequest,
        JoinAccept,
        Leave,
    )
}
"""Stable message name -> class."""


# --------------------------------------------------------------------------- sizes

_HEADER_BYTES = 16
"""Per message: type tag, length prefix, a little framing."""
_FIELD_BYTES = 2
"""Per field: protobuf-style tag and length."""


def signature_wire_size(sig: Signature) -> int:
    """``len(sig.to_bytes())`` without serialising: a 20-byte header, the space fingerprint,
    then a 4-byte index and a 2-byte fp16 value per non-zero (the paper's ``6 P``)."""
    return 20 + len(sig.space) + 6 * int(sig.p)


# How a value of each type is sized is decided once per type (the checks below, in this
# order) and then looked up: the simulator sizes every message it carries, and running
# these checks and ``dataclasses.fields`` per value was most of its time. The memo is a
# pure function of the type, not state.
_NONE, _ONE, _EIGHT, _STR, _BYTES, _TUPLE, _SIGNATURE, _RECORD, _FROZEN = range(9)

SizeMemo = dict[int, tuple[object, int]]
"""``id(record) -> (record, size)`` for frozen records; holding the record keeps its id
from being reused while the entry lives."""


def _has(kind: type, name: str) -> bool:
    return hasattr(kind, name) or name in getattr(kind, "__dataclass_fields__", {})


@functools.cache
def _size_kind(kind: Any) -> tuple[int, Callable[[Any], tuple[Any, ...]]]:
    """The sizing code of a type and, for records, a getter of its field values in order
    (one C call where ``getattr`` per field name was a Python loop)."""
    if kind is type(None):
        return _NONE, _no_fields
    if issubclass(kind, bool):
        return _ONE, _no_fields
    if issubclass(kind, int | float):
        return _EIGHT, _no_fields
    if issubclass(kind, str):
        return _STR, _no_fields
    if issubclass(kind, bytes):
        return _BYTES, _no_fields
    if issubclass(kind, tuple):
        return _TUPLE, _no_fields
    if _has(kind, "indices") and _has(kind, "space"):
        return _SIGNATURE, _no_fields
    if dataclasses.is_dataclass(kind):
        frozen = bool(getattr(kind, "__dataclass_params__").frozen)  # noqa: B009
        return _FROZEN if frozen else _RECORD, _field_getter(
            tuple(f.name for f in dataclasses.fields(kind))
        )
    raise TypeError(f"no wire size for {kind.__name__}")


def _no_fields(value: Any) -> tuple[Any, ...]:
    return ()


def _field_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return _no_fields
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda value: (one(value),)
    return operator.attrgetter(*names)


# A class is hashable, but mypy does not see it as Hashable.
_kind_of: Callable[[Any], tuple[int, Callable[[Any], tuple[Any, ...]]]] = _size_kind


def _value_size(value: Any, memo: SizeMemo | None) -> int:
    kind = type(value)
    # The common leaves first, by exact type (a subclass takes the general path below).
    if kind is str:
        return _FIELD_BYTES + (len(value) if value.isascii() else len(value.encode()))
    if kind is int or kind is float:
        return 8
    if value is None or kind is bool:
        return 1
    code, fields_of = _kind_of(kind)
    if code == _FROZEN:
        if memo is not None:
            hit = memo.get(id(value))
            if hit is not None and hit[0] is value:
                return hit[1]
        size = _FIELD_BYTES
        for field in fields_of(value):
            # Leaf fields inline (most fields are): a call per field was half the cost.
            field_kind = type(field)
            if field_kind is str and field.isascii():
                size += _FIELD_BYTES + len(field)
            elif field_kind is int or field_kind is float:
                size += 8
            elif field is None or field_kind is bool:
                size += 1
            else:
                size += _value_size(field, memo)
        if memo is not None:
            memo[id(value)] = (value, size)
        return size
    if code in (_RECORD, _TUPLE):
        size = _FIELD_BYTES
        for item in fields_of(value) if code == _RECORD else value:
            size += _value_size(item, memo)
        return size
    if code == _STR:
        return _FIELD_BYTES + len(value.encode())
    if code == _EIGHT:
        return 8
    if code in (_NONE, _ONE):
        return 1
    if code == _BYTES:
        return _FIELD_BYTES + len(value)
    return _FIELD_BYTES + signature_wire_size(value)


def wire_size(msg: Message, memo: SizeMemo | None = None) -> int:
    """Estimated bytes of ``msg`` on the wire (for control-traffic accounting).

    ``memo`` (optional, the caller's) remembers the sizes of the immutable records it has
    seen (descriptors, member entries, whole messages), which recur in many messages; the
    caller bounds it (clearing it is always safe).
    """
    return _value_size(msg, memo) - _FIELD_BYTES + _HEADER_BYTES
