"""The router's blob format (peerlm-router/1): round trip and every refusal."""

from __future__ import annotations

import json

import pytest
import torch
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.router import MoERouter, RouterSettings, fedavg_routers
from peerlm.agent.fedwave.router_codec import (
    decode_router,
    encode_router,
    router_shapes,
)
from safetensors.torch import save as st_save

SMALL = RouterSettings(hidden=5)


def router(seed: int, n_experts: int = 3, width: int = 6) -> MoERouter:
    return MoERouter(width, n_experts, SMALL, generator=torch.Generator().manual_seed(seed))


def blob(state: dict[str, torch.Tensor], **meta: str) -> bytes:
    base = {"format": "pt", "peerlm.format": "peerlm-router/1", "peerlm.router": "{}",
            "peerlm.n_samples": "5", "peerlm.round": "2"}  # fmt: skip
    return st_save(state, metadata=base | meta)


def _overlapping(data: bytes) -> bytes:
    """``data`` with its second tensor's offsets moved back into the first's bytes."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    second = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )[1]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def test_round_trip_feeds_fedavg() -> None:
    mine, peer = router(0), router(1)
    shapes = router_shapes(mine)
    decoded = decode_router(encode_router(peer, n_samples=40, round=3), shapes=shapes)
    assert decoded.n_samples == 40 and decoded.round == 3
    for name, tensor in peer.state_dict().items():
        assert torch.equal(decoded.state[name], tensor)
    merged = fedavg_routers({"me": (dict(mine.state_dict()), 10), "peer": (decoded.state, 40)})
    expected = 0.2 * mine.fc2.bias.double() + 0.8 * peer.fc2.bias.double()
    torch.testing.assert_close(merged["fc2.bias"].double(), expected, atol=1e-7, rtol=0)


def test_refusals_carry_their_reason() -> None:
    mine = router(0)
    shapes = router_shapes(mine)
    good = {k: v.detach().clone() for k, v in mine.state_dict().items()}
    nan = good | {"fc2.bias": torch.tensor([0.0, float("nan"), 0.0])}
    cases = [
        (encode_router(router(1, n_experts=4), n_samples=1, round=0), "shape"),
        (encode_router(router(1, width=2000), n_samples=1, round=0), "too_large"),
        (blob(nan), "non_finite"),
        (blob(good | {"extra": torch.zeros(1)}), "keys"),
        (blob(good | {"fc1.bias": torch.zeros(5, dtype=torch.float16)}), "dtype"),
        (blob(good, **{"peerlm.format": "peerlm-lora/1"}), "format"),
        (blob(good, **{"peerlm.n_samples": "x"}), "format"),
        (blob(good, **{"peerlm.n_samples": "0"}), "weights"),
        (blob(good, **{"peerlm.round": "-1"}), "weights"),
        (b"\x01\x02", "decode"),
        ((10**6).to_bytes(8, "little") + b"{}", "decode"),
        (len(b"[1]").to_bytes(8, "little") + b"[1]", "decode"),
        (len(b"{no").to_bytes(8, "little") + b"{no", "decode"),
        (blob(good) + b"\0" * 4, "decode"),  # bytes no tensor owns
        (_overlapping(blob(good)), "decode"),
    ]
    for data, reason in cases:
        with pytest.raises(FedWaveError) as info:
            decode_router(data, shapes=shapes)
        assert info.value.reason == reason, (reason, str(info.value))
    with pytest.raises(FedWaveError, match="out of range"):
        encode_router(mine, n_samples=0, round=0)
    # The metadata says what the sender's router is.
    data = encode_router(mine, n_samples=1, round=0)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = json.loads(header["__metadata__"]["peerlm.router"])
    assert meta == {"hidden_size": 6, "n_experts": 3, "width": 5}
