"""Chunked, checksummed payload streams (adapters, knowledge packages).

A payload is never one message: :func:`iter_chunks` cuts it into ``Chunk`` messages that
each repeat the total size and the SHA-256 of the whole; :class:`ChunkAssembler` accepts
them in order, refuses an oversized transfer at the first chunk, and verifies the hash
at the end. Both ends are pure (no I/O) so any transport can use them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from peerlm.wire.v1 import common_pb2

__all__ = ["ChunkAssembler", "ChunkError", "iter_chunks"]


class ChunkError(ValueError):
    """A chunk stream is malformed, oversized or corrupt."""


def iter_chunks(
    payload: bytes, chunk_bytes: int, content_type: str = "application/octet-stream"
) -> Iterator[common_pb2.Chunk]:
    """Yield ``payload`` as ordered chunks of at most ``chunk_bytes`` bytes each."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    digest = hashlib.sha256(payload).digest()
    total = len(payload)
    view = memoryview(payload)
    offset = 0
    first = True
    while first or offset < total:
        piece = bytes(view[offset : offset + chunk_bytes])
        yield common_pb2.Chunk(
            offset=offset,
            total_size=total,
            sha256=digest,
            data=piece,
            content_type=content_type if first else "",
        )
        offset += len(piece)
        first = False


class ChunkAssembler:
    """Reassembles one payload from its chunks, enforcing ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buf = bytearray()
        self._total: int | None = None
        self._digest: bytes | None = None
        self.content_type = ""

    def add(self, chunk: common_pb2.Chunk) -> None:
        """Take the next chunk; raises :class:`ChunkError` at the first inconsistency."""
        if self._total is None:
            if chunk.total_size > self._max:
                raise ChunkError(
                    f"payload of {chunk.total_size} bytes exceeds the limit of {self._max}"
                )
            if len(chunk.sha256) != 32:
                raise ChunkError("first chunk lacks a 32-byte SHA-256")
            self._total = chunk.total_size
            self._digest = chunk.sha256
            self.content_type = chunk.content_type
        elif chunk.total_size != self._total or chunk.sha256 != self._digest:
            raise ChunkError("total size or SHA-256 changed in the middle of a stream")
        if chunk.offset != len(self._buf):
            raise ChunkError(f"chunk at offset {chunk.offset}, expected {len(self._buf)}")
        if len(self._buf) + len(chunk.data) > self._total:
            raise ChunkError("chunks carry more bytes than the announced total size")
        self._buf += chunk.data

    def finish(self) -> bytes:
        """The verified payload; raises :class:`ChunkError` if incomplete or corrupt."""
        if self._total is None:
            raise ChunkError("empty stream: no chunk received")
        if len(self._buf) != self._total:
            raise ChunkError(f"stream ended at {len(self._buf)} of {self._total} bytes")
        if hashlib.sha256(self._buf).digest() != self._digest:
            raise ChunkError("SHA-256 mismatch: payload corrupt")
        return bytes(self._buf)
