"""The adapter codec: one format, validated cheapest-first, with a reason for each refusal."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.agent.adapter_codec import (
    AdapterError,
    AdapterSpec,
    EncodedAdapter,
    adapter_norm,
    check_state,
    decode_adapter,
    encode_adapter,
    lora_update_norms,
    read_metadata,
    update_bounds,
)
from safetensors.torch import save as st_save

SHAPES = {"l0.lora_A.weight": (4, 16), "l0.lora_B.weight": (16, 4)}


def _spec(**over: object) -> AdapterSpec:
    base: dict[str, object] = {
        "shapes": SHAPES,
        "model_type": "gpt2",
        "tokenizer_hash": "ab" * 32,
        "lora_r": 4,
        "lora_alpha": 8.0,
        "lora_json": json.dumps({"r": 4, "alpha": 8.0}),
    }
    base.update(over)
    return AdapterSpec(**base)  # type: ignore[arg-type]


def _state(scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: scale * torch.randn(s, generator=g) for k, s in SHAPES.items()}


def test_round_trip_and_metadata() -> None:
    spec, state = _spec(), _state()
    data = encode_adapter(state, spec)
    assert read_metadata(data)["peerlm.format"] == "peerlm-lora/1"
    back = decode_adapter(data, spec)
    assert all(torch.equal(back[k], state[k]) for k in state)
    enc = EncodedAdapter.of(data)
    assert enc.sha256 == hashlib.sha256(data).digest()
    assert len(data) <= spec.max_encoded_bytes()


@pytest.mark.parametrize(
    ("other", "reason"),
    [
        ({"model_type": "bloom"}, "model_type"),
        ({"tokenizer_hash": "cd" * 32}, "tokenizer"),
        ({"lora_json": json.dumps({"r": 4, "alpha": 32.0})}, "lora_config"),
    ],
)
def test_identity_is_checked(other: dict[str, object], reason: str) -> None:
    data = encode_adapter(_state(), _spec(**other))
    with pytest.raises(AdapterError) as err:
        decode_adapter(data, _spec())
    assert err.value.reason == reason
    decode_adapter(data, _spec(), identity="ignored")  # shapes alone fit


def test_table_is_checked_before_the_data() -> None:
    spec = _spec()
    narrow = {"l0.lora_A.weight": torch.zeros(2, 16), "l0.lora_B.weight": torch.zeros(16, 2)}
    with pytest.raises(AdapterError) as err:
        decode_adapter(st_save(narrow, metadata=spec.metadata()), spec)
    assert err.value.reason == "shape"
    extra = {**_state(), "other.weight": torch.zeros(1)}
    with pytest.raises(AdapterError) as err:
        decode_adapter(st_save(extra, metadata=spec.metadata()), spec)
    assert err.value.reason == "keys"
    ints = {k: torch.zeros(s, dtype=torch.int32) for k, s in SHAPES.items()}
    with pytest.raises(AdapterError) as err:
        decode_adapter(st_save(ints, metadata=spec.metadata()), spec)
    assert err.value.reason == "dtype"
    plain = st_save(_state())  # no peerlm metadata
    with pytest.raises(AdapterError) as err:
        decode_adapter(plain, spec)
    assert err.value.reason == "format"
    decode_adapter(plain, spec, identity="if_present")


@pytest.mark.parametrize(
    "blob", [b"", b"\x00" * 4, (10**9).to_bytes(8, "little") + b"{}", b"\x02" + b"\0" * 7 + b"[]"]
)
def test_garbage_is_a_decode_error(blob: bytes) -> None:
    with pytest.raises(AdapterError) as err:
        decode_adapter(blob, _spec())
    assert err.value.reason == "decode"


def test_values_finite_and_norm_bounded() -> None:
    spec = _spec()
    bad = _state()
    bad["l0.lora_B.weight"][0, 0] = float("nan")
    with pytest.raises(AdapterError) as err:
        decode_adapter(encode_adapter(bad, spec), spec)
    assert err.value.reason == "non_finite"
    # Finite but huge: what a malicious peer sends to wreck the student.
    huge = _state()
    huge["l0.lora_B.weight"].fill_(1e30)
    data = encode_adapter(huge, spec)
    decode_adapter(data, spec)  # finite: passes without a bound
    bound = 10 * adapter_norm(_state())
    with pytest.raises(AdapterError) as err:
        decode_adapter(data, spec, max_norm=bound)
    assert err.value.reason == "norm"
    assert adapter_norm(huge) > 1e30  # float64: no overflow to inf
    check_state(_state(), spec, max_norm=bound)


def test_size_limit() -> None:
    spec = _spec()
    data = encode_adapter(_state(), spec)
    with pytest.raises(AdapterError) as err:
        decode_adapter(data, spec, max_bytes=len(data) - 1)
    assert err.value.reason == "too_large"
    # float32 everywhere plus the header bound: a 64 MiB adapter fits its own limit.
    big = _spec(shapes={"w": (16 * 1024 * 1024,)})
    assert big.max_encoded_bytes() > 64 * 1024 * 1024


@settings(max_examples=40, deadline=None)
@given(
    r=st.integers(1, 6),
    m=st.integers(1, 12),
    n=st.integers(1, 12),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_update_norms_from_the_factors_equal_the_products_norm(
    r: int, m: int, n: int, scale: float, seed: int
) -> None:
    """||s B A||_F from the r x r Gram matrices is the dense product's Frobenius norm."""
    g = torch.Generator().manual_seed(seed)
    a, b = scale * torch.randn(r, n, generator=g), torch.randn(m, r, generator=g)
    state = {"x.lora_A.weight": a, "x.lora_B.weight": b}
    dense = float(torch.linalg.matrix_norm(b.double() @ a.double()))
    assert lora_update_norms(state, 2.0)["x"] == pytest.approx(2.0 * dense, rel=1e-9, abs=1e-12)


def test_a_split_budget_passes_the_factor_bound_and_not_the_update_bound() -> None:
    """A and B aligned and both large: the factors' norm stays under a 10x bound while the
    update is far over 4x ours; refused ``update_norm`` (decoding is otherwise the same)."""
    own = _state()
    spec = _spec()
    scaling = spec.lora_alpha / spec.lora_r
    bounds = update_bounds(own, scaling, 4.0)
    budget = 0.9 * 10 * adapter_norm(own)
    side = budget / (2 * 4) ** 0.5  # each of the 4 rows of A and the 4 columns of B
    u, v = torch.ones(16) / 4.0, torch.ones(16) / 4.0
    split = {
        "l0.lora_A.weight": (side * u).expand(4, 16).contiguous(),
        "l0.lora_B.weight": (side * v).unsqueeze(1).expand(16, 4).contiguous(),
    }
    blob = encode_adapter(split, spec)
    decode_adapter(blob, spec, max_norm=10 * adapter_norm(own))  # the factor bound passes
    with pytest.raises(AdapterError) as err:
        decode_adapter(blob, spec, max_norm=10 * adapter_norm(own), max_update_norms=bounds)
    assert err.value.reason == "update_norm" and "l0" in str(err.value)
    honest = {k: v * 1.5 for k, v in own.items()}  # 2.25x our update: inside 4x
    decode_adapter(encode_adapter(honest, spec), spec, max_update_norms=bounds)


def test_a_student_with_no_update_yet_keeps_a_bound_from_its_own_a() -> None:
    """B = 0 (nothing trained): the bound is what our A makes with a B as large as itself."""
    own = _state()
    own["l0.lora_B.weight"] = torch.zeros(16, 4)
    bound = update_bounds(own, 2.0, 4.0)["l0"]
    assert bound == pytest.approx(2.0 * float(torch.sum(own["l0.lora_A.weight"].double() ** 2)))
