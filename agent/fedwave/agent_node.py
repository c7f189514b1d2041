"""An agent's FedWave role at start: its stage, its parts' store and the service that
serves them, with round 0's parts published.

:func:`start_fedwave` is what the agent daemon calls when ``fedwave.workflow`` is set: it
checks that the certificate name is an agent of the workflow (in ``fedwave.stage`` if that
is set; the daemon refuses to start otherwise), builds the initial router (every agent of
the workflow the same, from ``fedwave.seed``) and this stage's initial VCLayer for the
model's width, publishes them as round 0 (the router with ``n_i`` = the agent's private
training examples), and returns the :class:`FedWaveExchangeService` to serve beside the
peer exchange. The round loop that trains them and publishes later rounds is
:mod:`~peerlm.agent.fedwave.expert_loop` (docs/fedwave.md, section 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peerlm.agent.adapter_codec import AdapterSpec
from peerlm.agent.fedwave.exchange import PartKind, PartStore, ShapeBounds
from peerlm.agent.fedwave.exchange_service import FedWaveExchangeService
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import encode_router, router_shapes
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCLayer, encode_vclayer
from peerlm.agent.peer.stream import PeerStreamer

from peerlm.node import NodeContext

__all__ = ["FedWaveNode", "start_fedwave"]


@dataclass
class FedWaveNode:
    """This agent's FedWave state: its stage, parts, bounds and the service serving them."""

    stage_index: int
    stage: str
    router: MoERouter
    vclayer: VCLayer
    bounds: ShapeBounds
    store: PartStore
    service: FedWaveExchangeService


def start_fedwave(
    ctx: NodeContext,
    settings: FedWaveSettings,
    *,
    hidden_size: int,
    n_samples: int,
    chunk_bytes: int,
    log: Any = None,
    streamer: PeerStreamer | None = None,
    adapter: AdapterSpec | None = None,
) -> FedWaveNode:
    """This agent's FedWave node with round 0 published; ``ValueError`` (with the fix) if
    FedWave is off, the agent is not in the workflow or in another stage than configured,
    or it holds no training example (``n_i`` must be positive). ``adapter``: what the other
    stages' LoRA adapters must fit (this host's spec) when the agent assembles π_SFT; None:
    it takes none."""
    index = settings.member_stage(ctx.name)
    assert settings.workflow is not None  # member_stage refuses without one
    if n_samples < 1:
        raise ValueError("a FedWave expert needs private training examples (n_i >= 1)")
    stage = settings.workflow.stages[index].name
    router = settings.initial_router(hidden_size)
    layer = settings.initial_vclayer(hidden_size, index)
    bounds = ShapeBounds(
        router_shapes=router_shapes(router),
        hidden_size=hidden_size,
        vclayer=settings.vclayer,
        max_router_bytes=settings.max_router_bytes,
        max_vclayer_bytes=settings.max_vclayer_bytes,
        adapter=adapter,
    )
    store = PartStore()
    store.publish(
        0,
        {
            PartKind.ROUTER: encode_router(router, n_samples=n_samples, round=0),
            PartKind.VCLAYER: encode_vclayer(layer, stage=stage),
        },
    )
    service = FedWaveExchangeService(
        settings.workflow,
        ctx.name,
        store,
        chunk_bytes=chunk_bytes,
        registry=ctx.registry,
        max_bytes={kind: bounds.max_bytes(kind) for kind in PartKind},
        signer=ctx.signer,
        log=log if log is not None else ctx.log,
        streamer=streamer,
    )
    ctx.log.info(
        "fedwave_ready",
        stage=stage,
        stage_index=index,
        stages=list(settings.workflow.stage_names),
        n_samples=n_samples,
        published_round=0,
    )
    return FedWaveNode(index, stage, router, layer, bounds, store, service)
