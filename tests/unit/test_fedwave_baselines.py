"""The federated baselines of the workflow experiment: server optimisers (FedAvgM, FedAdam,
FedYogi) against hand-computed updates, their per-agent replicas, SCAFFOLD's option II
control variates and FedProx's proximal term."""

from __future__ import annotations

import math

import pytest
import torch
from peerlm.agent.fedwave.client_drift import (
    GradientMean,
    corrected_gradients,
    proximal_term,
    scaffold_option2,
    scaffold_server_controls,
    state_bytes,
)
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.router import fedavg_routers
from peerlm.agent.fedwave.server_optimiser import ServerOptimiser, ServerOptSettings


def _x(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float32)}


def test_fedavgm_is_heavy_ball_momentum_on_the_averaged_change() -> None:
    opt = ServerOptimiser(ServerOptSettings("fedavgm", lr=0.5), _x(1.0, 2.0))
    # Round 1: Δ = [0.5, -1.0]; v = Δ; x = x + 0.5 v.
    first = opt.step(_x(1.5, 1.0))["w"]
    assert torch.allclose(first, torch.tensor([1.25, 1.5]), atol=1e-7)
    # Round 2: Δ = [2.0 - 1.25, 1.0 - 1.5] = [0.75, -0.5]; v = 0.9 [0.5, -1] + Δ = [1.2, -1.4].
    second = opt.step(_x(2.0, 1.0))["w"]
    assert torch.allclose(second, torch.tensor([1.25 + 0.6, 1.5 - 0.7]), atol=1e-6)
    assert ServerOptSettings("fedavgm").server_lr == 1.0
    assert ServerOptSettings("fedavgm").momentum == 0.9


def _adaptive_by_hand(kind: str, deltas: list[float]) -> list[float]:
    """Algorithm 2 of Reddi et al. for one coordinate, plain Python floats."""
    eta, b1, b2, tau = 1e-2, 0.9, 0.99, 1e-3
    x, m, v = 0.0, 0.0, tau * tau
    out = []
    for d in deltas:
        m = b1 * m + (1 - b1) * d
        if kind == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        else:
            v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d)
        x = x + eta * m / (math.sqrt(v) + tau)
        out.append(x)
    return out


@pytest.mark.parametrize("kind", ["fedadam", "fedyogi"])
def test_fedadam_and_fedyogi_match_algorithm_2_for_two_rounds(kind: str) -> None:
    opt = ServerOptimiser(ServerOptSettings(kind), _x(0.0, 0.0))
    # Coordinate 0: Δ = 0.1 then -0.05 (Δ² > v: Yogi adds); coordinate 1: Δ = 0.1 then
    # 0.001 (Δ² < v: Yogi subtracts (1 − β2)·Δ², Adam decays v).
    x1 = opt.step(_x(0.1, 0.1))["w"]
    hand0 = _adaptive_by_hand(kind, [0.1, -0.05])
    assert x1[0].item() == pytest.approx(hand0[0], rel=1e-6)
    # The second round's deltas are relative to x1, so the averages are x1 + Δ.
    x2 = opt.step({"w": x1 + torch.tensor([-0.05, 0.001])})["w"]
    hand1 = _adaptive_by_hand(kind, [0.1, 0.001])
    assert x2[0].item() == pytest.approx(hand0[1], rel=1e-5)
    assert x2[1].item() == pytest.approx(hand1[1], rel=1e-5)
    # Round 1 by hand, written out: m = 0.01, v = 0.99e-6 + 1e-4 (Adam) or 1e-6 + 1e-4 (Yogi).
    v1 = 0.99e-6 + 1e-4 if kind == "fedadam" else 1e-6 + 1e-4
    assert x1[0].item() == pytest.approx(1e-2 * 0.01 / (math.sqrt(v1) + 1e-3), rel=1e-6)
    # Yogi's second round on coordinate 1: v1 > Δ² so v2 = v1 − 0.01·1e-6 (Adam: 0.99 v1 + 1e-8).
    v = opt.state()["v.w"]
    v2 = v1 - 1e-8 if kind == "fedyogi" else 0.99 * v1 + 1e-8
    assert v[1].item() == pytest.approx(v2, rel=1e-5)


def test_replicas_stay_bit_identical_given_the_same_client_models() -> None:
    gen = torch.Generator().manual_seed(7)
    initial = {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)}
    for kind in ("fedavgm", "fedadam", "fedyogi"):
        one = ServerOptimiser(ServerOptSettings(kind), initial)
        two = ServerOptimiser(ServerOptSettings(kind), initial)
        other = ServerOptimiser(ServerOptSettings(kind), initial)
        for r in range(3):
            clients = {
                name: (
                    {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in initial.items()},
                    8,
                )
                for name in ("design", "implement", "test")
            }
            # Each agent averages the same set, received in its own order.
            mine = fedavg_routers(clients)
            theirs = fedavg_routers(dict(reversed(list(clients.items()))))
            one.step(mine)
            two.step(theirs)
            other.step({k: v + (1e-3 if r == 1 else 0.0) for k, v in mine.items()})
        s1, s2, s3 = one.state(), two.state(), other.state()
        assert set(s1) == set(s2) and all(torch.equal(s1[k], s2[k]) for k in s1), kind
        # A replica fed a different average does not stay equal (the check can fail).
        assert not all(torch.equal(s1[k], s3[k]) for k in s1), kind


@pytest.mark.parametrize("kind", ["fedavgm", "fedadam", "fedyogi"])
def test_bad_averages_are_refused_and_leave_the_replica_unchanged(kind: str) -> None:
    opt = ServerOptimiser(ServerOptSettings(kind), _x(1.0, 2.0))
    opt.step(_x(1.5, 2.5))
    before = opt.state()
    bad = [
        (_x(float("nan"), 1.0), "non_finite"),
        (_x(1.0, 2.0, 3.0), "shape"),
        ({"w": torch.tensor([1.0, 2.0]), "extra": torch.zeros(1)}, "keys"),
        ({"w": torch.tensor([1, 2])}, "dtype"),
    ]
    for average, reason in bad:
        with pytest.raises(FedWaveError) as info:
            opt.step(average)
        assert info.value.reason == reason
    after = opt.state()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert opt.rounds == 1
    with pytest.raises(FedWaveError, match="unknown server optimiser"):
        ServerOptSettings("fedadagrad")
    with pytest.raises(FedWaveError, match="server lr"):
        ServerOptSettings("fedadam", lr=0.0)
    with pytest.raises(FedWaveError) as info:
        ServerOptimiser(ServerOptSettings(kind), _x(float("inf")))
    assert info.value.reason == "non_finite"


def test_scaffold_option2_and_the_server_controls_by_hand() -> None:
    c_i, c = _x(0.1, -0.2), _x(0.3, 0.0)
    # c_i+ = c_i − c + (x − y)/(K·η): K = 4, η = 0.05.
    new = scaffold_option2(c_i, c, _x(1.0, 1.0), _x(0.8, 1.1), steps=4, lr=0.05)["w"]
    assert torch.allclose(new, torch.tensor([0.1 - 0.3 + 1.0, -0.2 - 0.0 - 0.5]), atol=1e-6)
    deltas = {"a": _x(0.2, 0.0), "b": _x(0.4, -1.0)}
    full = scaffold_server_controls(c, deltas, total_clients=2)["w"]
    assert torch.allclose(full, torch.tensor([0.6, -0.5]), atol=1e-7)
    partial = scaffold_server_controls(c, deltas, total_clients=4)["w"]
    assert torch.allclose(partial, torch.tensor([0.45, -0.25]), atol=1e-7)
    with pytest.raises(FedWaveError) as info:
        scaffold_option2(c_i, c, _x(1.0), _x(0.8, 1.1), steps=4, lr=0.05)
    assert info.value.reason == "shape"
    with pytest.raises(FedWaveError) as info:
        scaffold_server_controls(c, {"a": _x(float("nan"), 0.0)}, total_clients=2)
    assert info.value.reason == "non_finite"
    assert state_bytes(c) == 8


def test_option2_is_the_mean_raw_gradient_under_local_sgd() -> None:
    """The identity the simulation relies on: with local SGD, c_i+ of option II equals the
    mean of the raw minibatch gradients along the corrected trajectory."""
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(6, generator=gen)
    w = torch.nn.Parameter(torch.randn(6, generator=gen))
    start = {"w": w.detach().clone()}
    c_i = {"w": 0.1 * torch.randn(6, generator=gen)}
    c = {"w": 0.1 * torch.randn(6, generator=gen)}
    sgd = torch.optim.SGD([w], lr=0.05)
    mean = GradientMean({"w": (6,)})
    for k in range(5):
        sgd.zero_grad()
        loss = ((w - target) ** 2).sum() * (1.0 + 0.1 * k)
        loss.backward()  # type: ignore[no-untyped-call]
        mean.add([("w", w)])
        corrected_gradients([("w", w)], c_i, c)
        sgd.step()
    option2 = scaffold_option2(c_i, c, start, {"w": w.detach()}, steps=5, lr=0.05)
    assert torch.allclose(option2["w"], mean.mean()["w"], atol=1e-5)


def test_fedprox_term_and_its_gradient_by_hand() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    v = torch.nn.Parameter(torch.tensor([[0.5]]))
    anchor = {"w": torch.tensor([0.0, 4.0]), "v": torch.tensor([[0.5]])}
    term = proximal_term({"w": w, "v": v}, anchor, 0.1)
    # (0.1 / 2) · (1 + 4 + 0) = 0.25; gradient 0.1 · (w − anchor).
    assert term.item() == pytest.approx(0.25)
    term.backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None and torch.allclose(w.grad, torch.tensor([0.1, -0.2]))
    assert v.grad is not None and torch.equal(v.grad, torch.zeros(1, 1))
    with pytest.raises(FedWaveError) as info:
        proximal_term({"w": w}, {"w": torch.zeros(3)}, 0.1)
    assert info.value.reason == "shape"
    with pytest.raises(FedWaveError, match="mu must be >= 0"):
        proximal_term({"w": w}, {"w": torch.zeros(2)}, -1.0)
