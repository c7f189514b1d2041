"""The overlay codec: every protocol message survives the wire; hostile input is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.overlay import codec
from peerlm.overlay import messages as m
from peerlm.overlay.codec import CodecError, CodecLimits, IdentityMismatch
from peerlm.overlay.messages import MESSAGE_TYPES
from peerlm.overlay.signature import Signature

from peerlm.wire.v1 import overlay_pb2

SENDER = "n1"


def _signature(p: int = 4, dim: int = 64, seed: int = 0) -> Signature:
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(dim, size=p, replace=False))
    return Signature(idx, rng.normal(size=p).astype(np.float16), dim, "space0")


def _sample(tp: Any, name: str, *, none: bool, depth: int = 0) -> Any:
    """A valid value of annotation ``tp`` for field ``name`` (``none``: Optionals are None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        if none:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _sample(inner, name, none=none, depth=depth)
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        return tuple(_sample(inner, name, none=none, depth=depth + 1) for _ in range(2))
    if tp is Signature:
        return _signature(seed=depth)
    if tp is str:
        return SENDER if name in ("node_id",) else f"{name}-{depth}"
    if tp is bool:
        return True
    if tp is int:
        return 7 + depth
    if tp is float:
        return 0.25
    if tp is bytes:
        return bytes(range(32))
    if dataclasses.is_dataclass(tp):
        return _instance(typing.cast(type[Any], tp), none=none, depth=depth + 1)
    raise AssertionError(f"no sample for {tp!r}")


def _instance(cls: type[Any], *, none: bool, depth: int = 0) -> Any:
    hints = typing.get_type_hints(cls, globalns=vars(m), localns={"Signature": Signature})
    kwargs = {
        f.name: _sample(hints[f.name], f.name, none=none, depth=depth)
        for f in dataclasses.fields(cls)
    }
    return cls(**kwargs)


def _roundtrip(msg: Any, limits: CodecLimits | None = None) -> Any:
    pb = codec.encode_message(msg, sender=SENDER)
    wire = overlay_pb2.OverlayMessage.FromString(pb.SerializeToString())
    return codec.decode_message(wire, limits or CodecLimits(), sender=SENDER).message


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
@pytest.mark.parametrize("none", [False, True], ids=["filled", "optionals-none"])
def test_every_message_kind_round_trips(kind: str, none: bool) -> None:
    msg = _instance(MESSAGE_TYPES[kind], none=none)
    back = _roundtrip(msg)
    assert type(back) is type(msg)
    assert back == msg
    pb = codec.encode_message(msg)
    assert codec.kind_of(pb) == kind


def test_every_message_class_in_the_module_is_a_registered_kind() -> None:
    classes = {
        obj
        for obj in vars(m).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and hasattr(obj, "KIND")
    }
    assert classes == set(MESSAGE_TYPES.values())
    oneof = overlay_pb2.OverlayMessage.DESCRIPTOR.oneofs_by_name["body"]
    assert len(oneof.fields) == len(MESSAGE_TYPES)


def _proto_fields(cls: type[Any]) -> set[str]:
    desc = getattr(overlay_pb2, codec.proto_name(cls)).DESCRIPTOR
    return {f.name for f in desc.fields}


def test_protobuf_fields_mirror_the_dataclasses_exactly() -> None:
    seen: set[type[Any]] = set()
    todo = list(MESSAGE_TYPES.values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {"certificate"} if cls is m.VrfTicket else set()
        assert _proto_fields(cls) == names | extra, cls.__name__
        hints = typing.get_type_hints(cls, globalns=vars(m), localns={"Signature": Signature})
        for tp in hints.values():
            for arg in [tp, *typing.get_args(tp)]:
                for inner in [arg, *typing.get_args(arg)]:
                    if (
                        dataclasses.is_dataclass(inner)
                        and isinstance(inner, type)
                        and inner is not Signature
                    ):
                        todo.append(inner)
    assert m.NodeRef in seen and m.ClusterDescriptor in seen


def test_signature_round_trips_bit_exactly() -> None:
    sig = _signature(p=50, dim=10_000, seed=3)
    msg = m.SignatureUpdate(epoch=2, cluster_id="c", signature=sig, round=4, p_min=None)
    back = _roundtrip(msg)
    assert back.signature == sig
    assert back.signature.values.tobytes() == sig.values.tobytes()


def test_relayed_tickets_carry_certificates_and_own_tickets_do_not() -> None:
    own = m.VrfTicket(SENDER, bytes(32), bytes(80))
    other = m.VrfTicket("n2", bytes(32), bytes(80))
    certs = {"n2": b"DER-n2", SENDER: b"DER-n1"}
    for ticket, expected in ((own, {}), (other, {"n2": b"DER-n2"})):
        msg = m.ElectionTicket(epoch=1, level=1, ticket=ticket, hops=1)
        pb = codec.encode_message(msg, sender=SENDER, certificate_for=certs.get)
        decoded = codec.decode_message(pb, CodecLimits(), sender=SENDER)
        assert decoded.message == msg
        assert decoded.certificates == expected


def _ref(node_id: str = SENDER) -> m.NodeRef:
    return m.NodeRef(node_id, "127.0.0.1:1")


def _decode(msg: Any, limits: CodecLimits | None = None, sender: str = SENDER) -> Any:
    pb = codec.encode_message(msg)
    return codec.decode_message(pb, limits or CodecLimits(), sender=sender).message


def test_sender_claims_must_match_the_certificate() -> None:
    with pytest.raises(IdentityMismatch) as err:
        _decode(m.PeerExchange(_ref("n9"), (), False))
    assert err.value.status == "PERMISSION_DENIED"
    assert err.value.reason == "identity_mismatch"
    ticket = m.VrfTicket("n9", bytes(32), bytes(80))
    with pytest.raises(IdentityMismatch):
        _decode(m.Register(1, 1, _ref(SENDER), ticket, 0))
    with pytest.raises(IdentityMismatch):
        _decode(m.Register(1, 1, _ref("n9"), m.VrfTicket(SENDER, bytes(32), bytes(80)), 0))
    # Fields naming other nodes are not the sender's claim.
    _decode(m.Neighbor(1, 1, _ref("n9"), ticket))


def _candidate_result(similarity: float) -> m.QueryResult:
    stats = m.SearchStats()
    return m.QueryResult("q", 1, (m.Candidate("n2", "a:1", similarity),), stats, 0.5, True, None)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(value: float) -> None:
    with pytest.raises(CodecError) as err:
        _decode(_candidate_result(value))
    assert err.value.reason == "non_finite"
    assert err.value.status == "INVALID_ARGUMENT"


def test_similarity_outside_cosine_range_is_refused() -> None:
    with pytest.raises(CodecError) as err:
        _decode(_candidate_result(1.5))
    assert err.value.reason == "out_of_range"


def test_oversized_signature_is_refused() -> None:
    msg = m.SignatureUpdate(1, "c", _signature(p=40, dim=100), 1, None)
    with pytest.raises(CodecError) as err:
        _decode(msg, CodecLimits(max_signature_p=32))
    assert err.value.reason == "oversized"
    assert _decode(msg, CodecLimits(max_signature_p=40)).signature.p == 40


def test_corrupt_signature_bytes_are_refused() -> None:
    pb = codec.encode_message(m.SignatureUpdate(1, "c", _signature(), 1, None))
    pb.signature_update.signature = pb.signature_update.signature[:-1]
    with pytest.raises(CodecError) as err:
        codec.decode_message(pb, CodecLimits(), sender=SENDER)
    assert err.value.reason == "bad_signature"


def test_too_many_items_are_refused() -> None:
    msg = m.PeerExchange(_ref(), tuple(_ref(f"p{i}") for i in range(5)), False)
    with pytest.raises(CodecError) as err:
        _decode(msg, CodecLimits(max_items=4))
    assert err.value.reason == "too_many_items"


def test_node_ids_must_be_certificate_names() -> None:
    msg = m.PeerExchange(_ref(), (_ref("../etc"),), False)
    with pytest.raises(CodecError) as err:
        _decode(msg)
    assert err.value.reason == "bad_name"


def test_strings_are_bounded_printable_ascii() -> None:
    with pytest.raises(CodecError) as err:
        _decode(m.Heartbeat(1, "x" * 300))
    assert err.value.reason == "oversized"
    with pytest.raises(CodecError) as err:
        _decode(m.Heartbeat(1, "tab\there"))
    assert err.value.reason == "malformed"


def test_oversized_bytes_field_is_refused() -> None:
    msg = m.ElectionTicket(1, 1, m.VrfTicket(SENDER, bytes(300), bytes(80)), 0)
    with pytest.raises(CodecError) as err:
        _decode(msg)
    assert err.value.reason == "oversized"


def test_missing_required_submessage_is_refused() -> None:
    pb = codec.encode_message(m.MemberAssign(1, _instance(m.ClusterDescriptor, none=False)))
    pb.member_assign.ClearField("cluster")
    with pytest.raises(CodecError) as err:
        codec.decode_message(pb, CodecLimits(), sender=SENDER)
    assert err.value.reason == "malformed"


def test_empty_message_is_refused() -> None:
    with pytest.raises(CodecError) as err:
        codec.decode_message(overlay_pb2.OverlayMessage(), CodecLimits(), sender=SENDER)
    assert err.value.reason == "malformed"


def test_integers_keep_their_sign_and_scores_their_64_bits() -> None:
    ack = m.QueryAck(qid="q", cluster_id="c", attempt=-1)
    assert _roundtrip(ack) == ack
    entry = dataclasses.replace(_instance(m.MemberEntry, none=False), score=2**64 - 1)
    assert _roundtrip(m.ClusterState(1, entry_descriptor(), (), (entry,), None, 1)) is not None
    with pytest.raises(CodecError) as err:
        codec.encode_message(
            m.ClusterState(
                1, entry_descriptor(), (), (dataclasses.replace(entry, score=-1),), None, 1
            )
        )
    assert err.value.reason == "unencodable"


def entry_descriptor() -> m.ClusterDescriptor:
    return typing.cast(m.ClusterDescriptor, _instance(m.ClusterDescriptor, none=False))


def test_batches_are_bounded_and_all_or_nothing() -> None:
    good = m.Heartbeat(1, "c")
    env = codec.encode_batch("n2", [good] * 3)
    assert [d.message for d in codec.decode_batch(env, CodecLimits(), sender=SENDER)] == [good] * 3
    with pytest.raises(CodecError) as err:
        codec.decode_batch(env, CodecLimits(max_batch=2), sender=SENDER)
    assert err.value.reason == "too_many_items"
    bad = codec.encode_batch("n2", [good, m.PeerExchange(_ref("n9"), (), False)])
    with pytest.raises(IdentityMismatch) as mismatch:
        codec.decode_batch(bad, CodecLimits(), sender=SENDER)
    assert "message 1" in str(mismatch.value)


@settings(max_examples=60, deadline=None)
@given(
    similarity=st.floats(min_value=-1.0, max_value=1.0),
    qid=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64),
    k=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_query_messages_round_trip_any_valid_values(similarity: float, qid: str, k: int) -> None:
    cand = m.Candidate("n2", "127.0.0.1:5", similarity)
    partial = dataclasses.replace(
        _instance(m.QueryPartial, none=False),
        qid=qid,
        candidates=(cand,),
        stats=m.SearchStats(samples=(similarity,)),
    )
    assert _roundtrip(partial) == partial
    query = dataclasses.replace(_instance(m.Query, none=True), qid=qid, k=k)
    assert _roundtrip(query) == query


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        pb = overlay_pb2.OverlayMessage.FromString(data)
    except Exception:  # protobuf's DecodeError: refused before the codec sees it
        return
    with contextlib.suppress(CodecError):
        codec.decode_message(pb, CodecLimits(), sender=SENDER)


def test_only_protocol_messages_can_be_encoded() -> None:
    with pytest.raises(CodecError) as err:
        codec.encode_message(_ref())  # type: ignore[arg-type]
    assert err.value.reason == "schema"
