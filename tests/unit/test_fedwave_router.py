"""FedWave's MoE router (Eq. 7-9): routing, its losses, top-k and FedAvg among agents."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.router import (
    MoERouter,
    RouterSettings,
    balance_loss,
    entropy_loss,
    fedavg_routers,
    router_losses,
    top_k_routing,
)

PROPS = settings(max_examples=30, deadline=None)


def test_route_is_a_softmax_of_the_mlp_on_the_masked_mean() -> None:
    router = MoERouter(8, 3, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    alpha = router.route(hidden, mask)
    assert alpha.shape == (2, 3)
    torch.testing.assert_close(alpha.sum(-1), torch.ones(2))
    pooled0 = hidden[0, :2].mean(0, keepdim=True)
    torch.testing.assert_close(alpha[:1], torch.softmax(router(pooled0), -1))
    # The same generator seed gives every agent the same initial router.
    twin = MoERouter(8, 3, generator=torch.Generator().manual_seed(0))
    assert all(
        torch.equal(a, b)
        for a, b in zip(router.state_dict().values(), twin.state_dict().values(), strict=True)
    )
    with pytest.raises(FedWaveError, match="at least 2 experts"):
        MoERouter(8, 1)


def test_balance_and_entropy_by_hand() -> None:
    alpha = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    # utilisation (0.75, 0.25): population variance 0.0625
    assert balance_loss(alpha).item() == pytest.approx(0.0625)
    # entropies 0 and ln 2
    assert entropy_loss(alpha).item() == pytest.approx(math.log(2) / 2)


def test_entropy_gradient_is_finite_when_the_softmax_underflows() -> None:
    # A confident router: softmax of (0, -200, 200) underflows to exact zeros in float32.
    # An earlier entropy_loss used xlogy(α, α), whose gradient at α = 0 is log 0 = -inf;
    # the softmax's backward then gave NaN in every logit (and router parameter).
    logits = torch.tensor([[0.0, -200.0, 200.0], [1.0, 2.0, 3.0]], requires_grad=True)
    alpha = torch.softmax(logits, dim=-1)
    assert (alpha[0, :2] == 0).all()
    loss = entropy_loss(alpha)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # the saturated row's entropy is 0 and its gradient 0; the other row's by hand
    p = [math.exp(v) / sum(math.exp(u) for u in (1, 2, 3)) for v in (1, 2, 3)]
    row_entropy = -sum(q * math.log(q) for q in p)
    assert loss.item() == pytest.approx(row_entropy / 2, rel=1e-6)
    assert logits.grad[0].abs().max().item() == 0.0
    # d/dz_j of H/2 = -(1/2) α_j (log α_j + H)
    for j in range(3):
        expected = -0.5 * p[j] * (math.log(p[j]) + row_entropy)
        assert logits.grad[1, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_router_losses_by_hand() -> None:
    alpha = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]], requires_grad=True)
    sft = torch.tensor([2.0, 4.0])
    s = RouterSettings(delta_balance=0.1, delta_entropy=0.2)
    terms = router_losses(alpha, 0, sft, s)
    assert terms.weighted_sft.item() == pytest.approx((0.5 * 2 + 0.25 * 4) / 2)
    assert terms.routing.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)
    util = [0.375, 0.375, 0.25]
    mean = sum(util) / 3
    var = sum((u - mean) ** 2 for u in util) / 3
    assert terms.balance.item() == pytest.approx(var)
    ent = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert terms.entropy.item() == pytest.approx(ent)
    assert terms.total.item() == pytest.approx(
        terms.weighted_sft.item() + terms.routing.item() + 0.1 * var + 0.2 * ent
    )
    literal = router_losses(alpha, 0, sft, RouterSettings(objective="paper"))
    assert literal.routing.item() == 0.0
    with pytest.raises(ValueError, match="outside"):
        router_losses(alpha, 3, sft)
    with pytest.raises(ValueError, match="per-sample"):
        router_losses(alpha, 0, sft[:1])


def _alpha_after_steps(objective: str) -> float:
    gen = torch.Generator().manual_seed(2)
    router = MoERouter(8, 3, RouterSettings(objective=objective), generator=gen)  # type: ignore[arg-type]
    hidden = torch.randn(6, 5, 8, generator=gen)
    sft = torch.full((6,), 2.0)
    optimiser = torch.optim.SGD(router.parameters(), lr=1.0)
    for _ in range(50):
        optimiser.zero_grad()
        router_losses(router.route(hidden), 1, sft, router.settings).total.backward()
        optimiser.step()
    with torch.no_grad():
        return float(router.route(hidden)[:, 1].mean())


def test_the_literal_eq8_drives_the_router_away_from_the_local_expert() -> None:
    """Why the default objective differs from the letter of Eq. 8 (docs/fedwave.md)."""
    assert _alpha_after_steps("paper") < 1 / 3 - 0.05
    assert _alpha_after_steps("stage_label") > 0.9


def test_top_k_keeps_the_largest_and_renormalises() -> None:
    alpha = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    idx, w = top_k_routing(alpha, 2)
    assert idx.tolist() == [[1, 2], [0, 1]]  # ties: lower index first
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.375], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="top_k"):
        top_k_routing(alpha, 5)


def router_state(seed: int) -> dict[str, torch.Tensor]:
    return dict(
        MoERouter(
            6, 3, RouterSettings(hidden=5), generator=torch.Generator().manual_seed(seed)
        ).state_dict()
    )


def test_fedavg_by_hand() -> None:
    a = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([2.0])}
    b = {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([4.0])}
    merged = fedavg_routers({"a1": (a, 1), "a2": (b, 3)})
    torch.testing.assert_close(merged["w"], torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(merged["b"], torch.tensor([3.5]))


@PROPS
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=6, unique=True),
    counts=st.lists(st.integers(1, 10_000), min_size=6, max_size=6),
    order_seed=st.integers(0, 10_000),
)
def test_every_agent_aggregating_the_same_routers_gets_the_same_bits(
    seeds: list[int], counts: list[int], order_seed: int
) -> None:
    routers = {f"agent-{s}": (router_state(s), counts[i]) for i, s in enumerate(seeds)}
    first = fedavg_routers(routers)
    names = list(routers)
    for shift in range(len(names)):  # each agent sees the others' routers in its own order
        order = names[shift:] + names[:shift]
        random.Random(order_seed + shift).shuffle(order)
        again = fedavg_routers({n: routers[n] for n in order})
        assert all(torch.equal(first[k], again[k]) for k in first)
    # And it is the n_i-weighted mean.
    n = sum(c for _, c in routers.values())
    for key, value in first.items():
        expected = sum(c / n * st_[key].double() for st_, c in routers.values())
        torch.testing.assert_close(value.double(), expected, atol=1e-6, rtol=0)


def test_fedavg_refuses_bad_routers_naming_the_agent() -> None:
    good = router_state(0)
    wrong_shape = router_state(1) | {"fc2.weight": torch.zeros(4, 5)}
    nan = router_state(1) | {"fc2.bias": torch.tensor([0.0, float("nan"), 0.0])}
    missing = {k: v for k, v in router_state(1).items() if k != "fc1.bias"}
    ints = router_state(1) | {"fc2.bias": torch.zeros(3, dtype=torch.int64)}
    cases = [
        ({}, "empty"),
        ({"a": (good, 0)}, "weights"),
        ({"a": (good, 1), "m": (wrong_shape, 1)}, "shape"),
        ({"a": (good, 1), "m": (nan, 1)}, "non_finite"),
        ({"a": (good, 1), "m": (missing, 1)}, "keys"),
        ({"a": (good, 1), "m": (ints, 1)}, "dtype"),
    ]
    for routers, reason in cases:
        with pytest.raises(FedWaveError) as info:
            fedavg_routers(routers)  # type: ignore[arg-type]
        assert info.value.reason == reason
        if reason not in ("empty", "weights"):
            assert "'m'" in str(info.value)
    # Against this agent's own shapes, a lone peer of another shape is refused too.
    shapes = {k: tuple(v.shape) for k, v in good.items()}
    with pytest.raises(FedWaveError, match="shape"):
        fedavg_routers({"m": (wrong_shape, 1)}, shapes=shapes)


@PROPS
@given(
    rows=st.lists(st.lists(st.floats(-8, 8), min_size=4, max_size=4), min_size=1, max_size=5),
    k=st.integers(1, 4),
)
def test_top_k_weights_are_the_largest_and_sum_to_one(rows: list[list[float]], k: int) -> None:
    alpha = torch.softmax(torch.tensor(rows, dtype=torch.float64), dim=-1)
    idx, w = top_k_routing(alpha, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(len(rows), dtype=torch.float64))
    for row in range(len(rows)):
        kept = alpha[row, idx[row]]
        dropped = [alpha[row, j].item() for j in range(4) if j not in idx[row].tolist()]
        assert all(kept.min().item() >= d for d in dropped)
        assert bool((kept[:-1] >= kept[1:]).all())  # in descending order
