"""FedProxy's server-side analysis (Eq. 5–7), H-TIES (Eq. 10–14) and the baselines."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.fedproxy.hties import (
    analyse,
    dominant_sign_merge,
    fedavg_proxies,
    h_ties,
    retention,
    task_vectors,
    ties_merge,
)
from peerlm.agent.fedproxy.proxy import ProxyError

PROPS = settings(max_examples=30, deadline=None)
T = torch.tensor


def state(*values: float, bias: float = 0.0) -> dict[str, torch.Tensor]:
    """A two-tensor "model": ``w`` holds the values, ``b`` one more; float64."""
    return {"w": T(values, dtype=torch.float64), "b": T([bias], dtype=torch.float64)}


def zero(n: int) -> dict[str, torch.Tensor]:
    return state(*([0.0] * n))


# ----------------------------------------------------------------------------- Eq. 5–7


def test_analysis_of_three_hand_built_clients() -> None:
    # τ1 = τ2 = e0, τ3 ⟂ both: S12 = 1, S13 = S23 = 0.
    taus = [
        {"w": T([1.0, 0.0, 0.0], dtype=torch.float64)},
        {"w": T([2.0, 0.0, 0.0], dtype=torch.float64)},
        {"w": T([0.0, 3.0, -1.0], dtype=torch.float64)},
    ]
    a = analyse(taus)
    assert torch.allclose(a.similarity, T([[1.0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float64))
    assert a.heterogeneity == pytest.approx((0.5, 0.5, 1.0))  # 1 − (1/2) Σ max(0, S)
    assert a.heterogeneity_norm == pytest.approx((0.0, 0.0, 1.0))
    e = math.e
    assert a.weights == pytest.approx((e / (2 * e + 1), e / (2 * e + 1), 1 / (2 * e + 1)))
    # C_d = 1 − |Σ sign| / 3: d0 signs (+, +, 0), d1 (0, 0, +), d2 (0, 0, −)
    assert a.conflict["w"].tolist() == pytest.approx([1 / 3, 2 / 3, 2 / 3])


def test_negative_similarity_counts_for_weight_but_not_for_heterogeneity() -> None:
    taus = [{"w": T([1.0, 0.0], dtype=torch.float64)}, {"w": T([-1.0, 0.0], dtype=torch.float64)}]
    a = analyse(taus)
    assert a.similarity[0, 1] == pytest.approx(-1.0)
    assert a.heterogeneity == pytest.approx((1.0, 1.0))  # max(0, −1) = 0
    assert a.heterogeneity_norm == (0.0, 0.0)  # all equal: no spread to normalise
    assert a.weights == pytest.approx((0.5, 0.5))
    assert a.conflict["w"].tolist() == pytest.approx([1.0, 1.0])  # opposite signs; 0 and 0


def test_a_zero_task_vector_has_similarity_zero_and_one_client_is_homogeneous() -> None:
    a = analyse(
        [{"w": T([0.0, 0.0], dtype=torch.float64)}, {"w": T([1.0, 0.0], dtype=torch.float64)}]
    )
    assert a.similarity[0].tolist() == [0.0, 0.0]
    single = analyse([{"w": T([1.0, -2.0], dtype=torch.float64)}])
    assert single.heterogeneity == (0.0,) and single.weights == (1.0,)
    assert single.conflict["w"].tolist() == [0.0, 0.0]
    with pytest.raises(ProxyError):
        analyse([])


# ----------------------------------------------------------------------------- Eq. 10


def test_retention_is_clipped_to_zero_one() -> None:
    assert retention((0.0, 0.5, 1.0)) == pytest.approx((1.0, 0.9, 0.8))  # r0 1.0, δ 0.2
    assert retention((0.0, 1.0), r0=1.3, delta=2.0) == pytest.approx((1.0, 0.0))
    for bad in ({"r0": -0.1}, {"delta": -1.0}, {"r0": float("nan")}):
        with pytest.raises(ProxyError) as err:
            retention((0.0,), **bad)
        assert err.value.reason == "parameters"


# ----------------------------------------------------------------------------- Eq. 11–13


def test_dominant_sign_merge_by_hand() -> None:
    w = (0.5, 0.3, 0.2)
    sparse = [
        T([2.0, 1.0, 1.0, -1.0, 0.0], dtype=torch.float64),
        T([1.0, -1.0, -2.0, 0.0, 0.0], dtype=torch.float64),
        T([-1.0, -1.0, -1.0, 0.0, 0.0], dtype=torch.float64),
    ]
    got = dominant_sign_merge(sparse, w).tolist()
    # d0: τ̂ = (1, .3, −.2): P 1.3, N .2 → (1 + .3) / (.5 + .3)
    # d1: (.5, −.3, −.2): P = N → tie → 0
    # d2: (.5, −.6, −.2): N .8 / P .5 = 1.6 ≥ 1.1 → (−.6 − .2) / (.3 + .2)
    # d3: (−.5, 0, 0): N .5, P 0 → −.5 / .5;   d4: nothing → 0
    assert got == pytest.approx([1.625, 0.0, -1.6, -1.0, 0.0])


def test_rho_decides_how_much_dominance_is_enough() -> None:
    sparse = [T([1.05], dtype=torch.float64), T([-1.0], dtype=torch.float64)]
    assert dominant_sign_merge(sparse, (0.5, 0.5)).tolist() == [0.0]  # 1.05 < ρ = 1.1
    assert dominant_sign_merge(sparse, (0.5, 0.5), rho=1.04).tolist() == pytest.approx([1.05])
    assert dominant_sign_merge(sparse, (0.5, 0.5), rho=1.0).tolist() == pytest.approx([1.05])


def test_epsilon_drops_a_lone_update_below_rho_times_epsilon() -> None:
    sparse = [T([1e-13, 1e-6], dtype=torch.float64), T([0.0, 0.0], dtype=torch.float64)]
    # P = 0.5e-13, N = 0: 0.5e-13 / 1e-12 = 0.05 < 1.1, so the first entry is dropped
    assert dominant_sign_merge(sparse, (0.5, 0.5)).tolist() == pytest.approx([0.0, 1e-6])
    small = dominant_sign_merge(sparse, (0.5, 0.5), epsilon=1e-20).tolist()
    assert small == pytest.approx([1e-13, 1e-6], rel=1e-12)


def test_dominant_sign_merge_refuses_bad_parameters() -> None:
    one = [T([1.0], dtype=torch.float64)]
    for kwargs, reason in (
        ({"rho": 0.9}, "parameters"),
        ({"epsilon": 0.0}, "parameters"),
    ):
        with pytest.raises(ProxyError) as err:
            dominant_sign_merge(one, (1.0,), **kwargs)
        assert err.value.reason == reason
    with pytest.raises(ProxyError) as err:
        dominant_sign_merge(one, (0.0,))
    assert err.value.reason == "weights"
    with pytest.raises(ProxyError):
        dominant_sign_merge(one, (0.5, 0.5))


# ----------------------------------------------------------------------------- H-TIES


def test_h_ties_on_three_hand_built_clients() -> None:
    base = state(0.0, 0.0, 0.0, 0.0, 0.0, bias=1.0)
    clients = [
        state(1.0, 0.0, 0.0, 0.0, 0.0, bias=1.0),
        state(1.0, 0.0, 0.0, 0.0, 0.0, bias=1.0),
        state(0.0, 5.0, -4.0, 3.0, 1.0, bias=1.0),  # orthogonal: h_norm 1, r = 1 − 0.4
    ]
    result = h_ties(base, clients, delta=0.4)
    assert result.retention == pytest.approx((1.0, 1.0, 0.6))
    # client 3 keeps int(0.6 · 5) = 3 entries of w (its 1 and 0 go); b has no update
    assert result.state["w"].tolist() == pytest.approx([1.0, 5.0, -4.0, 3.0, 0.0])
    assert result.state["b"].tolist() == [1.0]
    assert result.analysis.conflict["w"].tolist() == pytest.approx(
        [1 / 3, 2 / 3, 2 / 3, 2 / 3, 2 / 3]
    )


def test_h_ties_resolves_conflicts_and_ties_between_two_clients() -> None:
    base = zero(5)
    a = state(1.0, 1.0, 2.0, 1.05, 0.0)
    b = state(1.0, -1.0, -1.0, -1.0, 0.0)
    got = h_ties(base, [a, b]).state["w"].tolist()
    # K = 2: S symmetric, so w = (½, ½), h equal, r = 1.  d0 agree; d1 tie; d2 P/N = 2;
    # d3 1.05 < ρ; d4 no update.
    assert got == pytest.approx([1.0, 0.0, 2.0, 0.0, 0.0])


def test_h_ties_adds_the_merged_update_to_the_global_proxy_in_its_dtype() -> None:
    base = {"w": T([1.0, 2.0], dtype=torch.float32), "n": T([3, 4])}
    client = {"w": T([1.5, 1.0], dtype=torch.float32), "n": T([3, 4])}
    out = h_ties(base, [client]).state
    assert out["w"].dtype == torch.float32 and out["w"].tolist() == [1.5, 1.0]
    assert out["n"].tolist() == [3, 4]


floats = st.floats(-4, 4, allow_nan=False).map(lambda x: round(x, 3))
cohorts = st.integers(1, 5).flatmap(
    lambda k: st.lists(st.lists(floats, min_size=6, max_size=6), min_size=k, max_size=k)
)


def _states(rows: list[list[float]]) -> list[dict[str, torch.Tensor]]:
    return [{"w": T(r[:4], dtype=torch.float64), "b": T(r[4:], dtype=torch.float64)} for r in rows]


@PROPS
@given(rows=cohorts, seed=st.integers(0, 1000))
def test_h_ties_does_not_depend_on_client_order(rows: list[list[float]], seed: int) -> None:
    base = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    one = h_ties(base, _states(rows))
    two = h_ties(base, _states([rows[i] for i in perm]))
    for key in base:
        assert torch.allclose(one.state[key], two.state[key], atol=1e-12)
    assert two.analysis.weights == pytest.approx([one.analysis.weights[i] for i in perm])
    assert two.retention == pytest.approx([one.retention[i] for i in perm])


@PROPS
@given(row=st.lists(floats, min_size=6, max_size=6), k=st.integers(1, 5))
def test_identical_clients_give_that_clients_proxy(row: list[float], k: int) -> None:
    base = {
        "w": torch.full((4,), 0.5, dtype=torch.float64),
        "b": torch.zeros(2, dtype=torch.float64),
    }
    client = {"w": T(row[:4], dtype=torch.float64), "b": T(row[4:], dtype=torch.float64)}
    for merged in (h_ties(base, [client] * k).state, ties_merge(base, [client] * k)):
        for key in base:
            assert torch.allclose(merged[key], client[key], atol=1e-12)
    fed = fedavg_proxies(base, [client] * k)
    assert all(torch.allclose(fed[key], client[key], atol=1e-12) for key in base)


@PROPS
@given(rows=cohorts)
def test_analysis_and_merge_stay_in_their_ranges(rows: list[list[float]]) -> None:
    base = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    result = h_ties(base, _states(rows))
    a = result.analysis
    assert sum(a.weights) == pytest.approx(1.0)
    assert all(0 <= h <= 1 for h in a.heterogeneity_norm)
    assert all(0 <= h <= 1 + 1e-12 for h in a.heterogeneity)
    assert all(0.8 - 1e-12 <= r <= 1 for r in result.retention)
    for key in base:
        c = a.conflict[key]
        assert bool(((c >= 0) & (c <= 1)).all())
        stacked = torch.stack([s[key] for s in _states(rows)])
        # a weighted mean of same-sign entries: within the clients' range, never beyond
        assert bool((result.state[key] <= stacked.max(dim=0).values + 1e-12).all())
        assert bool((result.state[key] >= stacked.min(dim=0).values - 1e-12).all())


# ----------------------------------------------------------------------------- baselines


def test_fedavg_proxies_is_the_weighted_mean() -> None:
    base = zero(2)
    a, b = state(1.0, 4.0, bias=2.0), state(3.0, -4.0, bias=0.0)
    out = fedavg_proxies(base, [a, b])
    assert out["w"].tolist() == [2.0, 0.0] and out["b"].tolist() == [1.0]
    weighted = fedavg_proxies(base, [a, b], weights=[3, 1])
    assert weighted["w"].tolist() == pytest.approx([1.5, 2.0])
    for bad in ([1.0], [-1.0, 2.0], [0.0, 0.0], [float("nan"), 1.0]):
        with pytest.raises(ProxyError) as err:
            fedavg_proxies(base, [a, b], weights=bad)
        assert err.value.reason == "weights"


def test_ties_baseline_is_the_disjoint_mean_of_the_elected_sign() -> None:
    base = zero(3)
    clients = [state(1.0, 1.0, 2.0), state(3.0, -1.0, -1.0), state(-1.0, -1.0, -0.5)]
    out = ties_merge(base, clients)
    # d0: sum 3 > 0 → mean(1, 3) = 2;  d1: sum −1 → mean(−1, −1);  d2: sum .5 → 2
    assert out["w"].tolist() == pytest.approx([2.0, -1.0, 2.0])
    trimmed = ties_merge(base, [state(4.0, 1.0, 0.5)], density=0.34)  # keeps int(1.02) = 1
    assert trimmed["w"].tolist() == [4.0, 0.0, 0.0]
    with pytest.raises(ProxyError):
        ties_merge(base, clients, density=1.5)


# ----------------------------------------------------------------------------- bad input


def test_inputs_that_do_not_fit_are_refused() -> None:
    base = state(0.0, 0.0)
    nan = state(float("nan"), 0.0)
    wide = state(0.0, 0.0, 0.0)
    extra = {**state(1.0, 1.0), "x": T([1.0])}
    other_int = {"w": T([0.0, 0.0], dtype=torch.float64), "b": T([1])}
    for clients, reason in (
        ([], "empty"),
        ([nan], "non_finite"),
        ([wide], "shape"),
        ([extra], "keys"),
        ([other_int], "dtype"),
    ):
        for merge in (h_ties, fedavg_proxies, ties_merge):
            with pytest.raises(ProxyError) as err:
                merge(base, clients)
            assert err.value.reason == reason, (merge, reason)
    with pytest.raises(ProxyError) as err:
        h_ties(base, [state(1.0, 1.0)], rho=0.5)
    assert err.value.reason == "parameters"
    with pytest.raises(ProxyError) as err:
        task_vectors(state(float("inf"), 0.0), [base])
    assert err.value.reason == "non_finite"
    ints = {"n": T([1, 2])}
    with pytest.raises(ProxyError) as err:
        task_vectors(ints, [{"n": T([1, 3])}])
    assert err.value.reason == "keys"


def test_heterogeneities_equal_up_to_rounding_are_not_normalised_apart() -> None:
    # Two parallel directions and a third at the same cosine to both: every h_k is
    # 1 - (1 + 2/sqrt(7)) / 3 in exact arithmetic, computed in another order per client. The
    # hypothesis search found this cohort giving r = 0.8 or 1.0 depending on client order.
    rows = [[0.0, 0.0, 2.0, 1.0, 1.0, 1.0]] * 2 + [[0.0] * 5 + [1.0], [0.0] * 5 + [2.0]]
    base = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    for order in ([0, 1, 2, 3], [2, 3, 0, 1], [3, 0, 2, 1]):
        merged = h_ties(base, _states([rows[i] for i in order]))
        assert merged.analysis.heterogeneity_norm == (0.0, 0.0, 0.0, 0.0)
        assert merged.retention == (1.0, 1.0, 1.0, 1.0)


def test_a_rate_one_rounding_step_below_one_keeps_every_entry() -> None:
    # The second cohort hypothesis found: two clients' h differ only in the last bit, so
    # one rate came out as 1 - 1e-16 and its 2-entry tensor lost an entry in one order.
    rows = [
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        [0.0, 1.0, 0.0, 0.0, 0.0, 1.0],
        [0.0, 1.0, 1.0, 1.0, 2.0, 1.0],
    ]
    base = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    first = h_ties(base, _states(rows))
    for order in ([0, 1, 3, 2], [3, 2, 1, 0], [1, 3, 0, 2]):
        other = h_ties(base, _states([rows[i] for i in order]))
        assert other.retention == tuple(first.retention[i] for i in order)
        for key in base:
            assert torch.allclose(first.state[key], other.state[key], atol=1e-12)
