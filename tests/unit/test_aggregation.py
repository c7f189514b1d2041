"""PDFL personalised aggregation (SemanticDFL Sec. 2.1): weights, alpha, anchor, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peerlm.overlay.aggregation import (
    DEFAULT_ETA,
    DEFAULT_KAPPA,
    DEFAULT_PSI,
    AggregationError,
    check_neighbour,
    neighbour_weights,
    personalised_update,
    proximal_alpha,
)

sims = st.dictionaries(
    st.text(alphabet="abcdefgh", min_size=1, max_size=4),
    st.floats(-1.0, 1.0),
    max_size=12,
)


@given(sims, st.floats(0.01, 5.0), st.floats(-1.0, 1.0))
def test_weights_sum_to_one_and_match_the_formula(
    similarities: dict[str, float], kappa: float, self_sim: float
) -> None:
    weights = neighbour_weights(similarities, self_id="me", self_similarity=self_sim, kappa=kappa)
    assert set(weights) == set(similarities) | {"me"}
    assert math.fsum(weights.values()) == pytest.approx(1.0, abs=1e-12)
    everyone = {**similarities, "me": self_sim}
    c = max(everyone.values())
    z = sum(math.exp((s - c) / kappa) for s in everyone.values())
    for name, s in everyone.items():
        assert weights[name] == pytest.approx(math.exp((s - c) / kappa) / z, rel=1e-9)
        assert 0.0 < weights[name] <= 1.0
    # monotone in similarity
    for a in everyone:
        for b in everyone:
            if everyone[a] > everyone[b]:
                assert weights[a] >= weights[b]


def test_weights_known_values_and_validation() -> None:
    w = neighbour_weights({"a": 0.75}, self_id="me", kappa=0.25)
    assert w["a"] == pytest.approx(math.exp(-1) / (1 + math.exp(-1)))
    assert w["me"] == pytest.approx(1 / (1 + math.exp(-1)))
    # a tiny temperature does not overflow: the maximum is subtracted first
    w = neighbour_weights({"a": -1.0, "b": 1.0}, self_id="me", self_similarity=0.0, kappa=1e-4)
    assert w["b"] == pytest.approx(1.0) and w["a"] == 0.0
    assert neighbour_weights({}, self_id="me", kappa=0.3) == {"me": 1.0}
    for kappa in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(AggregationError, match="kappa"):
            neighbour_weights({"a": 0.5}, self_id="me", kappa=kappa)
    with pytest.raises(AggregationError, match="finite"):
        neighbour_weights({"a": math.nan}, self_id="me", kappa=0.3)
    with pytest.raises(AggregationError, match="own id"):
        neighbour_weights({"me": 0.5}, self_id="me", kappa=0.3)
    assert DEFAULT_KAPPA == 0.25


def test_alpha_formula_and_the_papers_table() -> None:
    assert proximal_alpha(1.0, 2.0) == pytest.approx(2 / 3)
    assert proximal_alpha(0.5, 3.0) == pytest.approx(1.5 / 2.5)
    assert proximal_alpha(1.0, 0.0) == 0.0
    # Table 11 of the paper: psi -> alpha with the default eta
    for psi, alpha in ((0.1, 0.09), (0.5, 0.33), (1.0, 0.50), (2.0, 0.67), (5.0, 0.83)):
        assert round(proximal_alpha(DEFAULT_ETA, psi), 2) == alpha
    assert proximal_alpha() == pytest.approx(
        DEFAULT_ETA * DEFAULT_PSI / (1 + DEFAULT_ETA * DEFAULT_PSI)
    )
    for eta, psi, word in (
        (0.0, 2.0, "eta"),
        (-1.0, 2.0, "eta"),
        (1.0, -0.5, "psi"),
        (math.nan, 1.0, "eta"),
    ):
        with pytest.raises(AggregationError, match=word):
            proximal_alpha(eta, psi)


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.lora_A.weight": torch.randn(4, 6, generator=g).to(dtype),
        "layer.lora_B.weight": torch.randn(6, 4, generator=g).to(dtype),
    }


def test_mixing_follows_the_equation_exactly() -> None:
    own, a, b = _state(0), _state(1), _state(2)
    similarities = {"a": 0.9, "b": 0.4}
    new, report = personalised_update(
        own, {"a": a, "b": b}, similarities, kappa=0.3, eta=0.5, psi=2.0, self_id="me"
    )
    weights = neighbour_weights(similarities, self_id="me", kappa=0.3)
    alpha = 0.5 * 2.0 / (1 + 0.5 * 2.0)
    assert report.alpha == pytest.approx(alpha)
    assert report.weights == pytest.approx(weights)
    assert report.accepted == ("a", "b") and report.refused == () and not report.identity
    delta_sq = 0.0
    for name in own:
        anchor = weights["me"] * own[name] + weights["a"] * a[name] + weights["b"] * b[name]
        expected = (1 - alpha) * own[name] + alpha * anchor
        torch.testing.assert_close(new[name], expected, rtol=1e-6, atol=1e-6)
        delta_sq += float(torch.sum((expected - own[name]) ** 2))
        # the step moves own towards the anchor: distance shrinks by exactly (1 - alpha)
        torch.testing.assert_close(
            torch.linalg.norm(new[name] - anchor),
            (1 - alpha) * torch.linalg.norm(own[name] - anchor),
            rtol=1e-5,
            atol=1e-6,
        )
    assert report.delta_norm == pytest.approx(math.sqrt(delta_sq), rel=1e-5)
    # own untouched
    torch.testing.assert_close(own, _state(0), rtol=0, atol=0)


def test_dtype_is_kept_and_computation_is_float32() -> None:
    own, nb = _state(0, torch.bfloat16), _state(1, torch.float16)
    new, _ = personalised_update(own, {"n": nb}, {"n": 0.5})
    for name in own:
        assert new[name].dtype == torch.bfloat16
        w = neighbour_weights({"n": 0.5}, self_id="self")
        alpha = proximal_alpha()
        expected = (1 - alpha) * own[name].float() + alpha * (
            w["self"] * own[name].float() + w["n"] * nb[name].float()
        )
        torch.testing.assert_close(new[name], expected.to(torch.bfloat16), rtol=0, atol=0)


def test_identity_without_neighbours() -> None:
    own = _state(3)
    new, report = personalised_update(own, {}, {}, self_id="me")
    assert report.identity and report.accepted == () and report.weights == {"me": 1.0}
    assert report.delta_norm == 0.0
    for name in own:
        assert torch.equal(new[name], own[name])
        assert new[name].data_ptr() != own[name].data_ptr()  # a copy, not an alias


def test_bad_neighbours_are_dropped_with_reasons() -> None:
    own = _state(0)
    good = _state(1)
    wrong_shape = {**_state(2), "layer.lora_B.weight": torch.zeros(6, 8)}
    missing = {"layer.lora_A.weight": torch.zeros(4, 6)}
    extra = {**_state(2), "other.weight": torch.zeros(1)}
    nan = {**_state(2), "layer.lora_A.weight": torch.full((4, 6), math.nan)}
    inf = {**_state(2), "layer.lora_B.weight": torch.full((6, 4), -math.inf)}
    ints = {**_state(2), "layer.lora_A.weight": torch.zeros(4, 6, dtype=torch.int64)}
    neighbours = {
        "good": good,
        "shape": wrong_shape,
        "missing": missing,
        "extra": extra,
        "nan": nan,
        "inf": inf,
        "ints": ints,
        "nosim": _state(4),
        "badsim": _state(5),
        "me": _state(6),
    }
    similarities = {name: 0.5 for name in neighbours if name != "nosim"}
    similarities["badsim"] = math.nan
    new, report = personalised_update(own, neighbours, similarities, self_id="me")
    reasons = {r.peer: r.reason for r in report.refused}
    assert reasons == {
        "shape": "shape",
        "missing": "keys",
        "extra": "keys",
        "nan": "non_finite",
        "inf": "non_finite",
        "ints": "dtype",
        "nosim": "no_similarity",
        "badsim": "bad_similarity",
        "me": "self",
    }
    assert all(r.detail for r in report.refused)
    assert report.accepted == ("good",)
    assert set(report.weights) == {"me", "good"}
    # the result is exactly what aggregating the good neighbour alone gives
    alone, _ = personalised_update(own, {"good": good}, {"good": 0.5}, self_id="me")
    for name in own:
        assert torch.equal(new[name], alone[name])


def test_only_bad_neighbours_is_the_identity() -> None:
    own = _state(0)
    new, report = personalised_update(
        own, {"x": {"layer.lora_A.weight": torch.zeros(1)}}, {"x": 0.9}
    )
    assert report.identity and [r.reason for r in report.refused] == ["keys"]
    assert all(torch.equal(new[k], own[k]) for k in own)


def test_invalid_own_or_parameters_raise() -> None:
    with pytest.raises(AggregationError, match="empty"):
        personalised_update({}, {}, {})
    with pytest.raises(AggregationError, match="non-finite"):
        personalised_update({"a": torch.tensor([math.nan])}, {}, {})
    with pytest.raises(AggregationError, match="floating"):
        personalised_update({"a": torch.tensor([1])}, {}, {})
    with pytest.raises(AggregationError, match="kappa"):
        personalised_update(_state(0), {}, {}, kappa=0.0)
    with pytest.raises(AggregationError, match="eta"):
        personalised_update(_state(0), {}, {}, eta=0.0)
    with pytest.raises(AggregationError, match="psi"):
        personalised_update(_state(0), {}, {}, psi=-1.0)


def test_check_neighbour_messages_name_the_tensor() -> None:
    own = _state(0)
    with pytest.raises(AggregationError, match=r"lora_B.weight has shape \(6, 8\), ours \(6, 4\)"):
        check_neighbour(own, {**own, "layer.lora_B.weight": torch.zeros(6, 8)}, "peer")
    with pytest.raises(AggregationError, match=r"missing: layer\.lora_B\.weight"):
        check_neighbour(own, {"layer.lora_A.weight": own["layer.lora_A.weight"]}, "peer")
    check_neighbour(own, _state(9), "peer")  # compatible: no error


@given(
    sims=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=12),
    share=st.floats(1.0, 4.0),
)
def test_capped_weights_stay_a_row_and_no_neighbour_passes_the_cap(
    sims: list[float], share: float
) -> None:
    """With max_share, every neighbour weighs at most max_share equal shares of the row,
    the weights still sum to 1, and only our own entry gains what was cut."""
    similarities = {f"n{i}": s for i, s in enumerate(sims)}
    plain = neighbour_weights(similarities, self_id="me")
    capped = neighbour_weights(similarities, self_id="me", max_share=share)
    cap = share / (len(sims) + 1)
    assert math.fsum(capped.values()) == pytest.approx(1.0)
    for name in similarities:
        assert capped[name] <= cap + 1e-12
        assert capped[name] == pytest.approx(min(plain[name], cap))
    assert capped["me"] >= plain["me"]


def test_a_neighbour_close_to_everyone_is_capped_and_reported() -> None:
    """One neighbour advertising similarity 1 among nine at 0.5 took 0.31 of the anchor
    (as much as the client); capped at two equal shares (2/11) the excess is the client's."""
    sims = {"mallory": 1.0, **{f"h{i}": 0.5 for i in range(9)}}
    plain = neighbour_weights(sims, self_id="me")
    assert plain["mallory"] == pytest.approx(plain["me"]) and plain["mallory"] > 0.3
    own = {"w": torch.zeros(3)}
    neighbours = {name: {"w": torch.ones(3)} for name in sims}
    _, report = personalised_update(own, neighbours, sims, self_id="me", max_share=2.0)
    assert report.weights["mallory"] == pytest.approx(2 / 11)
    assert report.capped == ("mallory",)
    with pytest.raises(AggregationError):
        neighbour_weights(sims, self_id="me", max_share=0.5)
