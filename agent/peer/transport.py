"""How an exchange protocol reaches the peers a directive names: the two transfers a
student makes (a teacher's knowledge package, a sender's adapter) behind one interface.

The daemon's transport is :class:`GrpcPeers`: ``PeerExchange.FetchPackage`` and
``PullAdapter`` over the node context's mTLS channels, each payload bounded, digested and
checked against the sender proof of the peer the directive named
(:mod:`peerlm.agent.peer.client`). The protocols (:mod:`peerlm.agent.exchange`) and the
merge they share with the overlay (:func:`~peerlm.agent.merging.pull_aggregate.pull_and_aggregate`)
see only :class:`PeerTransport`, so the same protocol objects also run where the peers are
in one process: the experiment harness (:mod:`peerlm.app.experiment_agent`) serves the
bytes its teachers built, through the same decoding, vetting, gate and report.

A transport raises :class:`~peerlm.agent.peer.client.PeerExchangeError` (with its
``reason``) for every failed transfer, as the gRPC client does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from peerlm.agent.peer.client import fetch_package, pull_adapter_with_round

if TYPE_CHECKING:
    from peerlm.node import NodeContext

__all__ = ["GrpcPeers", "PeerTransport"]


class PeerTransport(Protocol):
    """The student's two transfers from a peer at ``endpoint`` (see the module docstring)."""

    async def fetch_package(
        self,
        endpoint: str,
        directive_id: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float,
        tokenizer_sha256: str | None = None,
    ) -> bytes:
        """The knowledge package of ``directive_id`` from teacher ``expect`` (at most
        ``max_bytes``; ``tokenizer_sha256`` announces ours, for a logits package)."""
        ...

    async def pull_adapter(
        self,
        endpoint: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float | None,
    ) -> tuple[int, bytes]:
        """The latest adapter of peer ``expect``: (the round it is of, safetensors bytes)."""
        ...


@dataclass(frozen=True)
class GrpcPeers:
    """The daemon's transport: the peer service over ``ctx``'s channels (mTLS, proofs)."""

    ctx: NodeContext

    async def fetch_package(
        self,
        endpoint: str,
        directive_id: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float,
        tokenizer_sha256: str | None = None,
    ) -> bytes:
        """:func:`~peerlm.agent.peer.client.fetch_package` over ``ctx``."""
        return await fetch_package(
            self.ctx,
            endpoint,
            directive_id,
            expect=expect,
            max_bytes=max_bytes,
            timeout_s=timeout_s,
            tokenizer_sha256=tokenizer_sha256,
        )

    async def pull_adapter(
        self,
        endpoint: str,
        *,
        expect: str | None,
        max_bytes: int,
        timeout_s: float | None,
    ) -> tuple[int, bytes]:
        """:func:`~peerlm.agent.peer.client.pull_adapter_with_round` (latest) over ``ctx``."""
        return await pull_adapter_with_round(
            self.ctx, endpoint, 0, expect=expect, max_bytes=max_bytes, timeout_s=timeout_s
        )
