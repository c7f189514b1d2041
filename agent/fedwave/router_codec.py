"""The router's blob format: what one workflow agent sends another for Eq. 9.

One safetensors file (never pickle) with the router's float32 tensors and this metadata:
``peerlm.format = peerlm-router/1``, ``peerlm.router`` (JSON: hidden size, number of
experts, router width), ``peerlm.n_samples`` (the sender's ``n_i``) and ``peerlm.round``.
:func:`decode_router` checks an untrusted blob in the order that touches the least data
first: size, header length, header JSON, format and metadata, the tensor table (names,
dtypes, shapes, offsets against this agent's router), then the values (finite): the
safetensors steps are the shared ones of :mod:`peerlm.agent.adapter_codec`. Every refusal is
a :class:`~peerlm.agent.fedwave.errors.FedWaveError` with a metric label. Who may send a
router (a workflow member, by certificate) is the transport's check, not this module's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Final

import torch
from peerlm.agent.adapter_codec import (
    check_tensor_table,
    load_finite_tensors,
    read_safetensors_header,
)
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.router import MoERouter
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
#: A router travels in float32 only (what :func:`encode_router` writes).
_DTYPES: Final = {"F32": 4}
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
    header = read_safetensors_header(
        data,
        what="router",
        max_bytes=max_router_bytes(shapes),
        max_header_bytes=_MAX_HEADER,
        error=FedWaveError,
    )
    meta = header.metadata
    if meta.get("peerlm.format") != ROUTER_FORMAT:
        raise FedWaveError(f"not a {ROUTER_FORMAT} blob", reason="format")
    try:
        n_samples = int(meta["peerlm.n_samples"])
        round_ = int(meta["peerlm.round"])
    except (KeyError, ValueError):
        raise FedWaveError("router metadata lacks n_samples or round", reason="format") from None
    if not 0 < n_samples <= MAX_SAMPLES or round_ < 0:
        raise FedWaveError(f"router claims n_i {n_samples}, round {round_}", reason="weights")
    check_tensor_table(header, shapes, dtypes=_DTYPES, what="router", error=FedWaveError)
    state = load_finite_tensors(data, what="router", error=FedWaveError)
    return DecodedRouter(state=state, n_samples=n_samples, round=round_)
