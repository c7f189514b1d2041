"""The adapter format, in one place: write, read and validate a peerlm LoRA adapter.

An adapter on the wire and on disk is one safetensors file (never pickle) holding the LoRA
weights only, with this ``__metadata__``:

* ``format = pt``, ``peerlm.format = peerlm-lora/1`` (:data:`ADAPTER_FORMAT`);
* ``peerlm.model_type`` and ``peerlm.tokenizer_hash``: the base model it was trained on;
* ``peerlm.lora``: the LoRA settings as JSON (``r`` and ``alpha`` give the scaling).

:class:`AdapterSpec` is what an adapter must be to fit one host: tensor names and shapes,
the base model, tokenizer and LoRA scaling. :func:`decode_adapter` checks an untrusted blob
against it in an order that touches the least data first: size, the JSON header (bounded),
the metadata, the tensor table (names, shapes, dtypes: before a byte of tensor data is
decoded), then the values (finite, and within a norm bound when one is given). Every
failure is an :class:`AdapterError` whose ``reason`` is a metric label.

:class:`EncodedAdapter` is an encoding with its SHA-256, made once per adapter version and
shared by every pull of that version (:meth:`peerlm.agent.modelhost.ModelHost.encoded_adapter`).

Size rule (:meth:`AdapterSpec.max_encoded_bytes`): the largest adapter a host with this spec
can produce is every tensor in float32 (the widest dtype an adapter may use) plus a header
of at most :data:`MAX_HEADER_BYTES`; that is the limit on what a peer may send us and on
what we send, unless the operator sets a smaller one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from peerlm.chunks import HashedPayload

__all__ = [
    "ADAPTER_DTYPES",
    "ADAPTER_FORMAT",
    "MAX_HEADER_BYTES",
    "AdapterError",
    "AdapterSpec",
    "EncodedAdapter",
    "IdentityCheck",
    "adapter_norm",
    "check_state",
    "decode_adapter",
    "encode_adapter",
    "read_metadata",
]

#: ``peerlm.format`` of every adapter peerlm writes.
ADAPTER_FORMAT: Final = "peerlm-lora/1"
#: Bound on the JSON header a reader parses (names of a few hundred tensors and metadata).
MAX_HEADER_BYTES: Final = 1024 * 1024
#: safetensors dtypes an adapter may use, with their sizes.
ADAPTER_DTYPES: Final = {"F32": 4, "F16": 2, "BF16": 2}

#: How a blob's base-model identity is checked: ``required`` (peers: the metadata must be
#: peerlm's and name this host), ``if_present`` (files: a plain safetensors adapter without
#: peerlm metadata loads by shape alone), ``ignored``.
IdentityCheck = Literal["required", "if_present", "ignored"]


class AdapterError(ValueError):
    """An adapter that does not fit: ``reason`` is a short label (``decode``, ``format``,
    ``model_type``, ``tokenizer``, ``keys``, ``shape``, ``dtype``, ``lora_config``,
    ``non_finite``, ``too_large``, ``norm``)."""

    def __init__(self, message: str, *, reason: str = "decode") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter must be to fit a host (see the module docstring)."""

    shapes: Mapping[str, tuple[int, ...]]
    model_type: str
    tokenizer_hash: str
    lora_r: int
    lora_alpha: float
    lora_json: str

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` an adapter of this spec carries."""
        return {
            "format": "pt",
            "peerlm.format": ADAPTER_FORMAT,
            "peerlm.model_type": self.model_type,
            "peerlm.tokenizer_hash": self.tokenizer_hash,
            "peerlm.lora": self.lora_json,
        }

    def max_encoded_bytes(self) -> int:
        """The largest adapter of this spec: all tensors float32, plus the header bound."""
        return 8 + MAX_HEADER_BYTES + sum(4 * math.prod(s) for s in self.shapes.values())


#: One adapter version, encoded once: the safetensors bytes and their SHA-256 (the peer
#: server streams and proves it as is).
EncodedAdapter = HashedPayload


def encode_adapter(state: Mapping[str, torch.Tensor], spec: AdapterSpec) -> bytes:
    """``state`` as safetensors bytes with ``spec``'s metadata."""
    return bytes(st_save(dict(state), metadata=spec.metadata()))


def _header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    if len(data) < 8:
        raise AdapterError("not a safetensors adapter: shorter than its header length")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > min(len(data) - 8, MAX_HEADER_BYTES):
        raise AdapterError("not a safetensors adapter: header length out of range")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, RecursionError) as err:
        raise AdapterError(f"not a safetensors adapter: header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise AdapterError("not a safetensors adapter: header is not an object")
    return header


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of an adapter blob, from its (bounded) JSON header alone."""
    meta = _header(data).get("__metadata__")
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _check_identity(meta: Mapping[str, str], spec: AdapterSpec, check: IdentityCheck) -> None:
    if check == "ignored" or (check == "if_present" and "peerlm.format" not in meta):
        return
    if meta.get("peerlm.format") != ADAPTER_FORMAT:
        raise AdapterError(f"not a {ADAPTER_FORMAT} adapter", reason="format")
    if meta.get("peerlm.model_type") != spec.model_type:
        raise AdapterError(
            f"adapter was trained on a {meta.get('peerlm.model_type')} model; "
            f"this host is {spec.model_type}",
            reason="model_type",
        )
    if meta.get("peerlm.tokenizer_hash") != spec.tokenizer_hash:
        raise AdapterError(
            "adapter was trained on a base model with another tokenizer than this host's",
            reason="tokenizer",
        )


def _check_lora(meta: Mapping[str, str], spec: AdapterSpec, check: IdentityCheck) -> None:
    if check == "ignored" or (check == "if_present" and "peerlm.format" not in meta):
        return
    try:
        lora = json.loads(meta.get("peerlm.lora", ""))
        r, alpha = int(lora["r"]), float(lora["alpha"])
    except (ValueError, KeyError, TypeError):
        raise AdapterError(
            "adapter metadata has no readable LoRA settings", reason="lora_config"
        ) from None
    if r != spec.lora_r or not math.isclose(alpha, spec.lora_alpha):
        raise AdapterError(
            f"adapter has LoRA r={r}, alpha={alpha}; this host r={spec.lora_r}, "
            f"alpha={spec.lora_alpha}",
            reason="lora_config",
        )


def _names_message(spec: AdapterSpec, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            parts.append(f"{label}: {', '.join(names[:3])}{more}")
    return (
        f"adapter does not fit this {spec.model_type} host with LoRA r={spec.lora_r} "
        f"({len(spec.shapes)} tensors expected); " + "; ".join(parts)
    )


def _check_names(spec: AdapterSpec, names: set[str]) -> None:
    missing = sorted(set(spec.shapes) - names)
    unexpected = sorted(names - set(spec.shapes))
    if missing or unexpected:
        raise AdapterError(_names_message(spec, missing, unexpected), reason="keys")


def _check_table(header: Mapping[str, Any], spec: AdapterSpec) -> None:
    """Names, shapes and dtypes from the tensor table, before any tensor data is read."""
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    _check_names(spec, set(table))
    for name in sorted(table):
        entry = table[name]
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or tuple(shape) != spec.shapes[name]:
            raise AdapterError(
                f"adapter tensor {name}: shape {shape} != {spec.shapes[name]}", reason="shape"
            )
        if dtype not in ADAPTER_DTYPES:
            raise AdapterError(
                f"adapter tensor {name} is {dtype}, not one of {sorted(ADAPTER_DTYPES)}",
                reason="dtype",
            )


def adapter_norm(state: Mapping[str, torch.Tensor]) -> float:
    """Euclidean norm over all tensors, in float64 (a 1e30 entry gives 1e30, not inf)."""
    total = 0.0
    for t in state.values():
        total += float(torch.sum(t.detach().to(torch.float64) ** 2))
    return math.sqrt(total)


def check_state(
    state: Mapping[str, torch.Tensor], spec: AdapterSpec, *, max_norm: float | None = None
) -> None:
    """Tensors that fit ``spec``: the names, shapes, floating point, finite; with
    ``max_norm`` also an overall Euclidean norm at most that. Raises :class:`AdapterError`."""
    _check_names(spec, set(state))
    for name in sorted(state):
        v = state[name]
        if tuple(v.shape) != spec.shapes[name]:
            raise AdapterError(
                f"adapter tensor {name}: shape {tuple(v.shape)} != {spec.shapes[name]}",
                reason="shape",
            )
        if not torch.is_floating_point(v):
            raise AdapterError(f"adapter tensor {name} is {v.dtype}", reason="dtype")
        if not bool(torch.isfinite(v).all()):
            raise AdapterError(f"adapter tensor {name} is not finite", reason="non_finite")
    if max_norm is not None:
        norm = adapter_norm(state)
        if not norm <= max_norm:
            raise AdapterError(
                f"adapter norm {norm:.3g} exceeds the bound {max_norm:.3g}", reason="norm"
            )


def decode_adapter(
    data: bytes | bytearray | memoryview,
    spec: AdapterSpec,
    *,
    identity: IdentityCheck = "required",
    max_bytes: int | None = None,
    max_norm: float | None = None,
) -> dict[str, torch.Tensor]:
    """Decode and validate an untrusted adapter blob against ``spec`` (see the module
    docstring for the order of the checks); raises :class:`AdapterError`."""
    limit = spec.max_encoded_bytes() if max_bytes is None else max_bytes
    if len(data) > limit:
        raise AdapterError(
            f"adapter of {len(data)} bytes exceeds the limit of {limit}", reason="too_large"
        )
    header = _header(data)
    raw_meta = header.get("__metadata__")
    meta = {str(k): str(v) for k, v in raw_meta.items()} if isinstance(raw_meta, dict) else {}
    _check_identity(meta, spec, identity)
    _check_table(header, spec)
    _check_lora(meta, spec, identity)
    try:
        # safetensors reads from a bytes object; a bytearray/memoryview is copied once here.
        state = st_load(data if isinstance(data, bytes) else bytes(data))
    except Exception as err:  # safetensors raises its own error type for corrupt input
        raise AdapterError(f"cannot decode adapter: {err}") from None
    check_state(state, spec, max_norm=max_norm)
    return state
