"""What travels in a FedProxy cohort: the owner's proxy and a member's update, as safetensors.

One payload format for both directions (``peerlm.v1.ProxyExchange``), never pickle:

* the proxy's weights under their state-dict names (every tensor cloned, so tied weights,
  GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``, are two entries);
* in the owner's proxy only, the conflict scores ``C_d`` (Eq. 7) of the merge that made it,
  one tensor per scored weight, under ``conflict/<name>`` (``/`` never occurs in a
  state-dict name); round 1 has none (Algorithm 1, line 3: ``C = 0``);
* in a member's update only, optionally ``peerlm.report`` (:class:`HarmReport`): the
  member's held-out loss, on its own validation texts, of the proxy it trained and of the
  one it held before, from which the owner judges whether its last merge harmed the member;
* header metadata: ``peerlm.format`` (:data:`PROXY_FORMAT` or :data:`UPDATE_FORMAT`),
  ``peerlm.round``, ``peerlm.proxy`` (the :class:`~peerlm.agent.fedproxy.proxy.ProxyInfo`: which
  blocks of which model) and, in the owner's proxy, ``peerlm.config`` (the proxy's
  configuration as JSON, so a member builds the model from it) and ``peerlm.conflict``, how
  the scores are encoded (:data:`CONFLICT_ENCODING_KEY`).

The conflict scores in one byte (format ``/2``). ``C_d = 1 − |Σ_k sign(τ_k[d])| / K`` takes
only ``K + 1`` values, so ``peerlm.conflict = "u8/K"`` carries each score as the uint8
``v = K − |Σ_k sign(τ_k[d])|`` (``C_d = v / K``), rebuilt by the one Eq. 7 formula
(:func:`~peerlm.agent.fedproxy.hties.conflict_scores`): bit for bit the owner's float32 scores, in a
quarter of the bytes. The encoder takes the smallest ``K ≤ 255`` that reproduces every score
exactly (any such ``K`` decodes to the same floats). Scores that no ``K ≤ 255`` reproduces (a
cohort of more than 255 members, or scores not of Eq. 7) fall back to float32
(``peerlm.conflict = "f32"``), refused outside [0, 1] as before. Format ``/1`` (float32
scores, no ``peerlm.conflict``) is still decoded, so an owner's checkpoint written before
``/2`` resumes.

Decoding is for untrusted bytes and refuses, as :class:`~peerlm.agent.fedproxy.proxy.ProxyError`
with a metric label as ``reason``, before any tensor is decoded where it can: ``too_large``,
``decode`` (not safetensors, bad header, bad metadata), ``format`` (the other kind), ``round``
(not the round asked for), ``report`` (a harm report that is not one), ``mismatch``
(another model type or block set), ``keys``, ``shape``, ``dtype`` (another tensor table
than expected, a score tensor not of the declared encoding), ``non_finite`` (NaN or inf
weights, conflict scores outside [0, 1], a byte above ``K``). The tensor table checks are
:mod:`peerlm.agent.adapter_codec`'s, shared with adapters.
"""

from __future__ import annotations

import json
import math
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
from peerlm.agent.fedproxy.hties import conflict_scores
from peerlm.agent.fedproxy.proxy import PROXY_CONFIG_KEY, ProxyError, ProxyInfo
from safetensors.torch import save as st_save

__all__ = [
    "CONFLICT_ENCODING_KEY",
    "CONFLICT_PREFIX",
    "MAX_CONFLICT_LEVELS",
    "PROXY_CONTENT_TYPE",
    "PROXY_FORMAT",
    "UPDATE_CONTENT_TYPE",
    "UPDATE_FORMAT",
    "HarmReport",
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

PROXY_FORMAT: Final = "peerlm-fedproxy-proxy/2"
#: The proxy format before the one-byte scores (float32 scores); still decoded.
_PROXY_FORMAT_V1: Final = "peerlm-fedproxy-proxy/1"
#: Metadata key of the score encoding: ``"u8/K"`` (one byte a score, ``K`` levels) or ``"f32"``.
CONFLICT_ENCODING_KEY: Final = "peerlm.conflict"
#: The largest ``K`` a uint8 score carries (``v`` in [0, K]).
MAX_CONFLICT_LEVELS: Final = 255
UPDATE_FORMAT: Final = "peerlm-fedproxy-update/1"
#: Media types of the two payloads; the sender appends ``; round=N``.
PROXY_CONTENT_TYPE: Final = "application/vnd.peerlm.fedproxy-proxy+safetensors"
UPDATE_CONTENT_TYPE: Final = "application/vnd.peerlm.fedproxy-update+safetensors"
CONFLICT_PREFIX: Final = "conflict/"
#: Metadata key of a member's :class:`HarmReport` in its update.
REPORT_KEY: Final = "peerlm.report"

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class HarmReport:
    """What a member measured of the proxies it pulled, on its own validation texts (mean
    token cross-entropy, nats): ``loss`` of the proxy of ``round`` (the one its update is
    trained from) and ``previous_loss`` of the one it pulled before, of ``previous_round``.
    Two numbers a round: the whole of what the member's gate tells the owner."""

    round: int
    loss: float
    previous_round: int
    previous_loss: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "round": self.round,
            "loss": self.loss,
            "previous_round": self.previous_round,
            "previous_loss": self.previous_loss,
        }

    @classmethod
    def from_dict(cls, raw: Any, *, round_: int) -> HarmReport:
        """Parse and check a report carried by an update of ``round_``: the same round, an
        earlier previous round, finite losses >= 0; else :class:`ProxyError` ``report``."""
        if not isinstance(raw, dict) or set(raw) != {
            "round",
            "loss",
            "previous_round",
            "previous_loss",
        }:
            raise ProxyError("harm report: not an object of the four fields", reason="report")
        rounds = (raw["round"], raw["previous_round"])
        losses = (raw["loss"], raw["previous_loss"])
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in rounds) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in losses
        ):
            raise ProxyError(
                "harm report: rounds must be integers, losses numbers", reason="report"
            )
        if rounds[0] != round_ or not 1 <= rounds[1] < rounds[0]:
            raise ProxyError(
                f"harm report of rounds {rounds[1]} -> {rounds[0]} in an update of round {round_}",
                reason="report",
            )
        if not all(math.isfinite(float(v)) and float(v) >= 0 for v in losses):
            raise ProxyError("harm report: losses must be finite and >= 0", reason="report")
        return cls(rounds[0], float(losses[0]), rounds[1], float(losses[1]))


@dataclass(frozen=True)
class ProxyPayload:
    """A decoded payload: the round, the proxy's weights, its blocks, (owner's proxy only)
    its configuration and the conflict scores of the merge that made it, and (a member's
    update only, optional) the member's :class:`HarmReport`."""

    round: int
    state: dict[str, torch.Tensor]
    info: ProxyInfo
    config: dict[str, Any] | None
    conflict: dict[str, torch.Tensor]
    report: HarmReport | None = None


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


def _levels_of(conflict: Mapping[str, torch.Tensor]) -> int | None:
    """The smallest ``K ≤ 255`` whose Eq. 7 levels reproduce every score exactly, or None."""
    if not conflict:
        return None
    values = torch.unique(
        torch.cat([c.detach().reshape(-1).float().cpu() for c in conflict.values()])
    )
    if bool(((values < 0) | (values > 1)).any()) or not bool(torch.isfinite(values).all()):
        return None
    for k in range(1, MAX_CONFLICT_LEVELS + 1):
        agreement = torch.round((1.0 - values.to(torch.float64)) * k)
        if torch.equal(conflict_scores(agreement, k), values):
            return k
    return None


def _score_bytes(score: torch.Tensor, k: int) -> torch.Tensor:
    """``v = K − |Σ sign|`` of each score, as uint8 (exact: ``k`` came from :func:`_levels_of`)."""
    agreement = torch.round((1.0 - score.detach().to("cpu", torch.float64)) * k)
    return (k - agreement).to(torch.uint8).contiguous()


def _scores_from_bytes(levels: torch.Tensor, k: int) -> torch.Tensor:
    return conflict_scores(k - levels.to(torch.float64), k)


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
    scores = dict(conflict or {})
    levels = _levels_of(scores)
    for key, score in scores.items():
        if key not in state:
            raise ProxyError(f"conflict score for {key}, not a proxy tensor", reason="keys")
        tensors[CONFLICT_PREFIX + key] = (
            _score_bytes(score, levels)
            if levels is not None
            else score.detach().to("cpu", torch.float32).contiguous()
        )
    meta = {
        "peerlm.format": PROXY_FORMAT,
        "peerlm.round": str(round_),
        "peerlm.proxy": json.dumps(info.to_dict(), sort_keys=True),
        "peerlm.config": json.dumps(dict(config), sort_keys=True),
        CONFLICT_ENCODING_KEY: "f32" if levels is None else f"u8/{levels}",
    }
    return st_save(tensors, metadata=meta)


def encode_update(
    state: StateDict, info: ProxyInfo, round_: int, report: HarmReport | None = None
) -> bytes:
    """A member's proxy trained in ``round_``, with its harm report if it has one."""
    meta = {
        "peerlm.format": UPDATE_FORMAT,
        "peerlm.round": str(round_),
        "peerlm.proxy": json.dumps(info.to_dict(), sort_keys=True),
    }
    if report is not None:
        meta[REPORT_KEY] = json.dumps(report.to_dict(), sort_keys=True)
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
    accepted = (PROXY_FORMAT, _PROXY_FORMAT_V1) if kind == "proxy" else (UPDATE_FORMAT,)
    if meta.get("peerlm.format") not in accepted:
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


def _conflict_encoding(head: ProxyHeader) -> int | None:
    """``K`` of a ``u8/K`` score encoding, None for float32 scores (``f32``, or format /1)."""
    meta = head.header.metadata
    raw = meta.get(CONFLICT_ENCODING_KEY)
    if meta.get("peerlm.format") == _PROXY_FORMAT_V1:
        if raw is not None:
            raise ProxyError(f"proxy format /1 with {CONFLICT_ENCODING_KEY}", reason="decode")
        return None
    if raw == "f32":
        return None
    head_, _, count = (raw or "").partition("/")
    if head_ != "u8" or not count.isdigit() or not 1 <= int(count) <= MAX_CONFLICT_LEVELS:
        raise ProxyError(
            f"proxy: {CONFLICT_ENCODING_KEY} {raw!r} is neither 'f32' nor 'u8/K' with "
            f"1 <= K <= {MAX_CONFLICT_LEVELS}",
            reason="decode",
        )
    return int(count)


def _check_score_dtype(name: str, entry: object, levels: int | None) -> None:
    """A score tensor's declared dtype is its encoding's (checked before any data is read)."""
    wanted = "F32" if levels is None else "U8"
    found = entry.get("dtype") if isinstance(entry, dict) else None
    if found != wanted:
        raise ProxyError(
            f"proxy tensor {name} is {found}, the score encoding needs {wanted}", reason="dtype"
        )


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
    levels = _conflict_encoding(head)
    table = dict(shapes)
    for name in scored:
        key = name[len(CONFLICT_PREFIX) :]
        if key not in shapes:
            raise ProxyError(f"conflict score for {key}, not a proxy tensor", reason="keys")
        table[name] = shapes[key]
        _check_score_dtype(name, head.header.tensors[name], levels)
    for name, entry in head.header.tensors.items():
        if name not in scored and isinstance(entry, dict) and entry.get("dtype") == "U8":
            raise ProxyError(f"proxy tensor {name} is U8, not a float", reason="dtype")
    dtypes = {**ADAPTER_DTYPES, "U8": 1} if levels is not None else ADAPTER_DTYPES
    check_tensor_table(head.header, table, dtypes=dtypes, what="proxy", error=ProxyError)
    tensors = load_finite_tensors(data, what="proxy", error=ProxyError)
    conflict = {n[len(CONFLICT_PREFIX) :]: tensors.pop(n) for n in scored}
    for key, score in conflict.items():
        if levels is not None:
            if score.dtype != torch.uint8 or bool((score > levels).any()):
                raise ProxyError(
                    f"conflict scores of {key}: a byte above K = {levels}", reason="non_finite"
                )
            conflict[key] = _scores_from_bytes(score, levels)
        elif score.dtype != torch.float32 or bool(((score < 0) | (score > 1)).any()):
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
    pulled as): the same blocks (``info``), names, shapes and dtypes; finite; its harm
    report, if any, well formed."""
    head = read_proxy_header(data, kind="update", max_bytes=max_bytes)
    _check_round("update", head.round, round_)
    report = None
    if REPORT_KEY in head.header.metadata:
        try:
            raw = json.loads(head.header.metadata[REPORT_KEY])
        except (ValueError, RecursionError) as err:
            raise ProxyError(f"harm report is not JSON: {err}", reason="report") from None
        report = HarmReport.from_dict(raw, round_=head.round)
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
    return ProxyPayload(head.round, tensors, head.info, None, {}, report)
