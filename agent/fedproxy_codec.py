"""What travels in a FedProxy cohort: the owner's proxy and a member's update, as safetensors.

One payload format for both directions (``peerlm.v1.ProxyExchange``), never pickle:

* the proxy's weights under their state-dict names (every tensor cloned, so tied weights,
  GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``, are two entries);
* in the owner's proxy only, the conflict scores ``C_d`` (Eq. 7) of the merge that made it,
  one float32 tensor per scored weight, under ``conflict/<name>`` (``/`` never occurs in a
  state-dict name); round 1 has none (Algorithm 1, line 3: ``C = 0``);
* header metadata: ``peerlm.format`` (:data:`PROXY_FORMAT` or :data:`UPDATE_FORMAT`),
  ``peerlm.round``, ``peerlm.proxy`` (the :class:`~peerlm.agent.proxy_model.ProxyInfo`: which
  blocks of which model) and, in the owner's proxy, ``peerlm.config`` (the proxy's
  configuration as JSON, so a member builds the model from it).

Decoding is for untrusted bytes and refuses, as :class:`~peerlm.agent.proxy_model.ProxyError`
with a metric label as ``reason``, before any tensor is decoded where it can: ``too_large``,
``decode`` (not safetensors, bad header, bad metadata), ``format`` (the other kind), ``round``
(not the round asked for), ``mismatch`` (another model type or block set), ``keys``,
``shape``, ``dtype`` (another tensor table than expected), ``non_finite`` (NaN or inf
weights, conflict scores outside [0, 1]). The tensor table checks are
:mod:`peerlm.agent.adapter_codec`'s, shared with adapters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from peerlm.agent.adapter_codec import (
    ADAPTER_DTYPES,
    check_tensor_table,
    load_finite_tensors,
    read_safetensors_header,
)
from peerlm.agent.proxy_model import PROXY_CONFIG_KEY, ProxyError, ProxyInfo
from safetensors.torch import save as st_save

__all__ = [
    "CONFLICT_PREFIX",
    "PROXY_CONTENT_TYPE",
    "PROXY_FORMAT",
    "UPDATE_CONTENT_TYPE",
    "UPDATE_FORMAT",
    "ProxyHeader",
    "ProxyPayload",
    "decode_proxy",
    "decode_update",
    "encode_proxy",
    "encode_update",
    "parse_round",
    "payload_content_type",
    "read_proxy_header",
]

PROXY_FORMAT: Final = "peerlm-fedproxy-proxy/1"
UPDATE_FORMAT: Final = "peerlm-fedproxy-update/1"
#: Media types of the two payloads; the sender appends ``; round=N``.
PROXY_CONTENT_TYPE: Final = "application/vnd.peerlm.fedproxy-proxy+safetensors"
UPDATE_CONTENT_TYPE: Final = "application/vnd.peerlm.fedproxy-update+safetensors"
CONFLICT_PREFIX: Final = "conflict/"

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ProxyPayload:
    """A decoded payload: the round, the proxy's weights, its blocks, and (owner's proxy
    only) its configuration and the conflict scores of the merge that made it."""

    round: int
    state: dict[str, torch.Tensor]
    info: ProxyInfo
    config: dict[str, Any] | None
    conflict: dict[str, torch.Tensor]


def payload_content_type(base: str, round_: int) -> str:
    """``base`` naming the round it carries."""
    return f"{base}; round={round_}"


def parse_round(content_type: str, base: str) -> int:
    """The round in a content type made by :func:`payload_content_type` with ``base``."""
    head, _, params = content_type.partition(";")
    if head.strip() != base:
        raise ProxyError(f"content type {content_type!r} is not {base}", reason="format")
    key, _, value = params.strip().partition("=")
    if key != "round" or not value.isdigit():
        raise ProxyError(f"content type {content_type!r} names no round", reason="format")
    return int(value)


def _tensors(state: StateDict) -> dict[str, torch.Tensor]:
    # Cloned and contiguous on the CPU: safetensors refuses shared (tied) storage.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def encode_proxy(
    state: StateDict,
    config: Mapping[str, Any],
    round_: int,
    conflict: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """The owner's proxy of ``round_``: weights, configuration (with ``peerlm_proxy``) and
    the conflict scores published with it (none in round 1)."""
    info = ProxyInfo.from_dict(config.get(PROXY_CONFIG_KEY))
    tensors = _tensors(state)
    for key, score in (conflict or {}).items():
        if key not in state:
            raise ProxyError(f"conflict score for {key}, not a proxy tensor", reason="keys")
        tensors[CONFLICT_PREFIX + key] = score.detach().to("cpu", torch.float32).contiguous()
    meta = {
        "peerlm.format": PROXY_FORMAT,
        "peerlm.round": str(round_),
        "peerlm.proxy": json.dumps(info.to_dict(), sort_keys=True),
        "peerlm.config": json.dumps(dict(config), sort_keys=True),
    }
    return st_save(tensors, metadata=meta)


def encode_update(state: StateDict, info: ProxyInfo, round_: int) -> bytes:
    """A member's proxy trained in ``round_``."""
    meta = {
        "peerlm.format": UPDATE_FORMAT,
        "peerlm.round": str(round_),
        "peerlm.proxy": json.dumps(info.to_dict(), sort_keys=True),
    }
    return st_save(_tensors(state), metadata=meta)


@dataclass(frozen=True)
class ProxyHeader:
    """What a payload's header says, checked: its round, blocks and configuration."""

    round: int
    info: ProxyInfo
    config: dict[str, Any] | None
    header: Any


def read_proxy_header(data: bytes, *, kind: str, max_bytes: int) -> ProxyHeader:
    """Parse and check the header of a ``kind`` payload (``proxy`` or ``update``) without
    touching its tensors."""
    what = f"fedproxy {kind}"
    header = read_safetensors_header(data, what=what, max_bytes=max_bytes, error=ProxyError)
    meta = header.metadata
    wanted = PROXY_FORMAT if kind == "proxy" else UPDATE_FORMAT
    if meta.get("peerlm.format") != wanted:
        raise ProxyError(
            f"{what}: format {meta.get('peerlm.format')!r}, expected {wanted}", reason="format"
        )
    raw_round = meta.get("peerlm.round", "")
    if not raw_round.isdigit() or int(raw_round) < 1:
        raise ProxyError(f"{what}: round {raw_round!r} is not a round", reason="decode")
    try:
        info = ProxyInfo.from_dict(json.loads(meta.get("peerlm.proxy", "null")))
        config = json.loads(meta["peerlm.config"]) if "peerlm.config" in meta else None
    except (ValueError, RecursionError) as err:
        raise ProxyError(f"{what}: metadata is not JSON: {err}", reason="decode") from None
    if kind == "proxy":
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise ProxyError(f"{what}: no configuration with a model_type", reason="decode")
        if ProxyInfo.from_dict(config.get(PROXY_CONFIG_KEY)) != info:
            raise ProxyError(f"{what}: configuration and blocks disagree", reason="mismatch")
    return ProxyHeader(int(raw_round), info, config, header)


def _check_round(what: str, got: int, round_: int | None) -> None:
    if round_ is not None and got != round_:
        raise ProxyError(f"{what} of round {got}, expected round {round_}", reason="round")


def decode_proxy(
    data: bytes,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    max_bytes: int,
    round_: int | None = None,
    expected_info: ProxyInfo | None = None,
) -> ProxyPayload:
    """An owner's proxy whose weights must have exactly ``shapes`` (the model its
    configuration builds: see :func:`read_proxy_header`), of ``round_`` (None: any) and, if
    given, of the blocks ``expected_info`` names; conflict scores finite and in [0, 1]."""
    head = read_proxy_header(data, kind="proxy", max_bytes=max_bytes)
    _check_round("proxy", head.round, round_)
    if expected_info is not None and head.info != expected_info:
        raise ProxyError(
            f"proxy of blocks {list(head.info.kept_blocks)} of a {head.info.source_model_type}, "
            f"expected {list(expected_info.kept_blocks)} of a {expected_info.source_model_type}",
            reason="mismatch",
        )
    scored = sorted(k for k in head.header.tensors if k.startswith(CONFLICT_PREFIX))
    table = dict(shapes)
    for name in scored:
        key = name[len(CONFLICT_PREFIX) :]
        if key not in shapes:
            raise ProxyError(f"conflict score for {key}, not a proxy tensor", reason="keys")
        table[name] = shapes[key]
    check_tensor_table(head.header, table, dtypes=ADAPTER_DTYPES, what="proxy", error=ProxyError)
    tensors = load_finite_tensors(data, what="proxy", error=ProxyError)
    conflict = {n[len(CONFLICT_PREFIX) :]: tensors.pop(n) for n in scored}
    for key, score in conflict.items():
        if score.dtype != torch.float32 or bool(((score < 0) | (score > 1)).any()):
            raise ProxyError(f"conflict scores of {key} outside [0, 1]", reason="non_finite")
    assert head.config is not None  # read_proxy_header requires it of a proxy
    return ProxyPayload(head.round, tensors, head.info, head.config, conflict)


def decode_update(
    data: bytes,
    expected: StateDict,
    info: ProxyInfo,
    *,
    max_bytes: int,
    round_: int,
) -> ProxyPayload:
    """A member's update of ``round_`` for the proxy ``expected`` (the global proxy it was
    pulled as): the same blocks (``info``), names, shapes and dtypes; finite."""
    head = read_proxy_header(data, kind="update", max_bytes=max_bytes)
    _check_round("update", head.round, round_)
    if head.info != info:
        raise ProxyError(
            f"update of blocks {list(head.info.kept_blocks)} of a {head.info.source_model_type} "
            f"({head.info.source_layers} blocks), expected {list(info.kept_blocks)} of a "
            f"{info.source_model_type} ({info.source_layers})",
            reason="mismatch",
        )
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    check_tensor_table(head.header, shapes, dtypes=ADAPTER_DTYPES, what="update", error=ProxyError)
    tensors = load_finite_tensors(data, what="update", error=ProxyError)
    for key, value in tensors.items():
        if value.dtype != expected[key].dtype:
            raise ProxyError(
                f"update {key} is {value.dtype}, the proxy's is {expected[key].dtype}",
                reason="dtype",
            )
    return ProxyPayload(head.round, tensors, head.info, None, {})
