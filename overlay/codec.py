"""Protocol messages <-> protobuf (``peerlm.v1.OverlayMessage``), with validation.

The mapping is derived from the message dataclasses themselves: every class in
:data:`peerlm.overlay.messages.MESSAGE_TYPES` has a protobuf message of the same name (except
``PeerExchange``, which is ``OverlayPeerExchange`` because the agent's service owns that name)
with the same field names, and a field's Python annotation decides how it travels:

============================  ===============================================================
annotation                    wire form
============================  ===============================================================
``str`` ``int`` ``bool``      the scalar (ints as ``sint64``; VRF score prefixes, which need
                              all 64 bits, as ``uint64``)
``float``                     ``double``; NaN and infinity are refused on decode
``bytes``                     ``bytes`` (at most :attr:`CodecLimits.max_bytes_field`)
``Signature``                 ``bytes`` in ``Signature.to_bytes()`` form, decoded with
                              ``Signature.from_bytes(max_p=max_signature_p)``
a dataclass                   the protobuf message of the same name
``tuple[X, ...]``             ``repeated`` (at most :attr:`CodecLimits.max_items` entries)
``X | None``                  proto3 ``optional`` or message presence; unset means ``None``
============================  ===============================================================

Encoding is a plan computed once per class (``typing.get_type_hints``), so a field added to a
dataclass without its protobuf twin fails loudly (:class:`CodecError` with reason
``schema``) and the unit test that round-trips every message kind catches it first.

Decoding treats the bytes as hostile: bounded strings (printable ASCII), node ids that must be
certificate names, bounded repeated fields and byte fields, finite floats (similarities in
``[-1, 1]``), valid signatures; any defect raises :class:`CodecError` naming the field, and
nothing is handed to the protocol core. Fields that state the *sender's own* identity
(``PeerExchange.sender``, ``Register.member``, ``Register.ticket``) must equal the
authenticated certificate name, else :class:`IdentityMismatch` (``PERMISSION_DENIED`` on the
wire). Fields that name *other* nodes are checked by the core where they must match.

One field exists only on the wire: ``VrfTicket.certificate``. A relayed ticket (one whose
``node_id`` is not the sender) may carry the DER certificate of the node it names, so a
receiver can bind that node's id to its certified VRF key without having talked to it; the
codec only extracts these (:attr:`Decoded.certificates`), the transport verifies them against
the federation CA.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from google.protobuf.message import Message as PbMessage
from peerlm.overlay import messages as m
from peerlm.overlay.messages import MESSAGE_TYPES, Message, VrfTicket
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.signature import Signature, SignatureError

from peerlm.pki.identity import NAME_PATTERN
from peerlm.wire.v1 import overlay_pb2

__all__ = [
    "CodecError",
    "CodecLimits",
    "Decoded",
    "IdentityMismatch",
    "decode_batch",
    "decode_message",
    "encode_batch",
    "encode_message",
    "kind_of",
    "proto_name",
]

StatusName = Literal["INVALID_ARGUMENT", "PERMISSION_DENIED", "FAILED_PRECONDITION"]

#: Protobuf message names that differ from the dataclass names.
_PROTO_NAMES: Final = {"PeerExchange": "OverlayPeerExchange"}

#: Fields that name a node by its certificate name (checked against NAME_PATTERN).
_NODE_ID_FIELDS: Final[frozenset[tuple[str, str]]] = frozenset(
    {
        ("NodeRef", "node_id"),
        ("VrfTicket", "node_id"),
        ("Candidate", "node_id"),
        ("QueryDown", "querier_id"),
        ("Probe", "handed_by"),
        ("Takeover", "previous_primary"),
    }
)

#: Fields that state the sender's own identity: ``(class, path)`` must equal the caller.
_SENDER_FIELDS: Final[dict[str, tuple[tuple[str, ...], ...]]] = {
    "PeerExchange": (("sender", "node_id"),),
    "Register": (("member", "node_id"), ("ticket", "node_id")),
}

#: Closed ranges of float fields (anything else need only be finite). Cosines lie in
#: [-1, 1]; a threshold may be relaxed below -1 by the core's retry loop, so thresholds get
#: a wider (still bounded) range.
_FLOAT_RANGES: Final[dict[str, tuple[float, float]]] = {
    "similarity": (-1.0, 1.0),
    "samples": (-1.0, 1.0),
    "tau": (-2.0, 2.0),
    "frontier": (-2.0, 1.0),
    "budget": (0.0, 86400.0),
}

_DEFAULTS: Final = OverlayParams()

#: Strings are ids, addresses and short names: printable ASCII only.
_PRINTABLE: Final = re.compile(r"[\x20-\x7e]*")


class CodecError(ValueError):
    """A message cannot be encoded or decoded; ``reason`` is the metric label, ``status``
    the gRPC status the receiving service answers with."""

    status: StatusName = "INVALID_ARGUMENT"

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class IdentityMismatch(CodecError):
    """A field claims the sender is someone other than the authenticated caller."""

    status: StatusName = "PERMISSION_DENIED"

    def __init__(self, detail: str) -> None:
        super().__init__("identity_mismatch", detail)


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds applied when decoding (DESIGN principle 4)."""

    max_signature_p: int = _DEFAULTS.max_signature_p
    """Signatures with more coordinates are refused."""
    max_items: int = _DEFAULTS.max_items_per_message
    """Entries of one repeated field."""
    max_string: int = 256
    """Characters of one string field (ids, addresses, zone and cluster ids)."""
    max_bytes_field: int = 256
    """Bytes of a plain ``bytes`` field (keys 32, proofs 80, seeds 32)."""
    max_certificate: int = 8192
    """Bytes of a certificate attached to a relayed VRF ticket."""
    max_batch: int = 256
    """Messages in one :class:`~peerlm.wire.v1.overlay_pb2.OverlayEnvelope`."""

    @classmethod
    def from_params(cls, params: OverlayParams, **overrides: Any) -> CodecLimits:
        """Limits that agree with the overlay's parameters."""
        base: dict[str, Any] = {
            "max_signature_p": params.max_signature_p,
            "max_items": params.max_items_per_message,
        }
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded message and the certificates attached to relayed tickets in it."""

    message: Message
    certificates: dict[str, bytes]


# --------------------------------------------------------------------------- the plan

_Kind = Literal["scalar", "float", "bytes", "signature", "dataclass"]


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: _Kind
    optional: bool
    repeated: bool
    element: type[Any]


def proto_name(cls: type[Any]) -> str:
    """The protobuf message name of a protocol dataclass."""
    return _PROTO_NAMES.get(cls.__name__, cls.__name__)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _oneof_field(cls: type[Any]) -> str:
    return _snake(cls.__name__)


def kind_of(pb: overlay_pb2.OverlayMessage) -> str | None:
    """The protocol ``KIND`` of a protobuf message (``None`` when no body is set)."""
    which = pb.WhichOneof("body")
    if which is None:
        return None
    cls = _ONEOF_TO_CLASS.get(which)
    return None if cls is None else str(cls.KIND)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union {tp!r}")
    return tp, False


def _field_plan(name: str, tp: Any) -> _Field:
    tp, optional = _strip_optional(tp)
    repeated = False
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"field {name}: only tuple[X, ...] is supported, got {tp!r}")
        tp, repeated = args[0], True
    kind: _Kind
    if tp is Signature:
        kind = "signature"
    elif tp is float:
        kind = "float"
    elif tp is bytes:
        kind = "bytes"
    elif tp in (str, int, bool):
        kind = "scalar"
    elif dataclasses.is_dataclass(tp):
        kind = "dataclass"
    else:
        raise TypeError(f"field {name}: no wire mapping for {tp!r}")
    return _Field(name, kind, optional, repeated, tp)


def _field_types(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(m), localns={"Signature": Signature})


def _all_plans() -> dict[type[Any], tuple[_Field, ...]]:
    """Plans of every message class and every dataclass reachable from one."""
    plans: dict[type[Any], tuple[_Field, ...]] = {}
    todo: list[type[Any]] = list(MESSAGE_TYPES.values())
    while todo:
        cls = todo.pop()
        if cls in plans:
            continue
        hints = _field_types(cls)
        plans[cls] = tuple(_field_plan(f.name, hints[f.name]) for f in dataclasses.fields(cls))
        todo.extend(f.element for f in plans[cls] if f.kind == "dataclass")
    return plans


#: Computed once at import: a dataclass field without a wire mapping fails right here.
_PLANS: Final[Mapping[type[Any], tuple[_Field, ...]]] = types.MappingProxyType(_all_plans())


def _plan(cls: type[Any]) -> tuple[_Field, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        raise CodecError("schema", f"{cls.__name__} is not part of the overlay protocol")
    return plan


_ONEOF_TO_CLASS: Final[dict[str, type[Any]]] = {
    _oneof_field(cls): cls for cls in MESSAGE_TYPES.values()
}


# --------------------------------------------------------------------------- encoding

CertificateLookup = Callable[[str], bytes | None]


class _Encoder:
    def __init__(self, sender: str | None, certificate_for: CertificateLookup | None) -> None:
        self._sender = sender
        self._certificate_for = certificate_for

    def fill(self, pb: PbMessage, value: Any) -> None:
        cls = type(value)
        pb.SetInParent()
        for f in _plan(cls):
            if f.name not in pb.DESCRIPTOR.fields_by_name:
                raise CodecError(
                    "schema", f"{proto_name(cls)} has no field {f.name} ({cls.__name__})"
                )
            v = getattr(value, f.name)
            if v is None:
                if not f.optional:
                    raise CodecError("schema", f"{cls.__name__}.{f.name} is None")
                continue
            try:
                if f.repeated:
                    self._fill_repeated(pb, f, v)
                elif f.kind == "dataclass":
                    self.fill(getattr(pb, f.name), v)
                elif f.kind == "signature":
                    setattr(pb, f.name, v.to_bytes())
                else:
                    setattr(pb, f.name, v)
            except (TypeError, ValueError) as err:
                if isinstance(err, CodecError):
                    raise
                raise CodecError(
                    "unencodable", f"{cls.__name__}.{f.name} = {v!r} cannot be encoded: {err}"
                ) from None
        relayed = isinstance(value, VrfTicket) and value.node_id != self._sender
        if relayed and self._certificate_for is not None:
            cert = self._certificate_for(value.node_id)
            if cert:
                typing.cast(Any, pb).certificate = cert

    def _fill_repeated(self, pb: PbMessage, f: _Field, values: Sequence[Any]) -> None:
        container = getattr(pb, f.name)
        if f.kind == "dataclass":
            for item in values:
                self.fill(container.add(), item)
        elif f.kind == "signature":
            container.extend(item.to_bytes() for item in values)
        else:
            container.extend(values)


def encode_message(
    msg: Message,
    *,
    sender: str | None = None,
    certificate_for: CertificateLookup | None = None,
) -> overlay_pb2.OverlayMessage:
    """``msg`` as a ``peerlm.v1.OverlayMessage``.

    With ``certificate_for``, every VRF ticket that names a node other than ``sender`` gets
    that node's certificate attached (when the lookup knows it). Raises :class:`CodecError`
    when a value has no wire form (a negative count, a field without its protobuf twin).
    """
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "KIND", "")) is not cls:
        raise CodecError("schema", f"{cls.__name__} is not a protocol message")
    out = overlay_pb2.OverlayMessage()
    name = _oneof_field(cls)
    if name not in out.DESCRIPTOR.fields_by_name:
        raise CodecError("schema", f"OverlayMessage has no field {name} for {cls.__name__}")
    _Encoder(sender, certificate_for).fill(getattr(out, name), msg)
    return out


def encode_batch(
    recipient: str,
    msgs: Iterable[Message],
    *,
    sender: str | None = None,
    certificate_for: CertificateLookup | None = None,
) -> overlay_pb2.OverlayEnvelope:
    """An envelope for ``recipient`` holding ``msgs`` in order."""
    env = overlay_pb2.OverlayEnvelope(recipient=recipient)
    for msg in msgs:
        env.messages.append(encode_message(msg, sender=sender, certificate_for=certificate_for))
    return env


# --------------------------------------------------------------------------- decoding


class _Decoder:
    def __init__(self, limits: CodecLimits) -> None:
        self._limits = limits
        self.certificates: dict[str, bytes] = {}

    def build(self, cls: type[Any], pb: PbMessage, where: str) -> Any:
        kwargs: dict[str, Any] = {}
        fields_by_name = pb.DESCRIPTOR.fields_by_name
        for f in _plan(cls):
            fd = fields_by_name.get(f.name)
            if fd is None:
                raise CodecError("schema", f"{proto_name(cls)} has no field {f.name}")
            path = f"{where}.{f.name}"
            if f.repeated:
                values = getattr(pb, f.name)
                if len(values) > self._limits.max_items:
                    raise CodecError(
                        "too_many_items",
                        f"{path} has {len(values)} entries, over the limit of "
                        f"{self._limits.max_items}",
                    )
                kwargs[f.name] = tuple(
                    self._value(cls, f, item, f"{path}[{i}]") for i, item in enumerate(values)
                )
                continue
            present = pb.HasField(f.name) if fd.has_presence else True
            if not present:
                if f.optional:
                    kwargs[f.name] = None
                    continue
                if f.kind == "dataclass" or f.kind == "signature":
                    raise CodecError("malformed", f"{path} is required and missing")
            kwargs[f.name] = self._value(cls, f, getattr(pb, f.name), path)
        try:
            obj = cls(**kwargs)
        except (TypeError, ValueError) as err:
            raise CodecError("malformed", f"{where} is invalid: {err}") from None
        if cls is VrfTicket:
            cert = bytes(typing.cast(Any, pb).certificate)
            if cert:
                if len(cert) > self._limits.max_certificate:
                    raise CodecError(
                        "oversized",
                        f"{where}.certificate is {len(cert)} bytes, over the limit of "
                        f"{self._limits.max_certificate}",
                    )
                self.certificates[obj.node_id] = cert
        return obj

    def _value(self, owner: type[Any], f: _Field, raw: Any, path: str) -> Any:
        if f.kind == "dataclass":
            return self.build(f.element, raw, path)
        if f.kind == "signature":
            return self._signature(bytes(raw), path)
        if f.kind == "float":
            return self._float(f.name, float(raw), path)
        if f.kind == "bytes":
            data = bytes(raw)
            if len(data) > self._limits.max_bytes_field:
                raise CodecError(
                    "oversized",
                    f"{path} is {len(data)} bytes, over the limit of "
                    f"{self._limits.max_bytes_field}",
                )
            return data
        if f.element is str:
            return self._string(owner, f.name, str(raw), path)
        if f.element is bool:
            return bool(raw)
        return int(raw)

    def _signature(self, data: bytes, path: str) -> Signature:
        try:
            return Signature.from_bytes(data, max_p=self._limits.max_signature_p)
        except SignatureError as err:
            reason = "oversized" if "over the limit" in str(err) else "bad_signature"
            raise CodecError(reason, f"{path}: {err}") from None

    def _float(self, name: str, value: float, path: str) -> float:
        if not math.isfinite(value):
            raise CodecError("non_finite", f"{path} is {value}; it must be finite")
        bounds = _FLOAT_RANGES.get(name)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise CodecError(
                "out_of_range", f"{path} is {value}, outside [{bounds[0]}, {bounds[1]}]"
            )
        return value

    def _string(self, owner: type[Any], name: str, value: str, path: str) -> str:
        if len(value) > self._limits.max_string:
            raise CodecError(
                "oversized",
                f"{path} has {len(value)} characters, over the limit of {self._limits.max_string}",
            )
        if not _PRINTABLE.fullmatch(value):
            raise CodecError("malformed", f"{path} must be printable ASCII")
        if (owner.__name__, name) in _NODE_ID_FIELDS and not NAME_PATTERN.fullmatch(value):
            raise CodecError("bad_name", f"{path} = {value!r} is not a certificate name")
        return value


def _check_sender(msg: Message, sender: str) -> None:
    for path in _SENDER_FIELDS.get(type(msg).__name__, ()):
        value: Any = msg
        for part in path:
            value = getattr(value, part)
        if value != sender:
            raise IdentityMismatch(
                f"{type(msg).__name__}.{'.'.join(path)} is {value!r} but the caller's "
                f"certificate names {sender!r}"
            )


def decode_message(pb: overlay_pb2.OverlayMessage, limits: CodecLimits, *, sender: str) -> Decoded:
    """Decode and validate one message from the authenticated ``sender``.

    Raises :class:`CodecError` (malformed, oversized, non-finite, bad signature or name) or
    :class:`IdentityMismatch` (a field claims another sender).
    """
    which = pb.WhichOneof("body")
    if which is None:
        raise CodecError("malformed", "message has no body (an unknown or missing kind)")
    cls = _ONEOF_TO_CLASS[which]
    decoder = _Decoder(limits)
    msg = decoder.build(cls, getattr(pb, which), cls.__name__)
    _check_sender(msg, sender)
    return Decoded(msg, decoder.certificates)


def decode_batch(
    env: overlay_pb2.OverlayEnvelope, limits: CodecLimits, *, sender: str
) -> list[Decoded]:
    """Decode every message of ``env`` (all or nothing)."""
    if len(env.messages) > limits.max_batch:
        raise CodecError(
            "too_many_items",
            f"batch of {len(env.messages)} messages, over the limit of {limits.max_batch}",
        )
    out = []
    for i, pb in enumerate(env.messages):
        try:
            out.append(decode_message(pb, limits, sender=sender))
        except CodecError as err:
            err.detail = f"message {i}: {err.detail}"
            err.args = (err.detail,)
            raise
    return out
