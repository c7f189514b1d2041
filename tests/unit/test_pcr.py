"""FedProxy's conflict-aware regulariser PCR (Eq. 8–9)."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.fedproxy.hties import analyse, task_vectors
from peerlm.agent.fedproxy.pcr import DEFAULT_LAMBDA_REG, ConflictRegulariser, pcr_penalty
from peerlm.agent.fedproxy.proxy import ProxyError
from torch import nn

T = torch.tensor


def test_penalty_and_gradient_by_hand() -> None:
    phi = {"w": T([1.0, 2.0, -1.0], requires_grad=True), "b": T([0.5], requires_grad=True)}
    anchor = {"w": T([0.0, 1.0, 1.0]), "b": T([0.0])}
    conflict = {"w": T([1.0, 0.0, 0.5]), "b": T([2.0 / 3.0])}
    got = pcr_penalty(phi, anchor, conflict, lambda_reg=0.1)
    # 0.1 · (1·1² + 0·1² + 0.5·(−2)² + (2/3)·0.5²) = 0.1 · (1 + 0 + 2 + 1/6)
    assert float(got.detach()) == pytest.approx(0.1 * (3 + 1 / 6))
    got.backward()
    # ∂/∂φ = 2 λ C (φ − φ^(t))
    assert phi["w"].grad is not None and phi["b"].grad is not None
    assert phi["w"].grad.tolist() == pytest.approx([0.2, 0.0, -0.2])
    assert phi["b"].grad.tolist() == pytest.approx([2 * 0.1 * (2 / 3) * 0.5])


def test_the_penalty_holds_conflicting_parameters_not_consensus_ones() -> None:
    # Eq. 7 then Eq. 9: two clients agree on d0 and disagree on d1.
    base = {"w": T([0.0, 0.0], dtype=torch.float64)}
    clients = [
        {"w": T([1.0, 1.0], dtype=torch.float64)},
        {"w": T([1.0, -1.0], dtype=torch.float64)},
    ]
    conflict = analyse(task_vectors(base, clients)).conflict
    assert conflict["w"].tolist() == [0.0, 1.0]
    moved_on_consensus = {"w": T([3.0, 0.0], dtype=torch.float32)}
    moved_on_conflict = {"w": T([0.0, 3.0], dtype=torch.float32)}
    anchor = {"w": T([0.0, 0.0])}
    assert float(pcr_penalty(moved_on_consensus, anchor, conflict)) == 0.0
    assert float(pcr_penalty(moved_on_conflict, anchor, conflict)) == pytest.approx(
        DEFAULT_LAMBDA_REG * 9.0
    )


def test_round_zero_scores_give_no_penalty_and_the_regulariser_reads_a_model() -> None:
    model = nn.Linear(3, 2)
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items()}
    zeros = {k: torch.zeros_like(v) for k, v in anchor.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    assert float(ConflictRegulariser(anchor, zeros).penalty(model).detach()) == 0.0
    ones = {"weight": torch.ones(2, 3)}  # only the weight is regularised
    reg = ConflictRegulariser(anchor, ones, lambda_reg=0.5)
    loss = reg.penalty(model)
    assert float(loss.detach()) == pytest.approx(0.5 * 6.0)
    loss.backward()
    assert model.weight.grad is not None and model.bias.grad is None
    assert torch.allclose(model.weight.grad, torch.full((2, 3), 1.0))


def test_bad_scores_are_refused() -> None:
    phi = {"w": T([1.0, 2.0])}
    anchor = {"w": T([0.0, 0.0])}
    for conflict, reason in (
        ({}, "empty"),
        ({"x": T([0.0, 0.0])}, "keys"),
        ({"w": T([0.0])}, "shape"),
        ({"w": T([0.0, 1.5])}, "non_finite"),
        ({"w": T([float("nan"), 0.0])}, "non_finite"),
    ):
        with pytest.raises(ProxyError) as err:
            pcr_penalty(phi, anchor, conflict)
        assert err.value.reason == reason
    with pytest.raises(ProxyError) as err:
        pcr_penalty(phi, anchor, {"w": T([0.0, 0.0])}, lambda_reg=-1.0)
    assert err.value.reason == "parameters"


def test_a_tied_parameter_is_regularised_once_and_unknown_names_are_refused() -> None:
    from peerlm.agent.models.tiny import SHIPPED_DIR
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / "gpt2")
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in anchor  # the state dict names the tied tensor twice
    conflict = {k: torch.ones_like(v) for k, v in anchor.items()}
    with torch.no_grad():
        model.transformer.wte.weight.add_(0.5)  # moves lm_head.weight too (tied)
    got = ConflictRegulariser(anchor, conflict, lambda_reg=1.0).penalty(model)
    assert float(got.detach()) == pytest.approx(0.25 * anchor["transformer.wte.weight"].numel())
    with pytest.raises(ProxyError) as err:
        ConflictRegulariser(anchor, {"nope": torch.ones(1)}).penalty(model)
    assert err.value.reason == "keys"
