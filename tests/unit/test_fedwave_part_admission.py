"""The norm bounds on a round's parts (agent/fedwave/part_admission.py): a finite router or
VCLayer of 1e30 passes the codecs and is refused here (reason ``norm``), before Eq. 9 or the
collaborative loss see it; honest parts pass; every agent refuses the same routers."""

from __future__ import annotations

import torch
from peerlm.agent.fedproxy.admission import state_norm
from peerlm.agent.fedwave.exchange import (
    PartKind,
    PullTarget,
    RoundParts,
    ShapeBounds,
    accept_part,
)
from peerlm.agent.fedwave.part_admission import NORM_REASON, screen_round
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import encode_router, router_shapes
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings, encode_vclayer
from peerlm.agent.fedwave.workflow import Workflow

WORKFLOW = Workflow.model_validate(
    {
        "stages": [
            {"name": "specify", "agents": ["a"]},
            {"name": "implement", "agents": ["b"]},
            {"name": "test", "agents": ["c", "h"]},
        ]
    }
)
WIDTH = 16
SIZE = VCLayerSettings(d_vc=8, heads=2)


def _router(seed: int) -> MoERouter:
    return MoERouter(WIDTH, 3, generator=torch.Generator().manual_seed(seed))


def _nudged(router: MoERouter, by: float) -> MoERouter:
    out = _router(0)
    out.load_state_dict(router.state_dict())
    with torch.no_grad():
        for p in out.parameters():
            p.add_(by * torch.ones_like(p))
    return out


def _times(module: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(factor)


def _parts(base: MoERouter, hostile_router: MoERouter, hostile_layer: VCLayer) -> RoundParts:
    bounds = ShapeBounds(router_shapes(base), WIDTH, SIZE)
    honest = _nudged(base, 1e-3)
    parts = RoundParts(2)
    blobs = {
        ("a", PartKind.ROUTER): encode_router(honest, n_samples=4, round=2),
        ("h", PartKind.ROUTER): encode_router(hostile_router, n_samples=4, round=2),
        ("c", PartKind.VCLAYER): encode_vclayer(VCLayer(WIDTH, SIZE), stage="test"),
        ("h", PartKind.VCLAYER): encode_vclayer(hostile_layer, stage="test"),
    }
    for (agent, kind), blob in blobs.items():
        # Finite values of the right shape and size: the codecs take them all.
        parts.add(accept_part(WORKFLOW, agent, kind, 2, blob, bounds))
    return parts


def test_huge_finite_parts_pass_the_codecs_and_are_refused_by_the_norm_bound() -> None:
    base = _router(0)
    huge_router, huge_layer = _router(1), VCLayer(WIDTH, SIZE)
    _times(huge_router, 1e30)
    _times(huge_layer, 1e30)
    parts = _parts(base, huge_router, huge_layer)
    assert set(parts.routers) == {"a", "h"} and set(parts.vclayers) == {"c", "h"}
    refused = screen_round(
        parts,
        base_router=base.state_dict(),
        own_vclayer=VCLayer(WIDTH, SIZE),
        max_router_update_ratio=1.0,
        max_vclayer_norm_ratio=10.0,
    )
    assert set(refused) == {PullTarget("h", PartKind.ROUTER), PullTarget("h", PartKind.VCLAYER)}
    assert "fedwave.max_router_update_ratio" in refused[PullTarget("h", PartKind.ROUTER)]
    assert set(parts.routers) == {"a"} and set(parts.vclayers) == {"c"}
    assert parts.rejected == {t: NORM_REASON for t in refused}


def test_without_a_bound_the_huge_parts_stay_and_a_moderate_change_is_judged_by_the_ratio() -> None:
    base = _router(0)
    twice = _nudged(base, 0.0)
    _times(twice, 3.0)  # update = 2 x the base: over a ratio of 1, under one of 3
    parts = _parts(base, twice, VCLayer(WIDTH, SIZE))
    kwargs = {"base_router": base.state_dict(), "own_vclayer": VCLayer(WIDTH, SIZE)}
    assert not screen_round(
        parts, max_router_update_ratio=None, max_vclayer_norm_ratio=None, **kwargs
    )
    assert not screen_round(
        parts, max_router_update_ratio=3.0, max_vclayer_norm_ratio=10.0, **kwargs
    )
    refused = screen_round(
        parts, max_router_update_ratio=1.0, max_vclayer_norm_ratio=10.0, **kwargs
    )
    assert set(refused) == {PullTarget("h", PartKind.ROUTER)}
    assert set(parts.routers) == {"a"}


def test_a_nan_norm_is_refused() -> None:
    """A NaN reference makes every norm comparison false: refused, not let through."""
    base = _router(0)
    parts = _parts(base, _router(1), VCLayer(WIDTH, SIZE))
    nan_base = {k: torch.full_like(v, float("nan")) for k, v in base.state_dict().items()}
    refused = screen_round(
        parts,
        base_router=nan_base,
        own_vclayer=VCLayer(WIDTH, SIZE),
        max_router_update_ratio=1.0,
        max_vclayer_norm_ratio=None,
    )
    assert set(refused) == {PullTarget("a", PartKind.ROUTER), PullTarget("h", PartKind.ROUTER)}


def test_the_rms_floor_admits_an_adam_sized_change_of_a_small_router_and_no_more() -> None:
    """A router that starts small leaves a ratio of its own norm within a few AdamW steps
    (each entry moves by about the lr a step): the root-mean-square floor lets a change of
    0.1 per entry in, refuses one of 0.3, and only widens the ratio's bound."""
    base = _router(0)
    entries = sum(p.numel() for p in base.parameters())
    for by, rms, refused_h in ((0.1, 0.25, False), (0.1, 0.0, True), (0.3, 0.25, True)):
        moved = _nudged(base, by)  # every entry moved by ``by``: root-mean-square ``by``
        assert state_norm(base.state_dict()) < 0.1 * entries**0.5  # over the ratio of 1
        parts = _parts(base, moved, VCLayer(WIDTH, SIZE))
        refused = screen_round(
            parts,
            base_router=base.state_dict(),
            own_vclayer=VCLayer(WIDTH, SIZE),
            max_router_update_ratio=1.0,
            max_vclayer_norm_ratio=None,
            max_router_update_rms=rms,
        )
        assert (PullTarget("h", PartKind.ROUTER) in refused) is refused_h, (by, rms)
        assert "a" in parts.routers
        if refused_h:
            assert "fedwave.max_router_update_rms" in refused[PullTarget("h", PartKind.ROUTER)]


def test_a_router_at_the_rms_floor_with_its_budget_in_one_bias_is_refused() -> None:
    """Hostile member: the root-mean-square floor bounds the change's L2 norm only, so a
    router that spends the whole budget (0.25 x sqrt(n)) on one output bias passes the
    ratio-and-floor bound, though no AdamW round moves one entry by more than about
    lr x steps. Unscreened, it turns the Eq. 9 mean of four equal-weight routers to its
    expert for every input; the default per-entry bound refuses it (reason ``norm``)."""
    from peerlm.agent.fedwave.router import fedavg_routers
    from peerlm.agent.fedwave.settings import FedWaveSettings

    defaults = FedWaveSettings.model_fields
    ratio = defaults["max_router_update_ratio"].default
    rms = defaults["max_router_update_rms"].default
    base = _router(0)
    entries = sum(p.numel() for p in base.parameters())
    crafted = _nudged(base, 0.0)
    with torch.no_grad():
        crafted.fc2.bias[0] += 0.999 * rms * entries**0.5  # inside the floor's L2 bound
    honest = [_nudged(base, by) for by in (1e-3, -1e-3, 2e-3)]
    pooled = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(7))

    def top1(members: list[MoERouter]) -> torch.Tensor:
        mean = fedavg_routers({str(i): (m.state_dict(), 4) for i, m in enumerate(members)})
        router = _router(0)
        router.load_state_dict(mean)
        with torch.no_grad():
            return router.route_pooled(pooled).argmax(dim=-1)

    # The attack is real: the honest mean spreads the inputs, the crafted one takes them.
    assert len(set(top1(honest).tolist())) > 1
    assert set(top1([*honest, crafted]).tolist()) == {0}
    parts = _parts(base, crafted, VCLayer(WIDTH, SIZE))
    refused = screen_round(
        parts,
        base_router=base.state_dict(),
        own_vclayer=VCLayer(WIDTH, SIZE),
        max_router_update_ratio=ratio,
        max_vclayer_norm_ratio=None,
        max_router_update_rms=rms,
    )
    assert set(refused) == {PullTarget("h", PartKind.ROUTER)}
    assert "fedwave.max_router_update_abs" in refused[PullTarget("h", PartKind.ROUTER)]
    assert set(parts.routers) == {"a"}
    assert parts.rejected == {PullTarget("h", PartKind.ROUTER): NORM_REASON}


def test_a_router_claiming_the_largest_sample_count_does_not_take_over_eq9() -> None:
    """Hostile member: ``n_i`` is the sender's own claim (up to ``MAX_SAMPLES``, 1e9), so a
    router inside every norm bound that claims 1e9 samples would be nearly all of the
    Eq. 9 mean at every agent, the honest members' routers nearly nothing. Under Eq. 9
    (``router_aggregation: fedavg``) each claim is capped at ``max_router_weight_ratio``
    (default 1, the hostile-member audit: 4 still gave the claim 4/7 of the mean) x the
    members' (lower) median claim: the claim weighs like one honest member's, no more.
    Under the default median every router is an equal share whatever it claims."""
    from peerlm.agent.fedwave.exchange import aggregate_routers
    from peerlm.agent.fedwave.router import fedavg_routers
    from peerlm.agent.fedwave.router_codec import MAX_SAMPLES, decode_router
    from peerlm.agent.fedwave.settings import FedWaveSettings

    defaults = FedWaveSettings.model_fields
    base = _router(0)
    shapes = router_shapes(base)
    crafted = _nudged(base, 0.05)  # within the ratio, floor and per-entry bounds
    parts = RoundParts(2)
    routers = {"a": _nudged(base, 1e-3), "b": _nudged(base, -1e-3), "h": crafted}
    for agent, router in routers.items():
        claim = MAX_SAMPLES if agent == "h" else 64
        parts.routers[agent] = decode_router(
            encode_router(router, n_samples=claim, round=2), shapes=shapes
        )
    refused = screen_round(
        parts,
        base_router=base.state_dict(),
        own_vclayer=VCLayer(WIDTH, SIZE),
        max_router_update_ratio=defaults["max_router_update_ratio"].default,
        max_vclayer_norm_ratio=None,
        max_router_update_rms=defaults["max_router_update_rms"].default,
    )
    assert not refused  # every norm bound admits it: only its weight is out of line
    own = _nudged(base, 2e-3).state_dict()
    merged, members = aggregate_routers("c", own, 64, parts.routers, shapes, rule="fedavg")
    assert members == ("a", "b", "c", "h")
    capped = {k: (r.state, 64) for k, r in parts.routers.items()}
    expected = fedavg_routers({**capped, "c": (own, 64)}, shapes=shapes)
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key])
    # The round's conclusion names the capped member (the expert loop counts and logs it).
    from peerlm.agent.fedwave.expert_round import conclude_round

    conclusion = conclude_round(WORKFLOW, "c", own, 64, parts, shapes, rule="fedavg")
    assert conclusion.capped == ("h",)
    assert all(torch.equal(conclusion.router[k], merged[k]) for k in merged)
    # The median takes no weights at all: claiming 1e9 or 64 gives the same bits.
    from peerlm.agent.fedwave.router_codec import DecodedRouter

    median, _ = aggregate_routers("c", own, 64, parts.routers, shapes)
    modest = {k: DecodedRouter(r.state, 64, 2) for k, r in parts.routers.items()}
    same, _ = aggregate_routers("c", own, 64, modest, shapes)
    assert all(torch.equal(median[k], same[k]) for k in median)
    assert not conclude_round(WORKFLOW, "c", own, 64, parts, shapes).capped
