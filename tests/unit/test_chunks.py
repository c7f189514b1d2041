import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peerlm.chunks import ChunkAssembler, ChunkError, HashedPayload, iter_chunks


@given(st.binary(max_size=5000), st.integers(min_value=1, max_value=700))
def test_round_trip(payload: bytes, size: int) -> None:
    asm = ChunkAssembler(max_bytes=10_000)
    chunks = list(iter_chunks(payload, size, "application/safetensors"))
    assert all(len(c.data) <= size for c in chunks)
    for c in chunks:
        asm.add(c)
    assert asm.finish() == payload
    assert asm.content_type == "application/safetensors"


def test_oversized_refused_at_first_chunk() -> None:
    asm = ChunkAssembler(max_bytes=10)
    with pytest.raises(ChunkError, match="exceeds"):
        asm.add(next(iter_chunks(b"x" * 11, 4)))


def test_gap_truncation_and_corruption_detected() -> None:
    chunks = list(iter_chunks(b"abcdefghij", 3))
    asm = ChunkAssembler(100)
    asm.add(chunks[0])
    with pytest.raises(ChunkError, match="offset"):
        asm.add(chunks[2])
    asm = ChunkAssembler(100)
    asm.add(chunks[0])
    with pytest.raises(ChunkError, match="ended"):
        asm.finish()
    bad = list(iter_chunks(b"abcdefghij", 3))
    bad[1].data = b"XYZ"
    asm = ChunkAssembler(100)
    for c in bad:
        asm.add(c)
    with pytest.raises(ChunkError, match="SHA-256"):
        asm.finish()


def test_header_change_and_empty_stream() -> None:
    a = list(iter_chunks(b"abcdef", 3))
    b = list(iter_chunks(b"abcdeX", 3))
    asm = ChunkAssembler(100)
    asm.add(a[0])
    with pytest.raises(ChunkError, match="changed"):
        asm.add(b[1])
    with pytest.raises(ChunkError, match="empty"):
        ChunkAssembler(100).finish()


def test_known_digest_is_streamed_and_verified_incrementally() -> None:
    payload = bytes(range(256)) * 40
    hashed = HashedPayload.of(payload)
    chunks = list(iter_chunks(hashed, 1000, "x"))
    assert all(c.sha256 == hashed.sha256 for c in chunks)
    asm = ChunkAssembler(len(payload))
    with pytest.raises(ChunkError, match="not complete"):
        _ = asm.sha256
    assert sum(asm.add(c) for c in chunks) == len(payload)
    assert asm.finish() == payload and asm.sha256 == hashlib.sha256(payload).digest()
    # A sender that announces a digest its bytes do not have is caught at the end.
    lying = HashedPayload(payload, hashlib.sha256(b"other").digest())
    asm = ChunkAssembler(len(payload))
    for c in iter_chunks(lying, 1000):
        asm.add(c)
    with pytest.raises(ChunkError, match="SHA-256"):
        asm.finish()
