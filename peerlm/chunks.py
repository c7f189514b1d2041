"""Chunked, checksummed payload streams (adapters, knowledge packages).

A payload is never one message: :func:`iter_chunks` cuts it into ``Chunk`` messages that
each repeat the total size and the SHA-256 of the whole; :class:`ChunkAssembler` accepts
them in order, refuses an oversized transfer at the first chunk, and verifies the hash
at the end. Both ends are pure (no I/O) so any transport can use them.

Costs, because adapters run to tens of MiB and every pass over them shows in throughput:

* the sender hashes a payload once (:class:`HashedPayload`, made once per adapter version or
  built package and reused by every stream of it and by the sender proof);
* :func:`iter_chunks` slices through a ``memoryview``, so each chunk costs one copy (into
  the ``Chunk`` message, which protobuf requires to own ``bytes``);
* the assembler keeps the chunks' own ``bytes`` (no copy; their sum is bounded by the
  announced size, itself bounded by ``max_bytes``), hashes each as it arrives, so the digest
  is ready when the last chunk is and the receiver's hashing overlaps the sender's
  streaming, and joins them once at the end: one copy on this side. (A buffer preallocated
  at the announced size would cost a copy per chunk *and* a final ``bytes()`` copy, since
  safetensors reads only ``bytes``.) The sender proof is checked against the assembler's
  digest (:attr:`ChunkAssembler.sha256`) without another pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from peerlm.wire.v1 import common_pb2

__all__ = ["ChunkAssembler", "ChunkError", "HashedPayload", "Hasher", "iter_chunks"]


class Hasher(Protocol):
    """What the assembler feeds each chunk to: ``hashlib.sha256()`` or a transport's
    background hasher (same calls, the work elsewhere)."""

    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


class ChunkError(ValueError):
    """A chunk stream is malformed, oversized or corrupt."""


@dataclass(frozen=True)
class HashedPayload:
    """Bytes to stream with their SHA-256, computed once."""

    data: bytes
    sha256: bytes

    @classmethod
    def of(cls, data: bytes) -> HashedPayload:
        """Wrap ``data``, hashing it (its one SHA-256 pass)."""
        return cls(data, hashlib.sha256(data).digest())


def iter_chunks(
    payload: bytes | HashedPayload,
    chunk_bytes: int,
    content_type: str = "application/octet-stream",
) -> Iterator[common_pb2.Chunk]:
    """Yield ``payload`` as ordered chunks of at most ``chunk_bytes`` bytes each.

    A :class:`HashedPayload` is streamed with its known digest; plain bytes are hashed here.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    hashed = payload if isinstance(payload, HashedPayload) else HashedPayload.of(payload)
    total = len(hashed.data)
    view = memoryview(hashed.data)
    offset = 0
    first = True
    while first or offset < total:
        end = min(offset + chunk_bytes, total)
        yield common_pb2.Chunk(
            offset=offset,
            total_size=total,
            sha256=hashed.sha256,
            data=view[offset:end].tobytes(),
            content_type=content_type if first else "",
        )
        offset = end
        first = False


class ChunkAssembler:
    """Reassembles one payload from its chunks, enforcing ``max_bytes``.

    ``hasher`` (default ``hashlib.sha256()``) receives every chunk's bytes in order; a
    transport may pass one that hashes on another thread, so hashing overlaps receiving.
    """

    def __init__(self, max_bytes: int, hasher: Hasher | None = None) -> None:
        self._max = max_bytes
        self._parts: list[bytes] = []
        self._filled = 0
        self._hash: Hasher = hasher if hasher is not None else hashlib.sha256()
        self._total: int | None = None
        self._digest: bytes | None = None
        self._verified = False
        self.content_type = ""

    @property
    def sha256(self) -> bytes:
        """The verified SHA-256 of the payload (after :meth:`finish`)."""
        if self._digest is None or not self._verified:
            raise ChunkError("the payload is not complete and verified")
        return self._digest

    def add(self, chunk: common_pb2.Chunk) -> int:
        """Take the next chunk and return its payload bytes; raises :class:`ChunkError` at
        the first inconsistency. (Reading ``chunk.data`` copies it, so callers count with
        the return value instead of reading it again.)"""
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
        if chunk.offset != self._filled:
            raise ChunkError(f"chunk at offset {chunk.offset}, expected {self._filled}")
        data = chunk.data  # the one read of the field: protobuf copies on every access
        end = self._filled + len(data)
        if end > self._total:
            raise ChunkError("chunks carry more bytes than the announced total size")
        self._parts.append(data)
        self._hash.update(data)
        self._filled = end
        return len(data)

    def finish(self) -> bytes:
        """The verified payload; raises :class:`ChunkError` if incomplete or corrupt."""
        if self._total is None:
            raise ChunkError("empty stream: no chunk received")
        if self._filled != self._total:
            raise ChunkError(f"stream ended at {self._filled} of {self._total} bytes")
        if self._hash.digest() != self._digest:
            raise ChunkError("SHA-256 mismatch: payload corrupt")
        self._verified = True
        # safetensors and the package decoder read ``bytes``: the one copy on this side.
        return b"".join(self._parts)
