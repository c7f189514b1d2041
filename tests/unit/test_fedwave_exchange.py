"""FedWave's exchange core (no I/O): serving decisions, the pull plan, accepting parts, and
the router aggregate over what arrived."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.exchange import (
    PartKind,
    PartStore,
    PullRefusal,
    PullTarget,
    ShapeBounds,
    accept_part,
    aggregate_routers,
    decide_pull,
    parse_part_content_type,
    part_content_type,
    plan_pulls,
)
from peerlm.agent.fedwave.params import RouterSettings, VCLayerSettings
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import encode_router, router_shapes
from peerlm.agent.fedwave.vclayer import VCLayer, encode_vclayer
from peerlm.agent.fedwave.workflow import Workflow

from peerlm.chunks import HashedPayload

WORKFLOW = Workflow.model_validate(
    {
        "stages": [
            {"name": "specify", "agents": ["a1", "a2"]},
            {"name": "implement", "agents": ["a3"]},
            {"name": "test", "agents": ["a4"]},
        ]
    }
)
D = 16
RS = RouterSettings(hidden=8)
VS = VCLayerSettings(d_vc=8, heads=2)


def _router(seed: int, hidden: int = D) -> MoERouter:
    return MoERouter(hidden, 3, RS, generator=torch.Generator().manual_seed(seed))


def _bounds(**kw: int) -> ShapeBounds:
    return ShapeBounds(router_shapes=router_shapes(_router(0)), hidden_size=D, vclayer=VS, **kw)  # type: ignore[arg-type]


def test_the_store_serves_exact_rounds_and_says_why_not() -> None:
    store = PartStore(keep_rounds=2)
    refusal = store.get(1, PartKind.ROUTER)
    assert isinstance(refusal, PullRefusal)
    assert (refusal.status, refusal.reason) == ("UNAVAILABLE", "not_yet")
    assert "none yet" in refusal.message
    store.publish(1, {PartKind.ROUTER: b"r1"})
    store.publish(2, {PartKind.ROUTER: b"r2", PartKind.VCLAYER: b"v2"})
    store.publish(3, {PartKind.ROUTER: b"r3"})
    assert store.rounds == (2, 3)
    assert store.get(2, PartKind.VCLAYER) == HashedPayload.of(b"v2")
    gone, missing, later = (
        store.get(1, PartKind.ROUTER),
        store.get(3, PartKind.VCLAYER),
        store.get(4, PartKind.ROUTER),
    )
    assert isinstance(gone, PullRefusal) and (gone.status, gone.reason) == ("NOT_FOUND", "gone")
    assert isinstance(missing, PullRefusal) and missing.reason == "no_part"
    assert isinstance(later, PullRefusal) and "the newest is 3" in later.message
    # A round's parts never change once published: every puller gets the same bytes.
    store.publish(3, {PartKind.ROUTER: b"r3", PartKind.VCLAYER: b"v3"})
    with pytest.raises(ValueError, match="already published, differently"):
        store.publish(3, {PartKind.ROUTER: b"other"})
    with pytest.raises(ValueError, match="older than the newest"):
        store.publish(2, {PartKind.ROUTER: b"r2"})
    with pytest.raises(ValueError, match="nothing"):
        store.publish(4, {})
    assert store.get(3, PartKind.ROUTER) == HashedPayload.of(b"r3")


def test_only_the_workflows_agents_are_served() -> None:
    store = PartStore()
    store.publish(5, {PartKind.ROUTER: b"blob"})
    denied = decide_pull(WORKFLOW, "mallory", store, 5, PartKind.ROUTER, me="a1")
    assert isinstance(denied, PullRefusal)
    assert (denied.status, denied.reason) == ("PERMISSION_DENIED", "not_in_workflow")
    bad = decide_pull(WORKFLOW, "a4", store, 5, None, me="a1")
    assert isinstance(bad, PullRefusal) and bad.status == "INVALID_ARGUMENT"
    assert decide_pull(WORKFLOW, "a4", store, 5, PartKind.ROUTER, me="a1") == HashedPayload.of(
        b"blob"
    )


def test_an_adapter_is_served_only_to_the_other_stages() -> None:
    """Hostile-member audit: a1's adapter goes to a3 and a4 (other stages), never to a2
    (a1's own stage, ``same_stage``), whose routers and VCLayers it still gets."""
    store = PartStore()
    store.publish(5, {PartKind.ROUTER: b"r", PartKind.ADAPTER: b"lora"})
    same = decide_pull(WORKFLOW, "a2", store, 5, PartKind.ADAPTER, me="a1")
    assert isinstance(same, PullRefusal)
    assert (same.status, same.reason) == ("PERMISSION_DENIED", "same_stage")
    assert decide_pull(WORKFLOW, "a2", store, 5, PartKind.ROUTER, me="a1") == HashedPayload.of(b"r")
    for other in ("a3", "a4"):
        got = decide_pull(WORKFLOW, other, store, 5, PartKind.ADAPTER, me="a1")
        assert got == HashedPayload.of(b"lora")


def test_each_agent_pulls_every_router_and_its_neighbours_vclayers() -> None:
    r, v = PartKind.ROUTER, PartKind.VCLAYER
    assert plan_pulls(WORKFLOW, "a1") == sorted(
        [PullTarget("a2", r), PullTarget("a3", r), PullTarget("a4", r), PullTarget("a3", v)]
    )
    assert plan_pulls(WORKFLOW, "a3") == sorted(
        [PullTarget(a, r) for a in ("a1", "a2", "a4")]
        + [PullTarget(a, v) for a in ("a1", "a2", "a4")]
    )
    assert PullTarget("a3", v) in plan_pulls(WORKFLOW, "a4")
    with pytest.raises(KeyError):
        plan_pulls(WORKFLOW, "mallory")


def test_content_types_name_the_part_and_round() -> None:
    assert parse_part_content_type(part_content_type(PartKind.VCLAYER, 7)) == (PartKind.VCLAYER, 7)
    for bad in ("application/octet-stream", "application/vnd.peerlm.fedwave-router+safetensors"):
        with pytest.raises(ValueError):
            parse_part_content_type(bad)


def test_a_good_router_and_vclayer_are_accepted() -> None:
    router = accept_part(
        WORKFLOW,
        "a2",
        PartKind.ROUTER,
        4,
        encode_router(_router(2), n_samples=30, round=4),
        _bounds(),
    )
    assert router.router is not None and router.router.n_samples == 30
    layer = VCLayer(D, VS, generator=torch.Generator().manual_seed(1))
    got = accept_part(
        WORKFLOW, "a3", PartKind.VCLAYER, 4, encode_vclayer(layer, stage="implement"), _bounds()
    )
    assert got.vclayer is not None and torch.equal(got.vclayer.w_q, layer.w_q)
    assert torch.equal(got.vclayer.stage_embedding, layer.stage_embedding)


def _nan_router() -> bytes:
    router = _router(3)
    with torch.no_grad():
        router.fc1.weight[0, 0] = float("nan")
    return encode_router(router, n_samples=5, round=4)


def _r(hidden: int = D, round_: int = 4) -> Callable[[], bytes]:
    return lambda: encode_router(_router(1, hidden=hidden), n_samples=5, round=round_)


def _v(width: int = D, stage: str = "implement") -> Callable[[], bytes]:
    return lambda: encode_vclayer(VCLayer(width, VS), stage=stage)


R, V = PartKind.ROUTER, PartKind.VCLAYER


@pytest.mark.parametrize(
    ("agent", "kind", "blob", "bounds", "reason"),
    [
        ("mallory", R, _r(), {}, "not_in_workflow"),
        ("a2", R, _r(hidden=D + 1), {}, "shape"),
        ("a2", R, _nan_router, {}, "non_finite"),
        ("a2", R, _r(round_=3), {}, "round"),
        ("a2", R, _r(), {"max_router_bytes": 1024}, "too_large"),
        ("a2", R, lambda: b"\x00" * 64, {}, "decode"),
        ("a3", V, _v(stage="test"), {}, "stage"),
        ("a3", V, _v(width=D + 2), {}, "shape"),
        ("a3", V, _v(), {"max_vclayer_bytes": 1024}, "too_large"),
    ],
)
def test_a_part_that_does_not_fit_is_refused_with_its_reason(
    agent: str, kind: PartKind, blob: Callable[[], bytes], bounds: dict[str, int], reason: str
) -> None:
    data = blob()
    with pytest.raises(FedWaveError) as err:
        accept_part(WORKFLOW, agent, kind, 4, data, _bounds(**bounds))
    assert err.value.reason == reason


def test_agents_that_aggregate_the_same_routers_get_the_same_bits() -> None:
    routers = {name: _router(seed) for seed, name in enumerate(["a1", "a2", "a3", "a4"])}
    samples = {"a1": 10, "a2": 30, "a3": 7, "a4": 53}
    shapes = router_shapes(routers["a1"])
    blobs = {n: encode_router(r, n_samples=samples[n], round=2) for n, r in routers.items()}
    # The paper's weights (no cap), and a cap on the claims (2 x the lower median 10: a2's
    # and a4's weights are 20): equal bits at every agent either way.
    for ratio in (2.0, None):
        results = []
        for me in reversed(sorted(routers)):
            pulled = {}
            for other in sorted(routers, reverse=me == "a2"):  # arrival order must not matter
                if other != me:
                    part = accept_part(WORKFLOW, other, PartKind.ROUTER, 2, blobs[other], _bounds())
                    assert part.router is not None
                    pulled[other] = part.router
            merged, members = aggregate_routers(
                me,
                routers[me].state_dict(),
                samples[me],
                pulled,
                shapes,
                max_weight_ratio=ratio,
                rule="fedavg",
            )
            assert members == ("a1", "a2", "a3", "a4")
            results.append(merged)
        for other in results[1:]:
            assert all(torch.equal(results[0][k], other[k]) for k in results[0])
    # Eq. 9 by hand for one entry (uncapped).
    expected = sum(
        samples[n] / 100 * routers[n].state_dict()["fc1.weight"][0, 0].double() for n in routers
    )
    assert results[0]["fc1.weight"][0, 0].item() == pytest.approx(float(expected), rel=1e-6)
    with pytest.raises(FedWaveError, match="attributed to this agent"):
        aggregate_routers("a1", routers["a1"].state_dict(), 10, {"a1": part.router}, shapes)


def test_parts_travel_as_chunk_streams_and_messages_carry_no_payload() -> None:
    from google.protobuf.descriptor import FieldDescriptor

    from peerlm.wire.v1 import common_pb2, fedwave_pb2

    service = fedwave_pb2.DESCRIPTOR.services_by_name["FedWaveExchange"]
    pull = service.methods_by_name["PullPart"]
    assert pull.server_streaming and pull.output_type is common_pb2.Chunk.DESCRIPTOR
    for message in (pull.input_type, service.methods_by_name["DescribeWorkflow"].output_type):
        assert all(f.type != FieldDescriptor.TYPE_BYTES for f in message.fields), message.name


async def test_a_pull_that_cannot_even_be_dialled_is_missing_not_fatal() -> None:
    from peerlm.agent.fedwave.exchange_client import pull_round

    from tests.node_contexts import dev_context

    # insecure-dev may dial loopback only: the dial to a2 is refused before any traffic;
    # a3 has no address. The round goes on and counts both.
    ctx = dev_context("fw", "a1")
    targets = [PullTarget("a2", PartKind.ROUTER), PullTarget("a3", PartKind.ROUTER)]
    parts = await pull_round(
        ctx, WORKFLOW, "a1", 1, {"a2": "10.1.2.3:50061"}, _bounds(), deadline_s=5, targets=targets
    )
    assert parts.missing == {targets[0]: "error", targets[1]: "no_endpoint"}
    count = ctx.registry.get_sample_value(
        "peerlm_agent_fedwave_missing_parts_total", {"kind": "router", "reason": "error"}
    )
    assert count == 1


def test_serving_parts_loads_no_torch() -> None:
    # A process that only serves parts (the fuzz and slow-reader servers) starts without it.
    import subprocess
    import sys

    code = "import sys, peerlm.agent.fedwave.exchange_service; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "False"
