"""The conflict scores ``C_d`` in one byte (fedproxy codec format /2): exact round trips for
every cohort size up to 255, the float32 fallback beyond, and malformed payloads refused."""

from __future__ import annotations

import json

import pytest
import torch
from peerlm.agent.fedproxy.codec import (
    CONFLICT_ENCODING_KEY,
    CONFLICT_PREFIX,
    PROXY_FORMAT,
    decode_proxy,
    encode_proxy,
)
from peerlm.agent.fedproxy.hties import analyse, conflict_scores, task_vectors
from peerlm.agent.fedproxy.proxy import PROXY_CONFIG_KEY, ProxyError, ProxyInfo
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

INFO = ProxyInfo("gpt2", 4, (0, 3), "transformer.h", 0.5)
CONFIG = {"model_type": "gpt2", "n_layer": 2, PROXY_CONFIG_KEY: INFO.to_dict()}
SHAPES = {"w": (64, 32), "b": (32,)}


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _scores(k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Eq. 7's scores of a cohort of ``k`` members: every |Σ sign| in [0, K] occurs."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in SHAPES.items():
        agreement = torch.randint(0, k + 1, shape, generator=gen).to(torch.float64)
        agreement.view(-1)[: k + 1] = torch.arange(k + 1, dtype=torch.float64)[: agreement.numel()]
        out[key] = conflict_scores(agreement, k)
    return out


def _decode(data: bytes, max_bytes: int = 1 << 22) -> object:
    return decode_proxy(data, SHAPES, max_bytes=max_bytes, round_=2, expected_info=INFO)


def _refusal(data: bytes, max_bytes: int = 1 << 22) -> str:
    with pytest.raises(ProxyError) as err:
        _decode(data, max_bytes)
    return err.value.reason


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 16, 100, 128, 254, 255])
def test_scores_round_trip_bit_for_bit_in_one_byte_for_every_k_up_to_255(k: int) -> None:
    state, scores = _state(), _scores(k, seed=k)
    data = encode_proxy(state, CONFIG, 2, scores)
    got = decode_proxy(data, SHAPES, max_bytes=1 << 22, round_=2, expected_info=INFO)
    for key, score in scores.items():
        assert got.conflict[key].dtype == torch.float32
        assert torch.equal(got.conflict[key], score), key
    tensors = st_load(data)
    assert all(tensors[CONFLICT_PREFIX + key].dtype == torch.uint8 for key in SHAPES)
    # One byte a score instead of four.
    float32 = encode_proxy(state, CONFIG, 2, None)
    n = sum(s.numel() for s in scores.values())
    assert len(data) - len(float32) < n + 512


def test_h_ties_analysis_scores_round_trip_exactly() -> None:
    """The owner's own scores (signs with zeros, K = 5) decode to the same float32 tensors."""
    base = _state()
    gen = torch.Generator().manual_seed(3)
    clients = []
    for _ in range(5):
        moved = {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()}
        moved["b"][:4] = base["b"][:4]  # zero task-vector entries: sign 0
        clients.append(moved)
    scores = analyse(task_vectors(base, clients)).conflict
    got = _decode(encode_proxy(base, CONFIG, 2, scores))
    assert all(torch.equal(got.conflict[k], scores[k]) for k in scores)  # type: ignore[attr-defined]


def test_more_than_255_members_fall_back_to_float32_exactly() -> None:
    """K = 256: 1/256 is no level of any K <= 255, so the scores travel as float32."""
    scores = _scores(256, seed=9)
    data = encode_proxy(_state(), CONFIG, 2, scores)
    got = _decode(data)
    assert all(torch.equal(got.conflict[k], scores[k]) for k in scores)  # type: ignore[attr-defined]
    assert st_load(data)[CONFLICT_PREFIX + "w"].dtype == torch.float32


def _payload(
    scores: dict[str, torch.Tensor], encoding: str | None, fmt: str = PROXY_FORMAT
) -> bytes:
    """A proxy payload written by hand with score tensors and encoding as given."""
    tensors = {k: v.clone() for k, v in _state().items()}
    tensors.update({CONFLICT_PREFIX + k: v for k, v in scores.items()})
    meta = {
        "peerlm.format": fmt,
        "peerlm.round": "2",
        "peerlm.proxy": json.dumps(INFO.to_dict(), sort_keys=True),
        "peerlm.config": json.dumps(CONFIG, sort_keys=True),
    }
    if encoding is not None:
        meta[CONFLICT_ENCODING_KEY] = encoding
    return st_save(tensors, metadata=meta)


def _bytes(value: int) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, value, dtype=torch.uint8) for k, s in SHAPES.items()}


def test_malformed_score_encodings_are_refused_with_their_reason() -> None:
    halves = {k: torch.full(s, 0.5) for k, s in SHAPES.items()}
    # The declared encoding is missing, unknown or out of range.
    assert _refusal(_payload(_bytes(1), None)) == "decode"
    assert _refusal(_payload(_bytes(1), "u8/0")) == "decode"
    assert _refusal(_payload(_bytes(1), "u8/256")) == "decode"
    assert _refusal(_payload(_bytes(1), "u8/x")) == "decode"
    assert _refusal(_payload(_bytes(1), "bf16")) == "decode"
    # Score tensors not of the declared encoding.
    assert _refusal(_payload(halves, "u8/4")) == "dtype"
    assert _refusal(_payload(_bytes(1), "f32")) == "dtype"
    # A byte above K is no level of K.
    assert _refusal(_payload(_bytes(5), "u8/4")) == "non_finite"
    # Format /1 carries float32 scores and no encoding key.
    assert _refusal(_payload(halves, "u8/4", fmt="peerlm-fedproxy-proxy/1")) == "decode"
    assert _refusal(_payload(_bytes(1), None, fmt="peerlm-fedproxy-proxy/1")) == "dtype"
    assert _refusal(_payload(halves, None, fmt="peerlm-fedproxy-proxy/9")) == "format"


def test_format_1_float32_scores_still_decode() -> None:
    """An owner's checkpoint written before the one-byte scores resumes."""
    halves = {k: torch.full(s, 0.5) for k, s in SHAPES.items()}
    got = _decode(_payload(halves, None, fmt="peerlm-fedproxy-proxy/1"))
    assert all(torch.equal(got.conflict[k], halves[k]) for k in halves)  # type: ignore[attr-defined]


def test_a_weight_sent_as_bytes_is_refused() -> None:
    """U8 is for scores only: a weight in one byte is no proxy weight."""
    data = encode_proxy(_state(), CONFIG, 2, _scores(4))
    tensors = st_load(data)
    tensors["b"] = torch.zeros(32, dtype=torch.uint8)
    meta = {
        "peerlm.format": PROXY_FORMAT,
        "peerlm.round": "2",
        "peerlm.proxy": json.dumps(INFO.to_dict(), sort_keys=True),
        "peerlm.config": json.dumps(CONFIG, sort_keys=True),
        CONFLICT_ENCODING_KEY: "u8/4",
    }
    assert _refusal(st_save(tensors, metadata=meta)) == "dtype"


def test_truncated_and_oversized_payloads_are_refused() -> None:
    data = encode_proxy(_state(), CONFIG, 2, _scores(4))
    for cut in (0, 7, 100, len(data) // 2, len(data) - 1):
        assert _refusal(data[:cut]) == "decode", cut
    assert _refusal(data, max_bytes=len(data) - 1) == "too_large"
    assert _refusal(data + b"\0") == "decode"
