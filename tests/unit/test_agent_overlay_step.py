"""The agent's per-round overlay step when the overlay cannot help: the adapter stays as it
was, the outcome is counted, nothing raises. A real overlay node host with no peers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog
import torch
from peerlm.agent import AgentOverlaySettings
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.models.tiny import build_models
from peerlm.agent.overlay_client.step import (
    choose_p,
    overlay_round_step,
    publish_signature,
    pull_settings,
)
from peerlm.overlay.aggregation import DEFAULT_ETA, DEFAULT_KAPPA, DEFAULT_PSI
from peerlm.overlay.metrics import OverlayMetrics
from peerlm.overlay.node import OverlayNode
from peerlm.overlay.params import OverlayParams
from peerlm.overlay.signature import ImportanceTracker
from peerlm.overlay.transport import DeliveryPolicy, OverlayHost, PeerPool

from peerlm.config import GrpcLimits
from peerlm.metrics import new_registry
from peerlm.rpc import create_channel
from tests.node_contexts import dev_context


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def model(micro_models_dir: Path) -> ModelHost:
    [info] = build_models(micro_models_dir, ("gpt2",), size="micro")
    return ModelHost.load(str(info.path), LoraSettings(r=4, alpha=8.0), device="cpu", seed=0)


def _lone_host(name: str) -> OverlayHost:
    """A real overlay node host that never reaches anyone (no bootstrap peers)."""
    params = OverlayParams(hop_time=0.05, epoch_period=3600.0, genesis_time=1e12)
    node = OverlayNode(name, "127.0.0.1:9", params, bytes(range(32)), rng=1)
    metrics = OverlayMetrics(new_registry())
    log = structlog.get_logger("test")
    pool = PeerPool(
        name, lambda t: create_channel(t, GrpcLimits(), None), DeliveryPolicy(), metrics, log
    )
    return OverlayHost(node, pool, metrics, log)


async def _step(
    host: OverlayHost, model: ModelHost, registry: object, pull: bool = True, **kw: object
) -> object:
    async def run(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)

    return await overlay_round_step(
        dev_context("peerlm", host.node_id, registry=registry),  # type: ignore[arg-type]
        host,
        model,
        ImportanceTracker(),
        settings=AgentOverlaySettings(enabled=True, k=2, **kw),  # type: ignore[arg-type]
        round_=1,
        round_timeout_s=2.0,
        run_model=run,
        pull=pull,
    )


def test_lone_node_search_leaves_the_adapter_unchanged(model: ModelHost) -> None:
    before = {k: v.clone() for k, v in model.adapter_state().items()}
    registry = new_registry()

    async def go() -> object:
        host = _lone_host("solo")
        await host.start()
        try:
            host.join([])
            return await _step(host, model, registry, query_timeout_s=0.5)
        finally:
            await host.stop(0)

    result = asyncio.run(go())
    assert result.outcome in ("query_timeout", "query_refused", "no_candidates")  # type: ignore[attr-defined]
    assert result.pulled == [] and result.p >= 1  # type: ignore[attr-defined]
    after = model.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    counted = registry.get_sample_value(  # type: ignore[attr-defined]
        "peerlm_agent_overlay_steps_total",
        {"outcome": result.outcome},  # type: ignore[attr-defined]
    )
    assert counted == 1.0


def test_a_step_after_the_one_shot_only_publishes_the_signature(model: ModelHost) -> None:
    """``aggregate_once`` done: the step publishes this round's signature (others still find
    the agent) and neither searches nor pulls; the outcome ``published`` is counted."""
    before = {k: v.clone() for k, v in model.adapter_state().items()}
    registry = new_registry()
    host = _lone_host("once")
    searched: list[int] = []

    async def no_search(k: int, timeout: float | None = None) -> object:
        searched.append(k)
        raise AssertionError("a one-shot agent searched after its shot")

    host.query = no_search  # type: ignore[method-assign]

    async def go() -> object:
        await host.start()
        try:
            host.join([])
            return await _step(host, model, registry, pull=False)
        finally:
            await host.stop(0)

    result = asyncio.run(go())
    assert result.outcome == "published" and result.p >= 1  # type: ignore[attr-defined]
    assert result.pulled == [] and result.neighbours == [] and not searched  # type: ignore[attr-defined]
    assert host._has_signature
    after = model.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    counted = registry.get_sample_value(  # type: ignore[attr-defined]
        "peerlm_agent_overlay_steps_total", {"outcome": "published"}
    )
    assert counted == 1.0


def test_stopped_host_is_a_refused_query_not_an_error(model: ModelHost) -> None:
    registry = new_registry()

    async def go() -> object:
        host = _lone_host("gone")
        await host.start()
        host.join([])
        await host.stop(0)
        return await _step(host, model, registry)

    result = asyncio.run(go())
    assert result.outcome in ("query_refused", "signature_error")  # type: ignore[attr-defined]
    assert result.detail  # type: ignore[attr-defined]


def test_signature_p_is_the_configured_network_p(model: ModelHost) -> None:
    settings = pull_settings(AgentOverlaySettings(k=3, psi=0.5), 7.0)
    assert settings.max_peers == 3 and settings.timeout_s == 7.0 and settings.psi == 0.5
    # Unset, the PDFL parameters are the aggregation's defaults, defined there only.
    unset = pull_settings(AgentOverlaySettings(), 7.0)
    assert (unset.psi, unset.kappa, unset.eta) == (DEFAULT_PSI, DEFAULT_KAPPA, DEFAULT_ETA)

    async def go() -> object:
        host = _lone_host("fixed")
        await host.start()
        try:
            host.join([])
            return await _step(host, model, new_registry(), signature_p=5, query_timeout_s=0.3)
        finally:
            await host.stop(0)

    result = asyncio.run(go())
    assert result.p == 5 and result.p_min >= 1  # type: ignore[attr-defined]


def test_p_is_the_configured_then_the_network_then_the_own_minimum() -> None:
    assert choose_p(p_min=40, network=None, configured=None, dim=1000) == 40
    assert choose_p(p_min=40, network=64, configured=None, dim=1000) == 64
    assert choose_p(p_min=40, network=64, configured=10, dim=1000) == 10
    assert choose_p(p_min=40, network=5000, configured=None, dim=1000) == 1000


def test_publish_uses_the_network_p_the_overlay_announced(model: ModelHost) -> None:
    host = _lone_host("announced")
    settings = AgentOverlaySettings(enabled=True)

    async def run(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        return fn(*args, **kwargs)

    async def publish() -> tuple[int, int]:
        return await publish_signature(host, model, ImportanceTracker(), settings, run)

    p_own, p_min = asyncio.run(publish())
    assert p_own == p_min  # no build yet: the agent's own P_min
    network = max(1, p_min // 2)
    host.describe = lambda: {"network_p": network}  # type: ignore[method-assign]
    p, _ = asyncio.run(publish())
    assert p == network
