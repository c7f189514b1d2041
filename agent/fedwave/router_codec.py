"""The router's blob format: what one workflow agent sends another for Eq. 9.

One safetensors file (never pickle) with the router's float32 tensors and this metadata:
``peerlm.format = peerlm-router/1``, ``peerlm.router`` (JSON: hidden size, number of
experts, router width), ``peerlm.n_samples`` (the sender's ``n_i``) and ``peerlm.round``.
:func:`decode_router` checks an untrusted blob in the order that touches the least data
first: size, header length, header JSON, format and metadata, the tensor table (names,
dtypes, shapes against this agent's router), then the values (finite). Every refusal is a
:class:`~peerlm.agent.fedwave.errors.FedWaveError` with a metric label. Who may send a
router (a workflow member, by certificate) is the transport's check, not this module's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Final

import torch
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.router import MoERouter
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = [
    "MAX_SAMPLES",
    "ROUTER_FORMAT",
    "DecodedRouter",
    "decode_router",
    "encode_router",
    "max_router_bytes",
    "router_shapes",
]

#: ``peerlm.format`` of a router blob.
ROUTER_FORMAT: Final = "peerlm-router/1"
_MAX_HEADER: Final = 16 * 1024
#: The largest sample count a peer may claim (bounds its weight in Eq. 9 to something sane).
MAX_SAMPLES: Final = 10**9


@dataclass(frozen=True)
class DecodedRouter:
    """A peer's router: its state dict, its ``n_i`` and the round it was trained in."""

    state: dict[str, torch.Tensor]
    n_samples: int
    round: int


def router_shapes(router: MoERouter) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of ``router`` (what a peer's router must match)."""
    return {name: tuple(t.shape) for name, t in router.state_dict().items()}


def encode_router(router: MoERouter, *, n_samples: int, round: int) -> bytes:
    """``router`` as safetensors bytes (float32) with its ``n_i`` and round."""
    if not 0 < n_samples <= MAX_SAMPLES or round < 0:
        raise FedWaveError(f"n_samples {n_samples} or round {round} out of range", reason="weights")
    fc1 = router.fc1.weight
    meta = {
        "format": "pt",
        "peerlm.format": ROUTER_FORMAT,
        "peerlm.router": json.dumps(
            {"hidden_size": fc1.shape[1], "n_experts": router.n_experts, "width": fc1.shape[0]},
            sort_keys=True,
        ),
        "peerlm.n_samples": str(n_samples),
        "peerlm.round": str(round),
    }
    state = {
        k: v.detach().to(torch.float32).contiguous().cpu() for k, v in router.state_dict().items()
    }
    return st_save(state, metadata=meta)


def max_router_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The largest blob a router of these shapes encodes to (float32 plus the header bound)."""
    return 8 + _MAX_HEADER + sum(4 * math.prod(s) for s in shapes.values())


def decode_router(data: bytes, *, shapes: dict[str, tuple[int, ...]]) -> DecodedRouter:
    """Check and decode a peer's router blob against this agent's router ``shapes``."""
    limit = max_router_bytes(shapes)
    if len(data) > limit:
        raise FedWaveError(f"router of {len(data)} bytes exceeds {limit}", reason="too_large")
    if len(data) < 8:
        raise FedWaveError("not a router blob (no header)", reason="decode")
    size = int.from_bytes(data[:8], "little")
    if size > _MAX_HEADER or 8 + size > len(data):
        raise FedWaveError("router header missing or too large", reason="decode")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise FedWaveError(f"unreadable router header: {exc}", reason="decode") from None
    if not isinstance(header, dict):
        raise FedWaveError("router header is not an object", reason="decode")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or meta.get("peerlm.format") != ROUTER_FORMAT:
        raise FedWaveError(f"not a {ROUTER_FORMAT} blob", reason="format")
    try:
        n_samples = int(meta["peerlm.n_samples"])
        round_ = int(meta["peerlm.round"])
    except (KeyError, ValueError, TypeError):
        raise FedWaveError("router metadata lacks n_samples or round", reason="format") from None
    if not 0 < n_samples <= MAX_SAMPLES or round_ < 0:
        raise FedWaveError(f"router claims n_i {n_samples}, round {round_}", reason="weights")
    if set(header) != set(shapes):
        raise FedWaveError(
            f"router tensors {sorted(header)}, expected {sorted(shapes)}", reason="keys"
        )
    for name, shape in shapes.items():
        entry = header[name]
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            raise FedWaveError(f"router tensor {name} is not float32", reason="dtype")
        if entry.get("shape") != list(shape):
            raise FedWaveError(
                f"router tensor {name} has shape {entry.get('shape')}, expected {list(shape)}",
                reason="shape",
            )
    try:
        state = st_load(data)
    except SafetensorError as exc:
        raise FedWaveError(f"undecodable router: {exc}", reason="decode") from None
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            raise FedWaveError(f"router tensor {name} is not finite", reason="non_finite")
    return DecodedRouter(state=dict(state), n_samples=n_samples, round=round_)
