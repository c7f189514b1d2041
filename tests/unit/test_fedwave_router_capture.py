"""A hostile workflow member that captures every agent's router while staying inside every
bound (hostile-member audit): each round it sends the honest agents' router of the round's
start plus a change at 0.98 x the L2 bound with every entry under the per-entry bound, all
of it pushing the inputs of every stage to its own expert, and claims n_i = 1e9.

The rounds are the expert loop's own pure steps (``screen_round``, ``conclude_round``, the
routing check) over three honest agents whose routers learn their stage on synthetic
pooled features (one cluster per stage, AdamW on the routing loss, as ``ExpertTrainer``
does); the attacker shares the third stage. Under the bounds as they were (the ratio of
the aggregate's own norm, Eq. 9 with n_i capped at 4 x the median, no routing check) the
honest agents end routing every stage's examples to the attacker's expert; with the
defaults they keep routing each stage to its own expert and stay equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from peerlm.agent.fedproxy.admission import state_norm
from peerlm.agent.fedwave.exchange import RoundParts
from peerlm.agent.fedwave.expert_round import conclude_round
from peerlm.agent.fedwave.part_admission import router_norm_refusal, screen_round
from peerlm.agent.fedwave.router import MoERouter, router_losses
from peerlm.agent.fedwave.router_codec import MAX_SAMPLES, DecodedRouter, router_shapes
from peerlm.agent.fedwave.routing_check import own_expert_share, routing_refusal
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings
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
HONEST = {"a": 0, "b": 1, "c": 2}  # agent -> its stage (expert)
TARGET = 2  # the attacker's aim: every stage routed to its own stage's expert
WIDTH = 16
N_EXPERTS = 3
SAMPLES = 64
ROUNDS = 12


@dataclass(frozen=True)
class Defence:
    """What the honest agents screen and aggregate with."""

    rule: str
    weight_ratio: float | None
    anchored: bool  # the ratio scales the common initial router's norm (else the start's)
    routing_margin: float | None


BEFORE = Defence("fedavg", 4.0, anchored=False, routing_margin=None)


def _defaults() -> Defence:
    s = FedWaveSettings()
    return Defence(s.router_aggregation, s.max_router_weight_ratio, True, s.routing_check_margin)


def _features() -> dict[int, torch.Tensor]:
    """Pooled features per stage: a shared component (base hidden states share much) plus a
    stage direction, with noise."""
    g = torch.Generator().manual_seed(3)
    common = torch.randn(WIDTH, generator=g) * 2.0
    out = {}
    for stage in range(N_EXPERTS):
        centre = common + torch.randn(WIDTH, generator=g) * 1.5
        out[stage] = centre + 0.5 * torch.randn(32, WIDTH, generator=g)
    return out


def _state(router: MoERouter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in router.state_dict().items()}


def _load(state: dict[str, torch.Tensor]) -> MoERouter:
    router = MoERouter(WIDTH, N_EXPERTS)
    router.load_state_dict(state)
    return router


def _train(start: dict[str, torch.Tensor], features: torch.Tensor, stage: int) -> dict[str, Any]:
    """An honest round: 8 AdamW steps at lr 1e-2 of the router's local loss (Eq. 8's
    routing terms, as ExpertTrainer trains its router copy)."""
    router = _load(start)
    optimiser = torch.optim.AdamW(router.parameters(), lr=1e-2)
    for _ in range(8):
        alpha = router.route_pooled(features)
        loss = router_losses(alpha, stage, torch.zeros(len(features))).total
        optimiser.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
    return _state(router)


def _attack(
    start: dict[str, torch.Tensor], everything: torch.Tensor, accepts: Any
) -> dict[str, torch.Tensor]:
    """The start plus a change along the sign of the gradient that routes every input to
    the target, scaled to 0.98 x the largest change the honest agents' bounds accept."""
    router = _load(start)
    loss = -torch.log(router.route_pooled(everything)[:, TARGET]).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    direction = {k: -p.grad.sign() for k, p in router.named_parameters()}  # type: ignore[union-attr]

    def crafted(scale: float) -> dict[str, torch.Tensor]:
        return {k: start[k] + scale * direction[k] for k in start}

    low, high = 0.0, 1.0
    for _ in range(40):  # the largest accepted scale, by bisection on the agents' own check
        mid = (low + high) / 2
        low, high = (mid, high) if accepts(crafted(mid)) else (low, mid)
    return crafted(0.98 * low)


def _play(defence: Defence, *, attacked: bool = True) -> tuple[dict[str, Any], int]:
    """``ROUNDS`` rounds of the three honest agents (beside the attacker if ``attacked``):
    each honest agent's router at the end, and how many aggregates the routing checks
    refused."""
    s = FedWaveSettings()
    features = _features()
    everything = torch.cat(list(features.values()))
    initial = _state(MoERouter(WIDTH, N_EXPERTS, generator=torch.Generator().manual_seed(0)))
    anchor = state_norm(initial) if defence.anchored else None
    shapes = router_shapes(_load(initial))
    held = {agent: dict(initial) for agent in HONEST}
    vclayer = VCLayer(WIDTH, VCLayerSettings(d_vc=8, heads=2))
    refusals = 0

    def bounds(base: dict[str, torch.Tensor], router: dict[str, torch.Tensor]) -> str | None:
        return router_norm_refusal(
            base,
            router,
            max_ratio=s.max_router_update_ratio or 1.0,
            max_rms=s.max_router_update_rms,
            max_abs=s.max_router_update_abs,
            reference_norm=anchor,
        )

    for t in range(1, ROUNDS + 1):
        trained = {a: _train(held[a], features[stage], stage) for a, stage in HONEST.items()}
        # The attacker aims at agent a's start (every honest agent's, while they agree).
        hostile = _attack(held["a"], everything, lambda r: bounds(held["a"], r) is None)
        sent = {**trained, "h": hostile} if attacked else dict(trained)
        claims = {a: SAMPLES for a in HONEST} | {"h": MAX_SAMPLES}
        for agent, stage in HONEST.items():
            parts = RoundParts(t)
            for other, state in sent.items():
                if other != agent:
                    parts.routers[other] = DecodedRouter(state, claims[other], t)
            screen_round(
                parts,
                base_router=held[agent],
                own_vclayer=vclayer,
                max_router_update_ratio=s.max_router_update_ratio,
                max_vclayer_norm_ratio=None,
                max_router_update_rms=s.max_router_update_rms,
                max_router_update_abs=s.max_router_update_abs,
                router_reference_norm=anchor,
            )
            conclusion = conclude_round(
                WORKFLOW,
                agent,
                trained[agent],
                SAMPLES,
                parts,
                shapes,
                max_weight_ratio=defence.weight_ratio,
                rule=defence.rule,  # type: ignore[arg-type]
            )
            adopted = conclusion.router
            if defence.routing_margin is not None:
                template = _load(initial)
                before = own_expert_share(template, held[agent], features[stage], stage)
                after = own_expert_share(template, adopted, features[stage], stage)
                if routing_refusal(
                    before, after, n_experts=N_EXPERTS, margin=defence.routing_margin
                ):
                    refusals += 1
                    adopted = held[agent]
            held[agent] = adopted
    return held, refusals


def _routing(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean α per stage (rows) over experts (columns)."""
    router = _load(state)
    with torch.no_grad():
        return torch.stack([router.route_pooled(f).mean(0) for f in _features().values()])


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only contends for the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_attack_captured_every_honest_router_under_the_old_bounds() -> None:
    held, _ = _play(BEFORE)
    for agent in HONEST:
        alpha = _routing(held[agent])
        # Every stage's examples go to the attacker's expert, the other stages' included.
        assert (alpha.argmax(dim=1) == TARGET).all(), alpha
        assert float(alpha[:, TARGET].min()) > 0.9, alpha


def test_with_the_defaults_no_honest_router_is_captured() -> None:
    """The stage-wise median keeps every entry between two honest stages' values, the
    bound no longer grows with the aggregate, and an agent whose own stage the aggregate
    routes away refuses it: no honest agent sends the other stages to the attacker's
    expert, and none routes its own stage below the uniform router's share (less the
    margin)."""
    defence = _defaults()
    assert defence.routing_margin is not None
    held, refusals = _play(defence)
    features = _features()
    for agent, stage in HONEST.items():
        alpha = _routing(held[agent])
        assert float(alpha[:TARGET, TARGET].max()) < 0.5, (agent, alpha)  # before: > 0.9
        own = own_expert_share(_load(held[agent]), held[agent], features[stage], stage)
        assert own >= 1 / N_EXPERTS - defence.routing_margin, (agent, alpha)
    assert refusals > 0  # the routing check refused the rounds that eroded a stage


def test_with_the_defaults_an_honest_workflow_learns_its_routing_and_stays_equal() -> None:
    """The robust rule costs the honest workflow nothing here: the median of the stages'
    routers still learns to route each stage to its expert, every agent ends with the same
    bits (the median is a function of the set of routers), and no round is refused."""
    held, refusals = _play(_defaults(), attacked=False)
    assert refusals == 0
    states = list(held.values())
    assert all(torch.equal(states[0][k], other[k]) for other in states[1:] for k in states[0])
    alpha = _routing(states[0])
    assert alpha.argmax(dim=1).tolist() == [0, 1, 2], alpha
    assert float(alpha.diagonal().min()) > 0.9, alpha
