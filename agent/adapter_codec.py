"""The adapter format, in one place: write, read and validate a peerlm LoRA adapter.

An adapter on the wire and on disk is one safetensors file (never pickle) holding the LoRA
weights only, with this ``__metadata__``:

* ``format = pt``, ``peerlm.format = peerlm-lora/1`` (:data:`ADAPTER_FORMAT`);
* ``peerlm.model_type`` and ``peerlm.tokenizer_hash``: the base model it was trained on;
* ``peerlm.lora``: the LoRA settings as JSON (``r`` and ``alpha`` give the scaling).

:class:`AdapterSpec` is what an adapter must be to fit one host: tensor names and shapes,
the base model, tokenizer and LoRA scaling. :func:`decode_adapter` checks an untrusted blob
against it in an order that touches the least data first: size, the JSON header (bounded),
the metadata, the tensor table (names, shapes, dtypes, data offsets: before a byte of
tensor data is decoded), then the values (finite, and within a norm bound when one is
given), then each module's update (within its bound when bounds are given). Every failure
is an :class:`AdapterError` whose ``reason`` is a metric label.

Why the update is bounded and not only the factors: a module's update is
``ΔW = (alpha / r) B A``, and a bound on the factors' norm lets a sender split its budget
between ``A`` and ``B`` (both large, aligned), whose product then grows with the square of
the budget: measured, an adapter inside a 10x factor bound applied an update 57x an honest
teacher's. :func:`lora_update_norms` gives ``||ΔW||_F`` per module from the factors
(``||B A||_F^2 = trace((BᵀB)(A Aᵀ))``, two ``r x r`` matrices: no ``m x n`` product is
formed) and :func:`check_update_norms` refuses a module over its bound (``update_norm``).

The safetensors checks that do not depend on what the blob holds are public, one function a
step, and shared by every peerlm safetensors format (adapters here, FedWave's routers and
VCLayers in :mod:`peerlm.agent.fedwave`): :func:`read_safetensors_header` (size, bounded
header, metadata), :func:`check_tensor_table` (names, shapes, dtypes, offsets against the
expected shapes) and :func:`load_finite_tensors` (decode, finite values). Each takes the
caller's error class and a word for what is decoded, so that a refusal keeps the caller's
error type and says what was refused.

:class:`EncodedAdapter` is an encoding with its SHA-256, made once per adapter version and
shared by every pull of that version (:meth:`peerlm.agent.modelhost.ModelHost.encoded_adapter`).

Size rule (:meth:`AdapterSpec.max_encoded_bytes`): the largest adapter a host with this spec
can produce is every tensor in float32 (the widest dtype an adapter may use) plus a header
of at most :data:`MAX_HEADER_BYTES`; that is the limit on what a peer may send us and on
what we send, unless the operator sets a smaller one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

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
    "ErrorType",
    "IdentityCheck",
    "SafetensorsHeader",
    "adapter_norm",
    "check_state",
    "check_tensor_table",
    "check_tensors",
    "check_update_norms",
    "decode_adapter",
    "encode_adapter",
    "load_finite_tensors",
    "lora_update_norms",
    "read_metadata",
    "read_safetensors_header",
    "state_digest",
    "update_bounds",
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
    ``non_finite``, ``too_large``, ``norm``, ``update_norm``)."""

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


class ErrorType(Protocol):
    """An error class the shared safetensors checks raise: ``error(message, reason=label)``
    (:class:`AdapterError`, :class:`~peerlm.agent.fedwave.errors.FedWaveError`)."""

    def __call__(self, message: str, *, reason: str) -> Exception: ...


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, bounded JSON header of a safetensors blob.

    ``metadata`` is ``__metadata__`` (empty when absent), ``tensors`` the raw tensor table
    (name -> entry, unchecked: see :func:`check_tensor_table`) and ``data_bytes`` the length
    of the data section that follows the header.
    """

    metadata: dict[str, str]
    tensors: dict[str, Any]
    data_bytes: int


def read_safetensors_header(
    data: bytes | bytearray | memoryview,
    *,
    what: str = "adapter",
    max_bytes: int | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    error: ErrorType = AdapterError,
) -> SafetensorsHeader:
    """Parse the header of an untrusted safetensors blob without touching its tensor data.

    Refuses, as ``error(message, reason=...)`` with messages naming ``what``: a blob over
    ``max_bytes`` (``too_large``); one shorter than its 8-byte header length, a header
    length over ``max_header_bytes`` or past the end of the blob, a header that is not a
    JSON object, a ``__metadata__`` that is not a string-to-string map (all ``decode``).
    Shared by every peerlm safetensors format (adapters, FedWave routers and VCLayers) so
    that one piece of code bounds what a peer's blob may make us parse.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise error(
            f"{what} of {len(data)} bytes exceeds the limit of {max_bytes}", reason="too_large"
        )
    if len(data) < 8:
        raise error(f"not a safetensors {what}: shorter than its header length", reason="decode")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > max_header_bytes:
        raise error(
            f"not a safetensors {what}: header length {n} exceeds the bound of {max_header_bytes}",
            reason="decode",
        )
    if n > len(data) - 8:
        raise error(
            f"not a safetensors {what}: header length {n} runs past the end of {len(data)} bytes",
            reason="decode",
        )
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise error(
            f"not a safetensors {what}: header is not JSON: {err}", reason="decode"
        ) from None
    if not isinstance(header, dict):
        raise error(f"not a safetensors {what}: header is not an object", reason="decode")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise error(
            f"not a safetensors {what}: __metadata__ is not a string-to-string map",
            reason="decode",
        )
    return SafetensorsHeader(metadata=meta, tensors=header, data_bytes=len(data) - 8 - n)


def _check_keys(
    names: set[str], shapes: Mapping[str, tuple[int, ...]], what: str, error: ErrorType
) -> None:
    missing, unexpected = sorted(set(shapes) - names), sorted(names - set(shapes))
    if missing or unexpected:
        raise error(
            f"{what} does not fit ({len(shapes)} tensors expected); "
            + _names_message(missing, unexpected),
            reason="keys",
        )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_tensor_table(
    header: SafetensorsHeader,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtypes: Mapping[str, int] = ADAPTER_DTYPES,
    what: str = "adapter",
    error: ErrorType = AdapterError,
) -> None:
    """Check a blob's tensor table against the expected ``shapes`` before any data is read.

    In this order, raising ``error(message, reason=...)``: the names are exactly those of
    ``shapes`` (``keys``); for each tensor (sorted by name) its shape (``shape``), its dtype
    is a key of ``dtypes`` (safetensors dtype -> item size; ``dtype``), and its
    ``data_offsets`` span exactly ``item size x elements`` bytes; then the spans, in order,
    tile the data section from its first byte to its last with neither gap nor overlap
    (``decode``), which is what the safetensors reader itself demands, checked here so that
    a bad table costs no tensor decoding and gets a message that names the tensor.
    """
    table = header.tensors
    _check_keys(set(table), shapes, what, error)
    spans = sorted(
        (*_entry_span(name, table[name], shapes[name], dtypes, what, error), name)
        for name in sorted(table)
    )
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise error(
                f"{what} tensor {name}: data starts at byte {begin}, not {end} "
                f"({'overlap' if begin < end else 'gap'})",
                reason="decode",
            )
        end = stop
    if end != header.data_bytes:
        raise error(
            f"{what} tensors end at byte {end} of a {header.data_bytes}-byte data section",
            reason="decode",
        )


def _entry_span(
    name: str,
    entry: object,
    shape: tuple[int, ...],
    dtypes: Mapping[str, int],
    what: str,
    error: ErrorType,
) -> tuple[int, int]:
    """One table entry checked against its expected ``shape``: its ``data_offsets``."""
    if not isinstance(entry, dict):
        raise error(f"{what} tensor {name}: table entry is not an object", reason="decode")
    found, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if not (isinstance(found, list) and all(map(_is_count, found))) or tuple(found) != shape:
        raise error(f"{what} tensor {name}: shape {found} != {list(shape)}", reason="shape")
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise error(f"{what} tensor {name} is {dtype}, not one of {sorted(dtypes)}", reason="dtype")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise error(f"{what} tensor {name}: bad data_offsets {offsets}", reason="decode")
    begin, end = int(offsets[0]), int(offsets[1])
    size = dtypes[dtype] * math.prod(shape)
    if end - begin != size:
        raise error(
            f"{what} tensor {name}: data_offsets span {end - begin} bytes, "
            f"its {dtype} shape {list(shape)} needs {size}",
            reason="decode",
        )
    return begin, end


def load_finite_tensors(
    data: bytes | bytearray | memoryview,
    *,
    what: str = "adapter",
    error: ErrorType = AdapterError,
) -> dict[str, torch.Tensor]:
    """Decode a blob whose table :func:`check_tensor_table` passed, refusing non-finite values.

    safetensors' own failures become ``error(..., reason="decode")``; a tensor holding a NaN
    or an infinity ``error(..., reason="non_finite")``.
    """
    try:
        # safetensors reads from a bytes object; a bytearray/memoryview is copied once here.
        state = st_load(data if isinstance(data, bytes) else bytes(data))
    except Exception as err:  # safetensors raises its own error type for corrupt input
        raise error(f"cannot decode {what}: {err}", reason="decode") from None
    for name in sorted(state):
        if not bool(torch.isfinite(state[name]).all()):
            raise error(f"{what} tensor {name} is not finite", reason="non_finite")
    return state


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of an adapter blob, from its (bounded) JSON header alone."""
    return read_safetensors_header(data).metadata


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


def _names_message(missing: list[str], unexpected: list[str]) -> str:
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            parts.append(f"{label}: {', '.join(names[:3])}{more}")
    return "; ".join(parts)


def _check_names(spec: AdapterSpec, names: set[str]) -> None:
    missing = sorted(set(spec.shapes) - names)
    unexpected = sorted(names - set(spec.shapes))
    if missing or unexpected:
        raise AdapterError(
            f"adapter does not fit this {spec.model_type} host with LoRA r={spec.lora_r} "
            f"({len(spec.shapes)} tensors expected); " + _names_message(missing, unexpected),
            reason="keys",
        )


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over a tensor state's float32 values (names sorted, name and shape included):
    equal for two states exactly when they hold the same values in float32."""
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


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
    # The names first, for a message that says which host the adapter does not fit.
    _check_names(spec, set(state))
    check_tensors(state, spec.shapes)
    _check_norm(state, max_norm)


def check_tensors(
    state: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    what: str = "adapter",
    error: ErrorType = AdapterError,
) -> None:
    """Check decoded tensors against the expected ``shapes``: :func:`check_tensor_table`'s
    counterpart for a state dict already in memory (a peer's, after aggregation, ...).

    In this order, raising ``error(message, reason=...)``: the names are exactly those of
    ``shapes`` (``keys``); for each tensor (sorted by name) its shape (``shape``), floating
    point (``dtype``), every value finite (``non_finite``).
    """
    _check_keys(set(state), shapes, what, error)
    for name in sorted(state):
        v = state[name]
        if tuple(v.shape) != tuple(shapes[name]):
            raise error(
                f"{what} tensor {name}: shape {list(v.shape)} != {list(shapes[name])}",
                reason="shape",
            )
        if not torch.is_floating_point(v):
            raise error(f"{what} tensor {name} is {v.dtype}", reason="dtype")
        if not bool(torch.isfinite(v).all()):
            raise error(f"{what} tensor {name} is not finite", reason="non_finite")


_LORA_A: Final = ".lora_A.weight"
_LORA_B: Final = ".lora_B.weight"


def lora_update_norms(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, float]:
    """Per LoRA module, the Frobenius norm of its update ``scaling · B A``.

    Computed in float64 from the factors, ``||B A||_F^2 = trace((BᵀB)(A Aᵀ))`` with two
    ``r x r`` Gram matrices, so the cost is that of reading A and B, never an ``m x n``
    product. Modules are named by the tensor names less ``.lora_A.weight`` /
    ``.lora_B.weight``; a tensor without its pair has no update and is left out (the
    codec's name check refuses such an adapter before this is called).
    """
    out: dict[str, float] = {}
    for key in sorted(state):
        if not key.endswith(_LORA_A):
            continue
        module = key[: -len(_LORA_A)]
        b = state.get(module + _LORA_B)
        if b is None:
            continue
        a64 = state[key].detach().to(device="cpu", dtype=torch.float64)
        b64 = b.detach().to(device="cpu", dtype=torch.float64)
        square = float(torch.sum((b64.T @ b64) * (a64 @ a64.T)))  # trace(XY), X, Y symmetric
        out[module] = abs(scaling) * math.sqrt(max(square, 0.0))
    return out


def update_bounds(
    own: Mapping[str, torch.Tensor], scaling: float, ratio: float
) -> dict[str, float]:
    """Per-module bounds on a peer's update, relative to our own adapter ``own``.

    A module's bound is ``ratio`` times the larger of our update of that module and the
    root mean square of our updates over all modules (a module we barely moved is still
    judged at the scale of our training elsewhere), and at least ``scaling · ||A||_F^2``
    of our own ``A`` there: the update our ``A`` would make with a ``B`` as large as
    itself, so that a student whose ``B`` is still zero (nothing trained yet) keeps a
    bound of the size of an early honest update rather than refusing everything.
    """
    norms = lora_update_norms(own, scaling)
    rms = math.sqrt(sum(n * n for n in norms.values()) / len(norms)) if norms else 0.0
    bounds: dict[str, float] = {}
    for module, norm in norms.items():
        a = own[module + _LORA_A].detach().to(device="cpu", dtype=torch.float64)
        floor = abs(scaling) * float(torch.sum(a * a))
        bounds[module] = max(ratio * max(norm, rms), floor)
    return bounds


def check_update_norms(
    state: Mapping[str, torch.Tensor], bounds: Mapping[str, float], scaling: float
) -> dict[str, float]:
    """Refuse an adapter any of whose modules' update ``scaling · B A`` has a Frobenius norm
    over ``bounds[module]`` (``AdapterError``, reason ``update_norm``, naming the first such
    module in name order); a module without a bound is not checked. Returns the norms."""
    norms = lora_update_norms(state, scaling)
    for module, norm in norms.items():
        bound = bounds.get(module)
        if bound is not None and not norm <= bound:
            raise AdapterError(
                f"adapter update of {module} has norm {norm:.3g}, over its bound {bound:.3g}",
                reason="update_norm",
            )
    return norms


def _check_norm(state: Mapping[str, torch.Tensor], max_norm: float | None) -> None:
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
    max_update_norms: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode and validate an untrusted adapter blob against ``spec`` (see the module
    docstring for the order of the checks); raises :class:`AdapterError`.

    ``max_update_norms`` bounds, per module, the Frobenius norm of the update
    ``(alpha / r) B A`` under ``spec``'s scaling (:func:`check_update_norms`)."""
    limit = spec.max_encoded_bytes() if max_bytes is None else max_bytes
    header = read_safetensors_header(data, max_bytes=limit)
    _check_identity(header.metadata, spec, identity)
    # The names first, for a message that says which host the adapter does not fit.
    _check_names(spec, set(header.tensors))
    check_tensor_table(header, spec.shapes)
    _check_lora(header.metadata, spec, identity)
    # The table fixed the names, shapes and (floating point) dtypes; the values are finite.
    state = load_finite_tensors(data)
    _check_norm(state, max_norm)
    if max_update_norms is not None:
        check_update_norms(state, max_update_norms, spec.lora_alpha / spec.lora_r)
    return state
