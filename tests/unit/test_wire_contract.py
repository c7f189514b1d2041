"""The CPM contract is non-aggregating: no message can carry parameters, data or packages."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from peerlm.wire.v1 import common_pb2, cpm_pb2, peer_pb2


def _fields(desc: Descriptor, seen: set[str]) -> list[tuple[str, FieldDescriptor]]:
    if desc.full_name in seen:
        return []
    seen.add(desc.full_name)
    out = []
    for f in desc.fields:
        out.append((f"{desc.full_name}.{f.name}", f))
        if f.message_type is not None:
            out.extend(_fields(f.message_type, seen))
    return out


def test_cpm_messages_have_no_bytes_and_no_unbounded_payloads() -> None:
    service = cpm_pb2.DESCRIPTOR.services_by_name["Matchmaker"]
    seen: set[str] = set()
    fields = []
    for method in service.methods:
        fields += _fields(method.input_type, seen)
        fields += _fields(method.output_type, seen)
    assert fields
    for name, f in fields:
        assert f.type != FieldDescriptor.TYPE_BYTES, f"{name} could carry a payload"
        assert f.message_type is None or f.message_type.full_name != "peerlm.v1.Chunk", name
    # The only repeated scalars are the profile vector, whose length the CPM checks (d_p),
    # the advertised protocol names (at most 16 short identifiers, checked by the CPM:
    # services/cpm/menu.py check_protocols) and the overlay top-K (at most 64 names of
    # agents the CPM knows: check_overlay_peers) and the senders a student found of another
    # parameter space (at most a directive's MAX_MERGE_SENDERS, each one of its senders,
    # checked by the CPM before anything is recorded).
    repeated_scalars = [n for n, f in fields if f.is_repeated and f.message_type is None]
    assert repeated_scalars == [
        "peerlm.v1.SubmitProfileRequest.features",
        "peerlm.v1.SubmitProfileRequest.protocols",
        "peerlm.v1.SubmitProfileRequest.overlay_peers",
        "peerlm.v1.ReportRewardRequest.space_mismatch",
    ]


def test_large_payloads_are_chunk_streams() -> None:
    service = peer_pb2.DESCRIPTOR.services_by_name["PeerExchange"]
    for method in service.methods:
        assert method.server_streaming
        assert method.output_type.full_name == common_pb2.Chunk.DESCRIPTOR.full_name
    chunk = {f.name for f in common_pb2.Chunk.DESCRIPTOR.fields}
    assert {"offset", "total_size", "sha256", "data"} <= chunk
