"""The shared safetensors checks of :mod:`peerlm.agent.adapter_codec`, one refusal at a time.

Blobs are written by hand (a header length, a JSON header, raw data) so that each case
breaks exactly one thing a well-behaved writer never would.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from peerlm.agent.adapter_codec import (
    AdapterError,
    SafetensorsHeader,
    check_tensor_table,
    check_tensors,
    load_finite_tensors,
    read_safetensors_header,
)
from peerlm.agent.fedwave.errors import FedWaveError
from safetensors.torch import save as st_save

SHAPES = {"a": (2, 3), "b": (4,)}  # 24 + 16 bytes of float32


def _raw(table: dict[str, Any], data: bytes, meta: object = None) -> bytes:
    header = dict(table)
    if meta is not None:
        header["__metadata__"] = meta
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _good_table() -> dict[str, Any]:
    return {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
    }


def _floats(n: int, value: float = 0.5) -> bytes:
    return struct.pack(f"<{n}f", *([value] * n))


def _table_error(table: dict[str, Any], data_bytes: int = 40) -> AdapterError:
    header = SafetensorsHeader(metadata={}, tensors=table, data_bytes=data_bytes)
    with pytest.raises(AdapterError) as err:
        check_tensor_table(header, SHAPES)
    return err.value


def test_a_hand_written_blob_passes_and_decodes() -> None:
    blob = _raw(_good_table(), _floats(10), meta={"k": "v"})
    header = read_safetensors_header(blob)
    assert header.metadata == {"k": "v"} and header.data_bytes == 40
    check_tensor_table(header, SHAPES)
    state = load_finite_tensors(blob)
    assert state["a"].shape == (2, 3) and float(state["b"][3]) == 0.5
    # What safetensors itself writes passes too (it pads the header with spaces).
    written = st_save({"a": torch.ones(2, 3), "b": torch.zeros(4)})
    check_tensor_table(read_safetensors_header(written), SHAPES)
    # Data in another order than the names is fine while the spans tile the data section.
    swapped = {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 40]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }
    check_tensor_table(SafetensorsHeader({}, swapped, 40), SHAPES)


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (b"\x00" * 7, "shorter than its header length"),
        (
            (2 * 1024 * 1024).to_bytes(8, "little") + b"{}" + b" " * (2 * 1024 * 1024),
            "exceeds the bound of 1048576",
        ),
        ((100).to_bytes(8, "little") + b"{}", "runs past the end of 10 bytes"),
        ((2).to_bytes(8, "little") + b"{x", "not JSON"),
        ((3).to_bytes(8, "little") + b"[1]", "not an object"),
        ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not JSON"),
        (_raw(_good_table(), _floats(10), meta=["x"]), "string-to-string"),
        (_raw(_good_table(), _floats(10), meta={"k": 1}), "string-to-string"),
    ],
)
def test_header_refusals_are_decode_errors(blob: bytes, needle: str) -> None:
    with pytest.raises(AdapterError, match=needle) as err:
        read_safetensors_header(blob)
    assert err.value.reason == "decode"


def test_oversized_header_is_refused_by_the_callers_bound() -> None:
    blob = _raw(_good_table(), _floats(10), meta={"pad": "x" * 5000})
    read_safetensors_header(blob)  # within the default 1 MiB bound
    with pytest.raises(AdapterError, match=r"header length .* exceeds the bound of 4096") as err:
        read_safetensors_header(blob, max_header_bytes=4096)
    assert err.value.reason == "decode"
    with pytest.raises(AdapterError, match="exceeds the limit") as err:
        read_safetensors_header(blob, max_bytes=len(blob) - 1)
    assert err.value.reason == "too_large"


@pytest.mark.parametrize(
    ("change", "reason", "needle"),
    [
        ({"c": {"dtype": "F32", "shape": [1], "data_offsets": [40, 44]}}, "keys", "unexpected: c"),
        ({"a": [1, 2]}, "decode", "not an object"),
        ({"a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]}}, "shape", "shape"),
        ({"a": {"dtype": "F32", "shape": [2, True, 3], "data_offsets": [0, 24]}}, "shape", "shape"),
        ({"a": {"dtype": "F32", "shape": "2x3", "data_offsets": [0, 24]}}, "shape", "shape"),
        ({"a": {"dtype": "I32", "shape": [2, 3], "data_offsets": [0, 24]}}, "dtype", "I32"),
        ({"a": {"dtype": None, "shape": [2, 3], "data_offsets": [0, 24]}}, "dtype", "None"),
        ({"a": {"dtype": "F32", "shape": [2, 3]}}, "decode", "bad data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, -24]}}, "decode", "bad"),
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24.0]}}, "decode", "bad"),
        # shape and bytes disagree: F16 needs 12 bytes, the offsets give 24
        ({"a": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}}, "decode", "needs 12"),
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, "decode", "needs 24"),
        # overlapping: b starts inside a
        ({"b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}}, "decode", "overlap"),
        # a gap between a and b (and b runs past the data section)
        ({"b": {"dtype": "F32", "shape": [4], "data_offsets": [28, 44]}}, "decode", "gap"),
    ],
)
def test_table_refusals(change: dict[str, Any], reason: str, needle: str) -> None:
    err = _table_error(_good_table() | change)
    assert err.reason == reason and needle in str(err), (reason, str(err))


def test_offsets_out_of_range_and_a_missing_tensor() -> None:
    err = _table_error(_good_table(), data_bytes=32)  # the data section is shorter than 40
    assert err.reason == "decode" and "32-byte data section" in str(err)
    err = _table_error(_good_table(), data_bytes=48)  # trailing bytes nothing owns
    assert err.reason == "decode" and "end at byte 40" in str(err)
    far = _good_table() | {
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [10**12, 10**12 + 16]}
    }
    assert _table_error(far).reason == "decode"
    missing = {"a": _good_table()["a"]}
    err = _table_error(missing)
    assert err.reason == "keys" and "missing: b" in str(err)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(value: float) -> None:
    data = _floats(6) + struct.pack("<4f", 0.0, value, 0.0, 0.0)
    with pytest.raises(AdapterError, match="tensor b is not finite") as err:
        load_finite_tensors(_raw(_good_table(), data))
    assert err.value.reason == "non_finite"


def test_safetensors_own_refusal_is_a_decode_error() -> None:
    # A table the shared check would refuse, handed straight to the decoder.
    bad = _good_table() | {"b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}}
    with pytest.raises(AdapterError, match="cannot decode adapter") as err:
        load_finite_tensors(_raw(bad, _floats(10)))
    assert err.value.reason == "decode"


def test_the_callers_error_type_and_word_are_kept() -> None:
    with pytest.raises(FedWaveError, match="router") as err:
        read_safetensors_header(b"\x00", what="router", error=FedWaveError)
    assert err.value.reason == "decode" and not isinstance(err.value, AdapterError)
    header = SafetensorsHeader({}, _good_table(), 40)
    with pytest.raises(FedWaveError, match="VCLayer tensor a is F32") as err:
        check_tensor_table(header, SHAPES, dtypes={"F16": 2}, what="VCLayer", error=FedWaveError)
    assert err.value.reason == "dtype"
    nan = _raw(_good_table(), _floats(9) + struct.pack("<f", float("nan")))
    with pytest.raises(FedWaveError, match="router tensor b is not finite"):
        load_finite_tensors(nan, what="router", error=FedWaveError)


def test_check_tensors_in_memory() -> None:
    good = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.float16)}
    check_tensors(good, SHAPES)
    cases = [
        ({"a": good["a"]}, "keys", "missing: b"),
        (good | {"c": torch.zeros(1)}, "keys", "unexpected: c"),
        (good | {"a": torch.zeros(3, 2)}, "shape", "tensor a: shape [3, 2] != [2, 3]"),
        (good | {"b": torch.zeros(4, dtype=torch.int32)}, "dtype", "tensor b is torch.int32"),
        (good | {"b": torch.tensor([0.0, 0.0, float("inf"), 0.0])}, "non_finite", "b is not"),
    ]
    for state, reason, needle in cases:
        with pytest.raises(AdapterError) as err:
            check_tensors(state, SHAPES)
        assert err.value.reason == reason and needle in str(err.value), (reason, str(err.value))
    with pytest.raises(FedWaveError, match="agent 'm': router tensor a: shape") as info:
        check_tensors(cases[2][0], SHAPES, what="agent 'm': router", error=FedWaveError)
    assert info.value.reason == "shape"
