"""The context map phi, the profile layout and profile validation, and trust."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.services.cpm import (
    DISTRIBUTION_SLICE,
    DYNAMIC_SLICE,
    MAX_ABS_PROFILE_VALUE,
    PERFORMANCE_INDEX,
    PROFILE_DIM,
    PROFILE_LAYOUT,
    STATIC_SLICE,
    ContextFeatures,
    TrustLedger,
    validate_profile,
    validate_profiles,
)


def test_profile_layout_constants() -> None:
    assert PROFILE_DIM == PROFILE_LAYOUT.dim == 32
    assert (
        slice(0, 8),
        slice(8, 20),
        slice(20, 32),
    ) == (STATIC_SLICE, DYNAMIC_SLICE, DISTRIBUTION_SLICE)
    assert PROFILE_LAYOUT.static == STATIC_SLICE
    assert PROFILE_LAYOUT.distribution == DISTRIBUTION_SLICE
    assert PERFORMANCE_INDEX == PROFILE_LAYOUT.performance_index == 8
    sizes = [len(range(32)[s]) for s in (STATIC_SLICE, DYNAMIC_SLICE, DISTRIBUTION_SLICE)]
    assert sizes == [8, 12, 12]


def test_validate_profile_returns_float64_copy() -> None:
    src = [0] * 32
    out = validate_profile(src, 32)
    assert out.dtype == np.float64 and out.shape == (32,)
    arr = np.zeros(32, dtype=np.float32)
    assert validate_profile(arr) is not arr


@pytest.mark.parametrize(
    "vec",
    [
        np.zeros(31),
        np.zeros(33),
        np.zeros((32, 1)),
        np.full(32, np.nan),
        np.r_[np.zeros(31), np.inf],
        np.r_[np.zeros(31), -np.inf],
        np.r_[np.zeros(31), 2 * MAX_ABS_PROFILE_VALUE],
        np.r_[np.zeros(31), -2 * MAX_ABS_PROFILE_VALUE],
        ["a"] * 32,
        None,
    ],
)
def test_validate_profile_rejects(vec: object) -> None:
    with pytest.raises(ValueError):
        validate_profile(vec, 32)  # type: ignore[arg-type]


def test_validate_profiles_names_the_offender() -> None:
    good, bad = np.zeros(4), np.array([0.0, np.nan, 0.0, 0.0])
    assert validate_profiles(["a", "b"], [good, good], 4).shape == (2, 4)
    with pytest.raises(ValueError, match="'b'"):
        validate_profiles(["a", "b"], [good, bad], 4)
    with pytest.raises(ValueError, match="'a'"):
        validate_profiles(["a"], [np.zeros(5)], 4)


def test_validate_profiles_fast_path_falls_back_for_every_malformed_row() -> None:
    """The whole-list conversion is only a fast path: ragged rows, wrong shapes, text and
    nested rows still get the per-agent message, and values equal the per-row conversion."""
    good = [0.0, 0.5, 1.0, -1.0]
    rows = [good, np.arange(4.0), (1, 2, 3, 4)]
    np.testing.assert_array_equal(
        validate_profiles(["a", "b", "c"], rows, 4), np.array([np.asarray(r, float) for r in rows])
    )
    for bad, message in [
        ([0.0, 1.0], "'c' must have shape"),  # ragged
        (np.zeros((4, 1)), "'c' must have shape"),  # same size, wrong shape
        (["x", "y", "z", "w"], "'c' is not a numeric vector"),
        ([0.0, 1e9, 0.0, 0.0], "'c'.*exceeds"),
        ([0.0, np.inf, 0.0, 0.0], "'c'.*NaN or Inf"),
    ]:
        with pytest.raises(ValueError, match=message):
            validate_profiles(["a", "b", "c"], [good, good, bad], 4)
    with pytest.raises(ValueError, match="one profile per agent"):
        validate_profiles(["a", "b"], [good], 4)


def test_default_context_dimension_and_names() -> None:
    full = ContextFeatures(32)
    plain = ContextFeatures(32, interaction=False)
    bare = ContextFeatures(32, interaction=False, trust=False)
    assert full.dim == 4 * 32 + 1 + 2 + 1 == 132
    assert plain.dim == 2 * 32 + 1 + 2 + 1
    assert bare.dim == 2 * 32 + 2
    for f in (full, plain, bare):
        assert len(f.names()) == f.dim
    multi = ContextFeatures(8, ("akd", "lora"), ("one_way", "mutual"))
    assert multi.dim == 4 * 8 + 4 + 2 + 1


def test_single_context_blocks() -> None:
    f = ContextFeatures(3, ("akd", "lora"), ("one_way", "mutual"))
    ps, pr = np.array([1.0, -2.0, 3.0]), np.array([0.5, 4.0, -1.0])
    x = f.single(ps, pr, "lora", "one_way", trust_s=0.8, trust_r=0.25)
    lay = f.layout
    np.testing.assert_array_equal(x[lay.sender], ps)
    np.testing.assert_array_equal(x[lay.receiver], pr)
    assert lay.absdiff is not None and lay.product is not None
    np.testing.assert_array_equal(x[lay.absdiff], np.abs(ps - pr))
    np.testing.assert_array_equal(x[lay.product], ps * pr)
    onehot = x[lay.onehot]
    assert onehot.sum() == 1.0 and onehot[f.combo_index("lora", "one_way")] == 1.0
    assert lay.trust_sender is not None and lay.trust_receiver is not None
    assert (float(x[lay.trust_sender]), float(x[lay.trust_receiver])) == (0.8, 0.25)
    assert x[lay.bias] == 1.0 and lay.bias == f.dim - 1


def test_plain_concatenation_is_the_papers_context() -> None:
    f = ContextFeatures(4, interaction=False, trust=False)
    ps, pr = np.arange(4.0), -np.arange(4.0)
    x = f.single(ps, pr, "akd", "one_way")
    np.testing.assert_array_equal(x, np.r_[ps, pr, 1.0, 1.0])


def test_direction_matters() -> None:
    f = ContextFeatures(3)
    a, b = np.array([1.0, 0.0, 2.0]), np.array([0.0, 3.0, 1.0])
    assert not np.array_equal(f.single(a, b, "akd", "one_way"), f.single(b, a, "akd", "one_way"))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(2, 8),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_batch_build_equals_single(
    dim: int, n: int, interaction: bool, trust: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    f = ContextFeatures(dim, ("a", "b"), ("x", "y", "z"), interaction=interaction, trust=trust)
    profiles = rng.normal(size=(n, dim))
    trust_vec = rng.random(n)
    m = 20
    s = rng.integers(0, n, m)
    r = rng.integers(0, n, m)
    proto = rng.integers(0, 2, m)
    role = rng.integers(0, 3, m)
    batch = f.build(profiles, trust_vec, s, r, proto, role)
    assert batch.shape == (m, f.dim)
    for k in range(m):
        x = f.single(
            profiles[s[k]],
            profiles[r[k]],
            f.protocols[proto[k]],
            f.roles[role[k]],
            trust_vec[s[k]],
            trust_vec[r[k]],
        )
        np.testing.assert_array_equal(batch[k], x)


def test_build_requires_trust_when_on() -> None:
    f = ContextFeatures(2)
    idx = np.array([0])
    with pytest.raises(ValueError):
        f.build(np.zeros((2, 2)), None, idx, idx + 1, idx, idx)
    with pytest.raises(ValueError):
        f.build(np.zeros((2, 3)), np.zeros(2), idx, idx + 1, idx, idx)


@pytest.mark.parametrize(
    ("protocols", "roles"), [((), ("one_way",)), (("akd", "akd"), ("one_way",)), (("akd",), ("",))]
)
def test_bad_protocol_or_role_names(protocols: tuple[str, ...], roles: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        ContextFeatures(4, protocols, roles)


def test_unknown_combo() -> None:
    with pytest.raises(ValueError):
        ContextFeatures(4).combo_index("lora", "one_way")


def test_trust_ledger_smoothing_and_state() -> None:
    ledger = TrustLedger()
    assert ledger.score("new") == 0.5
    ledger.record("a", True)
    ledger.record("a", True)
    ledger.record("a", False)
    assert ledger.counts("a") == (3, 2)
    assert ledger.score("a") == pytest.approx(3 / 5)
    np.testing.assert_allclose(ledger.scores(["a", "new"]), [0.6, 0.5])
    copy = TrustLedger(ledger.state())
    assert copy.state() == {"a": (3, 2)}
    with pytest.raises(ValueError):
        TrustLedger({"a": (1, 2)})
    with pytest.raises(ValueError):
        TrustLedger({"a": (-1, 0)})
