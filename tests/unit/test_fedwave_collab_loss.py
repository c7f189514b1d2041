"""FedWave's collaborative loss (Eq. 2-6) against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedwave.collab_loss import (
    CollabLossSettings,
    consistency_loss,
    continuity_loss,
    local_vc_loss,
    positional_loss,
    total_loss,
)
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings

R2 = 1 / math.sqrt(2)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_positional_loss_by_hand() -> None:
    e = [t(1, 0), t(1, 1), t(0, 1)]  # adjacent cosines 1/√2 and 1/√2
    assert positional_loss(e, 0.5).item() == pytest.approx(2 * (R2 - 0.5) ** 2)
    # One target per pair (T_pos^(i)).
    assert positional_loss(e, [0.5, 1.0]).item() == pytest.approx((R2 - 0.5) ** 2 + (R2 - 1) ** 2)
    # Scale does not matter, only direction.
    assert positional_loss([t(3, 0), t(2, 2)], 0.5).item() == pytest.approx((R2 - 0.5) ** 2)
    with pytest.raises(ValueError, match="2 targets for 1"):
        positional_loss(e[:2], [0.1, 0.2])
    with pytest.raises(ValueError, match="at least two"):
        positional_loss(e[:1], 0.5)


def test_continuity_loss_by_hand() -> None:
    w0 = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    w1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    w2 = torch.tensor([[-1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    # vec(w0)·vec(w1) = 1, |w0| = 1, |w1| = √2; vec(w1) and vec(w2) are opposite.
    assert continuity_loss([w0, w1], 0.9).item() == pytest.approx((R2 - 0.9) ** 2)
    assert continuity_loss([w0, w1, w2], 0.9).item() == pytest.approx(
        (R2 - 0.9) ** 2 + (-1 - 0.9) ** 2
    )
    with pytest.raises(ValueError, match="shapes differ"):
        continuity_loss([w0, torch.zeros(3, 2)], 0.9)


def test_consistency_loss_by_hand() -> None:
    own = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    pred = torch.tensor([[0.0, 1.0], [1.0, 1.0]])  # cosines 0 and 1
    assert consistency_loss(own, pred, 0.8).item() == pytest.approx(((0 - 0.8) ** 2 + 0.2**2) / 2)
    with pytest.raises(ValueError, match="equal"):
        consistency_loss(own, pred[:1], 0.8)


def test_total_loss_by_hand() -> None:
    assert total_loss(t(2.0), t(0.4), 0.5).item() == pytest.approx(2.2)


def hand_layer(w_q: list[list[float]], e: list[float], w_o_scale: float = 1.0) -> VCLayer:
    """A 2-wide, d_vc = 2, one-head layer with chosen W_q, e and identity W_k, W_v, W_o."""
    layer = VCLayer(2, VCLayerSettings(d_vc=2, heads=1))
    with torch.no_grad():
        layer.w_q.copy_(torch.tensor(w_q))
        layer.w_k.copy_(torch.eye(2))
        layer.w_v.copy_(torch.eye(2))
        layer.w_o.copy_(torch.eye(2) * w_o_scale)
        layer.stage_embedding.copy_(torch.tensor(e))
    return layer


def test_local_vc_loss_by_hand_and_its_gradient_reaches_only_our_layer() -> None:
    pred = hand_layer([[1, 0], [0, 0]], [1, 0])
    own = hand_layer([[1, 0], [0, 1]], [1, 1])
    succ = hand_layer([[1, 0], [0, 1]], [0, 1])
    # One token: the branch output is (H + e) W_v W_o = H + e, so pooled f = H + e.
    hidden = torch.tensor([[[1.0, -1.0]]])
    s = CollabLossSettings()
    terms = local_vc_loss(own, hidden, None, predecessor=pred, successor=succ, settings=s)
    # e: cos(e_pred, e_own) = cos(e_own, e_succ) = 1/√2.
    assert terms.pos.item() == pytest.approx(2 * (R2 - 0.5) ** 2, abs=1e-6)
    # W_q: cos(pred, own) = 1/√2, cos(own, succ) = 1.
    assert terms.cont.item() == pytest.approx((R2 - 0.9) ** 2 + (1 - 0.9) ** 2, abs=1e-6)
    # f_own = (1,-1) + (1,1) = (2,0); f_pred = (1,-1) + (1,0) = (2,-1): cos = 4 / (2·√5).
    cos = 4 / (2 * math.sqrt(5))
    assert terms.cons.item() == pytest.approx((cos - 0.8) ** 2, abs=1e-6)
    expected = 0.1 * terms.pos.item() + 0.1 * terms.cont.item() + 0.1 * terms.cons.item()
    assert terms.total.item() == pytest.approx(expected)
    terms.total.backward()
    assert own.w_q.grad is not None and own.stage_embedding.grad is not None
    assert own.w_o.grad is not None  # through L_cons
    for other in (pred, succ):
        assert all(p.grad is None for p in other.parameters())


def test_the_ends_of_the_chain_have_fewer_terms() -> None:
    first = hand_layer([[1, 0], [0, 1]], [1, 0])
    second = hand_layer([[1, 0], [0, 1]], [1, 0])
    hidden = torch.tensor([[[0.5, 0.5]]])
    head = local_vc_loss(first, hidden, None, predecessor=None, successor=second)
    assert head.cons.item() == 0.0  # Eq. 6 is for i > 0
    assert head.pos.item() == pytest.approx(0.25)  # identical embeddings: (1 - 0.5)²
    alone = local_vc_loss(first, hidden, None, predecessor=None, successor=None)
    assert alone.total.item() == 0.0


def test_the_loss_pulls_adjacent_stages_towards_their_targets() -> None:
    """Gradient steps on our layer move every cosine towards its target."""
    gen = torch.Generator().manual_seed(0)
    size = VCLayerSettings(d_vc=8, heads=2)
    pred, own = VCLayer(16, size, generator=gen), VCLayer(16, size, generator=gen)
    hidden = torch.randn(4, 5, 16, generator=gen)
    s = CollabLossSettings()

    def gaps() -> tuple[float, float, float]:
        cos = torch.nn.functional.cosine_similarity
        with torch.no_grad():
            e = cos(own.stage_embedding, pred.stage_embedding, dim=0).item()
            q = cos(own.w_q.reshape(-1), pred.w_q.reshape(-1), dim=0).item()
            f = cos(own.pooled_branch(hidden), pred.pooled_branch(hidden), dim=1).mean().item()
        return abs(e - s.t_pos), abs(q - s.t_cont), abs(f - s.t_cons)

    before = gaps()
    optimiser = torch.optim.SGD(own.parameters(), lr=0.5)
    for _ in range(200):
        optimiser.zero_grad()
        terms = local_vc_loss(own, hidden, None, predecessor=pred, successor=None, settings=s)
        terms.total.backward()
        optimiser.step()
    after = gaps()
    assert all(a < b / 2 for a, b in zip(after, before, strict=True)), (before, after)


@settings(max_examples=30, deadline=None)
@given(
    vectors=st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=3, max_size=3).filter(
            lambda v: sum(x * x for x in v) > 1e-3
        ),
        min_size=2,
        max_size=5,
    ),
    scales=st.lists(st.floats(0.1, 10), min_size=5, max_size=5),
    target=st.floats(-1, 1),
)
def test_positional_loss_depends_only_on_directions_and_is_bounded(
    vectors: list[list[float]], scales: list[float], target: float
) -> None:
    e = [torch.tensor(v, dtype=torch.float64) for v in vectors]
    scaled = [x * s for x, s in zip(e, scales, strict=False)]
    value = positional_loss(e, target).item()
    assert value == pytest.approx(positional_loss(scaled, target).item(), abs=1e-9)
    assert 0 <= value <= 4 * (len(e) - 1) + 1e-9  # each term at most (1 + 1)²
