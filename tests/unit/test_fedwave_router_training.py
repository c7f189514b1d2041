"""The router's federated training at the experiment's budget.

Each agent holds one stage, so its local routing loss only ever says "stage i"; Eq. 9's
average is what teaches the router the others. These tests run that training (the real
:func:`router_losses`, :func:`fedavg_routers` and the agent's :func:`expert_optimiser`) on
synthetic features shaped like the tiny gpt2's mean-pooled prompt features (a large
component common to all stages, norm ~5; stage offsets ~3.4; within-stage spread ~5):
linearly separable, so a router that learns at all must route them right.
"""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedwave.expert_round import expert_optimiser
from peerlm.agent.fedwave.router import MoERouter, fedavg_routers, router_losses
from peerlm.agent.fedwave.simulation import SimulationConfig

WIDTH, STAGES = 128, 3


def _features(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(WIDTH, generator=g)
    common = 5 * common / common.norm()
    offsets = torch.randn(STAGES, WIDTH, generator=g)
    offsets = 3.4 * offsets / offsets.norm(dim=1, keepdim=True)

    def draw(stage: int, k: int) -> torch.Tensor:
        return common + offsets[stage] + 0.45 * torch.randn(k, WIDTH, generator=g)

    train = [draw(c, 32) for c in range(STAGES)]
    held = torch.cat([draw(c, 16) for c in range(STAGES)])
    return train, held, torch.arange(STAGES).repeat_interleave(16)


def _federated_router(router_lr: float, seed: int, rounds: int = 2, steps: int = 6) -> MoERouter:
    """The experiment's reduced budget: 2 rounds x 6 local steps of 8, FedAvg each round."""
    train, _, _ = _features(seed)
    routers = [
        MoERouter(WIDTH, STAGES, generator=torch.Generator().manual_seed(seed))
        for _ in range(STAGES)
    ]
    # the experts' parameters are stand-ins here: the router's group is what is tested
    experts = [torch.nn.Parameter(torch.zeros(1)) for _ in range(STAGES)]
    optimisers = [
        expert_optimiser([experts[i]], routers[i], lr=2e-3, router_lr=router_lr)
        for i in range(STAGES)
    ]
    for _ in range(rounds):
        for i in range(STAGES):
            for step in range(steps):
                batch = train[i][(torch.arange(8) + 8 * step) % 32]
                loss = router_losses(routers[i].route_pooled(batch), i, torch.ones(8)).total
                optimisers[i].zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimisers[i].step()
        merged = fedavg_routers({str(i): (routers[i].state_dict(), 32) for i in range(STAGES)})
        for router in routers:
            router.load_state_dict(merged)
    return routers[0]


def _accuracy_and_own_alpha(router: MoERouter, seed: int) -> tuple[float, float]:
    _, held, stage = _features(seed)
    with torch.no_grad():
        alpha = router.route_pooled(held)
    accuracy = float((alpha.argmax(dim=1) == stage).float().mean())
    return accuracy, float(alpha[torch.arange(len(stage)), stage].mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_router_group_learns_separable_stages_within_the_reduced_budget(seed: int) -> None:
    accuracy, own = _accuracy_and_own_alpha(
        _federated_router(SimulationConfig().router_lr, seed), seed
    )
    assert accuracy == 1.0
    assert own > 0.5  # top-2 then gives the right expert most of the mixture


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_the_experts_lr_the_router_stays_near_uniform(seed: int) -> None:
    # The earlier behaviour: one AdamW group, the router at the experts' 2e-3.
    _, own = _accuracy_and_own_alpha(_federated_router(2e-3, seed), seed)
    assert own < 0.4  # 1/3 is uniform


def test_the_optimiser_gives_the_router_its_own_group() -> None:
    router = MoERouter(8, 3, generator=torch.Generator().manual_seed(0))
    expert = [torch.nn.Parameter(torch.zeros(2))]
    optimiser = expert_optimiser(expert, router, lr=2e-3, router_lr=1e-2)
    assert [g["lr"] for g in optimiser.param_groups] == [2e-3, 1e-2]
    assert optimiser.param_groups[0]["params"] == expert
    assert optimiser.param_groups[1]["params"] == list(router.parameters())
    assert len(expert_optimiser(expert, None, lr=2e-3, router_lr=1e-2).param_groups) == 1


def test_a_non_positive_router_lr_is_refused() -> None:
    with pytest.raises(ValueError, match="router_lr"):
        SimulationConfig(router_lr=0.0)
