"""Top-P signatures: Alg. 1, sparse cosine, prototypes, wire format, importance EMA."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from peerlm.overlay.signature import (
    ImportanceTracker,
    Signature,
    SignatureError,
    cosine_matrix,
    cosine_to_many,
    flatten_adapter,
    make_signature,
    minimal_p,
    network_p,
    prototype,
    sparse_cosine,
    top_p_indices,
)

SPACE = "testspace"

# Small integers as floats: squares and their sums are exact, so brute force and the
# prefix sums agree to the bit and minimality can be checked exactly.
int_vectors = st.integers(1, 40).flatmap(
    lambda m: st.tuples(
        hnp.arrays(np.float64, m, elements=st.integers(-30, 30).map(float)),
        hnp.arrays(np.float64, m, elements=st.integers(0, 6).map(float)),
    )
)


def dense_cos(x: np.ndarray, y: np.ndarray) -> float:
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    return 0.0 if nx == 0 or ny == 0 else float(np.dot(x, y) / (nx * ny))


def brute_top_p(scores: np.ndarray, p: int) -> np.ndarray:
    # Sort by (-score, index) explicitly, independent of the implementation's partition.
    order = sorted(range(len(scores)), key=lambda r: (-scores[r], r))
    return np.sort(np.asarray(order[:p], dtype=np.int64))


def random_signature(rng: np.random.Generator, dim: int, p: int, space: str = SPACE) -> Signature:
    w = rng.normal(size=dim)
    return make_signature(w, np.abs(w) + rng.random(dim), p, space)


# ----------------------------------------------------------------------- Top-P


@given(int_vectors, st.data())
def test_top_p_matches_sorted_definition(pair: tuple[np.ndarray, np.ndarray], data) -> None:
    _, scores = pair
    p = data.draw(st.integers(1, len(scores)))
    got = top_p_indices(scores, p)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, brute_top_p(scores, p))


def test_top_p_ties_go_to_lower_index_and_bad_input_is_refused() -> None:
    np.testing.assert_array_equal(top_p_indices(np.array([1.0, 2.0, 1.0, 1.0]), 2), [0, 1])
    with pytest.raises(SignatureError, match="P must lie"):
        top_p_indices(np.ones(3), 0)
    with pytest.raises(SignatureError, match="P must lie"):
        top_p_indices(np.ones(3), 4)
    with pytest.raises(SignatureError, match="non-finite"):
        top_p_indices(np.array([1.0, math.nan]), 1)
    with pytest.raises(SignatureError, match="empty"):
        top_p_indices(np.array([]), 1)


# --------------------------------------------------------------------- Alg. 1


@given(int_vectors, st.sampled_from([0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]))
def test_minimal_p_equals_brute_force(pair: tuple[np.ndarray, np.ndarray], tau: float) -> None:
    w, s = pair
    m = len(w)
    total = float(np.sum(w * w))
    got = minimal_p(w, s, tau)
    if total == 0.0:
        assert got == m
        return
    feasible = [
        p for p in range(1, m + 1) if float(np.sum(w[brute_top_p(s, p)] ** 2)) >= tau * tau * total
    ]
    assert got == feasible[0]
    # and the signature at that P really reaches tau (in cosine terms)
    mask = np.zeros(m)
    mask[brute_top_p(s, got)] = w[brute_top_p(s, got)]
    assert dense_cos(w, mask) >= tau - 1e-12


@given(int_vectors, st.integers(1, 8))
def test_minimal_p_tolerance_bounds(pair: tuple[np.ndarray, np.ndarray], tol: int) -> None:
    w, s = pair
    exact = minimal_p(w, s, 0.8)
    loose = minimal_p(w, s, 0.8, tolerance=tol)
    assert exact <= loose < exact + tol


def test_minimal_p_corner_cases() -> None:
    w = np.array([3.0, 4.0, 0.0, 0.0])
    assert minimal_p(w, np.abs(w), 0.79) == 1  # cos = 4/5
    assert minimal_p(w, np.abs(w), 0.81) == 2
    assert minimal_p(np.zeros(5), np.ones(5), 0.9) == 5  # zero model: M (Alg. 1 line 2)
    # hi caps the answer when tau is unreachable below it
    assert minimal_p(w, np.abs(w), 1.0, hi=1) == 1
    # lo restricts the search from below
    assert minimal_p(w, np.abs(w), 0.5, lo=3) == 3
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(SignatureError, match="tau_min"):
            minimal_p(w, np.abs(w), bad)
    with pytest.raises(SignatureError, match="non-finite"):
        minimal_p(np.array([1.0, math.inf]), np.ones(2), 0.8)
    with pytest.raises(SignatureError, match="differ in length"):
        minimal_p(w, np.ones(3), 0.8)
    with pytest.raises(SignatureError, match="exceeds"):
        minimal_p(w, np.abs(w), 0.8, lo=3, hi=2)
    with pytest.raises(SignatureError, match="tolerance"):
        minimal_p(w, np.abs(w), 0.8, tolerance=0)
    with pytest.raises(SignatureError, match="empty"):
        minimal_p(np.array([]), np.array([]), 0.8)


# ------------------------------------------------------------------ cosine


sig_pairs = st.integers(1, 60).flatmap(
    lambda dim: st.tuples(
        st.just(dim),
        st.integers(1, dim),
        st.integers(1, dim),
        st.integers(0, 2**32 - 1),
    )
)


@given(sig_pairs)
def test_sparse_cosine_equals_dense_cosine(case: tuple[int, int, int, int]) -> None:
    dim, pa, pb, seed = case
    rng = np.random.default_rng(seed)
    wa = rng.normal(size=dim)
    wb = wa + rng.normal(scale=rng.random() * 2, size=dim)  # overlapping supports likely
    a = make_signature(wa, np.abs(wa), pa, SPACE)
    b = make_signature(wb, np.abs(wb), pb, SPACE)
    expected = dense_cos(a.dense(), b.dense())
    assert sparse_cosine(a, b) == pytest.approx(expected, abs=1e-12)
    assert sparse_cosine(b, a) == pytest.approx(expected, abs=1e-12)
    # the values used are the float16 ones: dense() equals the masked fp16 weights
    mask = np.zeros(dim)
    idx = brute_top_p(np.abs(wa), pa)
    mask[idx] = wa[idx].astype(np.float16)
    np.testing.assert_array_equal(a.dense(), mask)


def test_cosine_across_spaces_zero_vectors_and_self() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=50)
    a = make_signature(w, np.abs(w), 10, "space-a")
    b = make_signature(w, np.abs(w), 10, "space-b")
    c = make_signature(
        np.concatenate([w, [0.0]]), np.concatenate([np.abs(w), [0.0]]), 10, "space-a"
    )
    zero = make_signature(np.zeros(50), np.ones(50), 5, "space-a")
    assert sparse_cosine(a, a) == pytest.approx(1.0)
    assert sparse_cosine(a, b) == 0.0  # same vector, other space fingerprint
    assert sparse_cosine(a, c) == 0.0  # same fingerprint string but another dim
    assert sparse_cosine(a, zero) == 0.0
    assert sparse_cosine(zero, zero) == 0.0
    assert sparse_cosine(a, make_signature(-w, np.abs(w), 10, "space-a")) == pytest.approx(-1.0)


@settings(max_examples=30)
@given(st.integers(0, 2**32 - 1), st.integers(0, 12))
def test_cosine_to_many_and_matrix_match_pairwise(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    dim = 40
    base = rng.normal(size=dim)
    sigs = []
    for k in range(n):
        w = base + rng.normal(scale=0.7, size=dim)
        space = SPACE if k % 4 else "other"
        p = int(rng.integers(1, dim + 1))
        if k == 5:
            w = np.zeros(dim)
        sigs.append(make_signature(w, np.abs(w) + rng.random(dim), p, space))
    query = make_signature(base, np.abs(base), 12, SPACE)
    many = cosine_to_many(query, sigs)
    assert many.shape == (n,)
    np.testing.assert_allclose(many, [sparse_cosine(query, s) for s in sigs], atol=1e-12)
    matrix = cosine_matrix(sigs)
    assert matrix.shape == (n, n)
    np.testing.assert_array_equal(matrix, matrix.T)
    for i in range(n):
        for j in range(n):
            expected = sparse_cosine(sigs[i], sigs[j]) if i != j else float(sigs[i].norm() > 0)
            assert matrix[i, j] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dim", [300, 10**6])  # lookup-table path, binary-search path
def test_cosine_to_many_both_location_paths(dim: int) -> None:
    rng = np.random.default_rng(dim)
    pool = rng.choice(dim, 300, replace=False)  # shared candidates: supports overlap

    def sig() -> Signature:
        idx = np.sort(rng.choice(pool, 40, replace=False))
        vals = rng.normal(size=40).astype(np.float16)
        return Signature(indices=idx, values=vals, dim=dim, space=SPACE)

    query, others = sig(), [sig() for _ in range(30)]
    got = cosine_to_many(query, others)
    expected = [dense_cos(query.dense(), o.dense()) for o in others]
    np.testing.assert_allclose(got, expected, atol=1e-12)
    assert np.count_nonzero(got) > 20


def test_batch_helpers_on_empty_input() -> None:
    rng = np.random.default_rng(2)
    q = random_signature(rng, 20, 5)
    assert cosine_to_many(q, []).shape == (0,)
    assert cosine_matrix([]).shape == (0, 0)
    zero_q = make_signature(np.zeros(20), np.ones(20), 3, SPACE)
    np.testing.assert_array_equal(cosine_to_many(zero_q, [q, q]), [0.0, 0.0])


# ------------------------------------------------------------------ construction


def test_make_signature_validation() -> None:
    w = np.array([1.0, -2.0, 3.0])
    sig = make_signature(w, np.abs(w), 2, SPACE)
    np.testing.assert_array_equal(sig.indices, [1, 2])
    assert sig.values.dtype == np.float16 and sig.p == 2 and sig.dim == 3
    assert sig.norm() == pytest.approx(math.sqrt(13))
    with pytest.raises(SignatureError, match="non-finite"):
        make_signature(np.array([1.0, math.nan, 2.0]), np.ones(3), 1, SPACE)
    with pytest.raises(SignatureError, match="non-finite"):
        make_signature(w, np.array([1.0, math.inf, 2.0]), 1, SPACE)
    with pytest.raises(SignatureError, match="P must lie"):
        make_signature(w, np.abs(w), 4, SPACE)
    with pytest.raises(SignatureError, match="P must lie"):
        make_signature(w, np.abs(w), 0, SPACE)
    with pytest.raises(SignatureError, match="differ in length"):
        make_signature(w, np.ones(2), 1, SPACE)
    with pytest.raises(SignatureError, match="empty"):
        make_signature(np.array([]), np.array([]), 1, SPACE)
    with pytest.raises(SignatureError, match="one-dimensional"):
        make_signature(np.ones((2, 2)), np.ones((2, 2)), 1, SPACE)
    with pytest.raises(SignatureError, match="float16"):
        make_signature(np.array([1e6, 1.0]), np.ones(2), 2, SPACE)
    with pytest.raises(SignatureError, match="space"):
        make_signature(w, np.abs(w), 1, "")
    with pytest.raises(SignatureError, match="ASCII"):
        make_signature(w, np.abs(w), 1, "späce")


def test_signature_constructor_rejects_malformed_fields() -> None:
    f16 = np.ones(3, dtype=np.float16)
    ok = Signature(indices=np.array([0, 2, 5]), values=f16, dim=6, space=SPACE)
    assert ok.indices.dtype == np.int64 and not ok.indices.flags.writeable
    cases = {
        "ascending": dict(indices=np.array([0, 2, 2]), values=f16, dim=6),
        "lie in": dict(indices=np.array([0, 2, 6]), values=f16, dim=6),
        "pair up": dict(indices=np.array([0, 2]), values=f16, dim=6),
        "float16": dict(indices=np.array([0, 1, 2]), values=np.ones(3), dim=6),
        "finite": dict(
            indices=np.array([0, 1, 2]), values=np.array([1, np.nan, 1], np.float16), dim=6
        ),
        "at least one": dict(
            indices=np.array([], np.int64), values=np.array([], np.float16), dim=6
        ),
        "exceeds": dict(indices=np.array([0, 1, 2]), values=f16, dim=2),
        "integers": dict(indices=np.array([0.0, 1.0, 2.0]), values=f16, dim=6),
    }
    for message, kwargs in cases.items():
        with pytest.raises(SignatureError, match=message):
            Signature(space=SPACE, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------- prototype


def dense_prototype(sigs: list[Signature], p: int) -> tuple[np.ndarray, np.ndarray]:
    mean = np.mean([s.dense() for s in sigs], axis=0)
    idx = brute_top_p(np.abs(mean), p)
    return idx, mean[idx].astype(np.float16)


@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 30))
def test_prototype_equals_top_p_of_dense_mean(seed: int, n: int, p: int) -> None:
    rng = np.random.default_rng(seed)
    dim = 30
    sigs = [random_signature(rng, dim, int(rng.integers(1, 10))) for _ in range(n)]
    proto = prototype(sigs, p)
    idx, vals = dense_prototype(sigs, p)
    assert proto.p == p and proto.space == SPACE and proto.dim == dim
    np.testing.assert_array_equal(proto.indices, idx)
    np.testing.assert_array_equal(proto.values, vals)


def test_prototype_cancellation_and_validation() -> None:
    a = Signature(np.array([3, 7]), np.array([1.0, 2.0], np.float16), 10, SPACE)
    b = Signature(np.array([3, 8]), np.array([-1.0, 4.0], np.float16), 10, SPACE)
    proto = prototype([a, b], 3)  # coordinate 3 cancels: the dense Top-3 of |mean| is {8, 7, 0}
    np.testing.assert_array_equal(proto.indices, [0, 7, 8])
    np.testing.assert_array_equal(proto.values, np.array([0.0, 1.0, 2.0], np.float16))
    with pytest.raises(SignatureError, match="at least one"):
        prototype([], 2)
    with pytest.raises(SignatureError, match="share one parameter space"):
        prototype([a, Signature(np.array([1]), np.ones(1, np.float16), 10, "other")], 1)
    with pytest.raises(SignatureError, match="share one parameter space"):
        prototype([a, Signature(np.array([1]), np.ones(1, np.float16), 11, SPACE)], 1)
    with pytest.raises(SignatureError, match="P must lie"):
        prototype([a], 11)


# ----------------------------------------------------------------------- wire


@given(st.integers(0, 2**32 - 1), st.integers(1, 50), st.data())
def test_bytes_round_trip(seed: int, dim: int, data) -> None:
    rng = np.random.default_rng(seed)
    p = data.draw(st.integers(1, dim))
    space = data.draw(
        st.text(
            alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=128
        )
    )
    sig = random_signature(rng, dim, p, space)
    raw = sig.to_bytes()
    assert len(raw) == 20 + len(space) + 6 * p
    back = Signature.from_bytes(raw, max_p=p)
    assert back == sig and hash(back) == hash(sig)
    assert back.norm() == sig.norm()


def _encode(space: bytes, dim: int, p: int, idx: list[int], vals: list[float], **hdr) -> bytes:
    header = struct.pack(
        "<4sBBHQI",
        hdr.get("magic", b"PSIG"),
        hdr.get("version", 1),
        hdr.get("flags", 0),
        hdr.get("space_len", len(space)),
        dim,
        p,
    )
    return header + space + np.asarray(idx, "<u4").tobytes() + np.asarray(vals, "<f2").tobytes()


def test_from_bytes_rejects_every_malformed_case() -> None:
    good = _encode(b"sp", 10, 3, [1, 4, 9], [0.5, -1.0, 2.0])
    assert Signature.from_bytes(good, max_p=3).p == 3

    def enc(**kw) -> bytes:
        args = {"space": b"sp", "dim": 10, "p": 3, "idx": [1, 4, 9], "vals": [0.5, -1.0, 2.0]}
        hdr = {k: kw.pop(k) for k in ("magic", "version", "flags", "space_len") if k in kw}
        args.update(kw)
        return _encode(args["space"], args["dim"], args["p"], args["idx"], args["vals"], **hdr)

    cases = [
        (good[:10], "shorter than its 20-byte header"),
        (enc(magic=b"XSIG"), "magic"),
        (enc(version=2), "version 2"),
        (enc(flags=1), "flags"),
        (enc(space=b""), "space length 0"),
        (enc(space=b"s" * 200), "space length 200"),
        (enc(space=b"\xff\xfe"), "not ASCII"),
        (enc(space=b"a\n"), "printable ASCII"),
        (enc(dim=0), "dim 0 outside"),
        (enc(dim=2**33), "outside \\[1, 2\\*\\*32\\]"),
        (enc(p=0, idx=[], vals=[]), "P = 0"),
        (enc(p=4, idx=[1, 4, 8, 9], vals=[0.5, -1.0, 2.0, 1.0]), "over the limit of 3"),
        (enc(dim=2, idx=[0, 1, 2]), "in a 2-dim space"),
        (good[:-1], "header .* implies"),
        (good + b"\x00", "header .* implies"),
        (enc(space_len=3), "header .* implies"),
        (enc(idx=[1, 9, 4]), "strictly ascending"),
        (enc(idx=[1, 4, 4]), "strictly ascending"),
        (enc(idx=[1, 4, 10]), "must lie in \\[0, 10\\)"),
        (enc(vals=[0.5, math.nan, 2.0]), "finite"),
        (enc(vals=[0.5, -math.inf, 2.0]), "finite"),
    ]
    for raw, message in cases:
        with pytest.raises(SignatureError, match=message):
            Signature.from_bytes(raw, max_p=3)
    with pytest.raises(SignatureError, match="over the limit of 2"):
        Signature.from_bytes(good, max_p=2)
    with pytest.raises(ValueError, match="max_p"):
        Signature.from_bytes(good, max_p=0)


# --------------------------------------------------------------------- network P


@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=60),
    st.floats(0.01, 1.0),
    st.integers(1, 600),
)
def test_network_p_is_the_lower_quantile_clipped(reports: list[int], q: float, p_max: int) -> None:
    got = network_p(reports, q, p_max)
    unclipped = network_p(reports, q, 10**9)
    assert got == min(unclipped, p_max)
    assert unclipped in reports
    n = len(reports)
    # at least a q-fraction reach the target with P = unclipped, and no smaller report does
    assert sum(r <= unclipped for r in reports) >= q * n - 1e-9
    assert sum(r < unclipped for r in reports) < q * n
    assert unclipped == int(np.quantile(reports, q, method="inverted_cdf")) or math.isclose(
        q * n, round(q * n), abs_tol=1e-9
    )


def test_network_p_examples_and_validation() -> None:
    reports = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert network_p(reports, 0.9, 1000) == 90  # 9 of 10 clients reach tau_min
    assert network_p(reports, 0.8, 1000) == 80
    assert network_p(reports, 0.85, 1000) == 90
    assert network_p(reports, 0.9, 64) == 64
    assert network_p([7], 1.0, 10) == 7
    with pytest.raises(SignatureError, match="at least one"):
        network_p([], 0.9, 10)
    for q in (0.0, 1.1, math.nan):
        with pytest.raises(SignatureError, match="q must"):
            network_p(reports, q, 10)
    with pytest.raises(SignatureError, match="p_max"):
        network_p(reports, 0.9, 0)
    with pytest.raises(SignatureError, match=">= 1"):
        network_p([0, 3], 0.9, 10)
    with pytest.raises(SignatureError, match="integers"):
        network_p([1.5, 3.0], 0.9, 10)  # type: ignore[list-item]


# ---------------------------------------------------------------- importance EMA


def test_importance_ema_follows_the_recurrence() -> None:
    tracker = ImportanceTracker(beta=0.75)
    assert tracker.scores is None and tracker.updates == 0
    w1, w2, w3 = np.array([1.0, -4.0, 0.0]), np.array([-2.0, 0.0, 8.0]), np.array([0.0, 1.0, 1.0])
    np.testing.assert_allclose(tracker.update(w1), np.abs(w1))  # first update: s = |w|
    s2 = tracker.update(w2)
    np.testing.assert_allclose(s2, 0.75 * np.abs(w1) + 0.25 * np.abs(w2))
    state = tracker.state_dict()
    s3 = tracker.update(w3)
    np.testing.assert_allclose(s3, 0.75 * s2 + 0.25 * np.abs(w3))
    restored = ImportanceTracker()
    restored.load_state_dict(state)
    assert restored.beta == 0.75 and restored.updates == 2
    np.testing.assert_array_equal(restored.update(w3), s3)
    raw = ImportanceTracker(beta=0.0)
    raw.update(w1)
    np.testing.assert_array_equal(raw.update(w2), np.abs(w2))  # beta 0: raw magnitudes


def test_importance_validation_leaves_state_unchanged() -> None:
    for beta in (-0.1, 1.0, 2.0):
        with pytest.raises(SignatureError, match="beta"):
            ImportanceTracker(beta=beta)
    tracker = ImportanceTracker()
    assert tracker.beta == 0.5
    tracker.update(np.ones(4))
    with pytest.raises(SignatureError, match="coordinates"):
        tracker.update(np.ones(5))
    with pytest.raises(SignatureError, match="non-finite"):
        tracker.update(np.array([1.0, math.nan, 1.0, 1.0]))
    np.testing.assert_array_equal(tracker.scores, np.ones(4))
    before = tracker.state_dict()
    bad_states = [
        {"beta": 0.5, "updates": 1},
        {"beta": 1.5, "updates": 1, "scores": np.ones(4)},
        {"beta": 0.5, "updates": -1, "scores": None},
        {"beta": 0.5, "updates": 1, "scores": np.array([1.0, -1.0])},
        {"beta": 0.5, "updates": 0, "scores": np.ones(2)},
        {"beta": 0.5, "updates": 2, "scores": None},
        {"beta": 0.5, "updates": 2, "scores": np.array([math.nan])},
    ]
    for state in bad_states:
        with pytest.raises(SignatureError):
            tracker.load_state_dict(state)
    after = tracker.state_dict()
    assert after["beta"] == before["beta"] and after["updates"] == before["updates"]
    np.testing.assert_array_equal(after["scores"], before["scores"])


# --------------------------------------------------------------------- flattening


def test_flatten_adapter_order_dtype_and_fingerprint() -> None:
    tensors = {
        "b.lora_B": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "a.lora_A": np.array([[1.5, -2.0]], dtype=np.float64),
    }
    vector, space = flatten_adapter(tensors)
    assert vector.dtype == np.float32
    np.testing.assert_array_equal(vector, [1.5, -2.0, 0, 1, 2, 3, 4, 5])
    assert len(space) == 16 and int(space, 16) >= 0
    # same names and shapes, other values: same space; another shape or name: another space
    _, space_same = flatten_adapter({"a.lora_A": np.zeros((1, 2)), "b.lora_B": np.ones((2, 3))})
    assert space_same == space
    _, other_shape = flatten_adapter({"a.lora_A": np.zeros((2, 1)), "b.lora_B": np.ones((2, 3))})
    _, other_name = flatten_adapter({"a.lora_X": np.zeros((1, 2)), "b.lora_B": np.ones((2, 3))})
    assert len({space, other_shape, other_name}) == 3
    with pytest.raises(SignatureError, match="empty"):
        flatten_adapter({})
    with pytest.raises(SignatureError, match="non-finite"):
        flatten_adapter({"x": torch.tensor([1.0, float("nan")])})
    with pytest.raises(SignatureError, match="non-finite"):
        flatten_adapter({"x": np.array([np.inf])})
    with pytest.raises(SignatureError, match="non-numeric"):
        flatten_adapter({"x": np.array(["a"])})
    with pytest.raises(SignatureError, match="no values"):
        flatten_adapter({"x": np.zeros((0, 3))})


def test_signature_of_an_adapter_end_to_end() -> None:
    rng = np.random.default_rng(3)
    tensors = {f"layer{k}.lora_A": rng.normal(size=(4, 16)).astype(np.float32) for k in range(3)}
    vector, space = flatten_adapter(tensors)
    tracker = ImportanceTracker()
    scores = tracker.update(vector)
    p = minimal_p(vector, scores, 0.8)
    sig = make_signature(vector, scores, p, space)
    assert dense_cos(vector, sig.dense()) >= 0.8 - 1e-3  # fp16 values: within rounding
    assert sig.p == p < vector.shape[0]
