"""AKD knowledge packages: what a teacher sends a student, as one safetensors file.

A package holds the teacher's predictions on the public, pinned transfer set X_u
(KNEXA-FL "Agent-Side Operations"). Two modes:

* **text** (the paper's choice, and the default): for each prompt of X_u its id, the SHA-256
  of the prompt and the teacher's decoded completion. The student re-tokenises the text
  with its own tokenizer, so any architecture can learn from any other.
* **logits**: for each prompt, at each of the L positions of the teacher's completion,
  k token ids (``int32 [L, k]``) and their log-probabilities (``float16`` or ``float32
  [L, k]``): column 0 is the token the teacher's completion has at that position, columns
  1..k-1 the most probable other tokens. Plus the temperature they were taken at, the
  teacher tokenizer's hash and vocabulary size. Only a student with the same tokenizer can
  use them; it rebuilds the completion from column 0.

Format (``format=peerlm.akd``, ``version=1``): one safetensors file, never pickle.

* ``__metadata__`` (safetensors' string-to-string map) holds the small header fields:
  ``mode``, ``teacher``, ``directive_id``, ``transfer_sha256``, ``model_family``,
  ``created_at``, ``items`` (count) and, for logits, ``temperature``, ``tokenizer_sha256``,
  ``vocab_size``, ``top_k``.
* ``items``: a ``uint8`` tensor holding UTF-8 JSON, a list of
  ``{"prompt_id", "prompt_sha256"[, "text"]}`` objects.
* logits mode adds ``offsets`` (``int64 [n+1]``: item i owns rows offsets[i]:offsets[i+1]),
  ``token_ids`` (``int32 [P, k]``) and ``logprobs`` (``[P, k]``).

Why the texts live in a tensor and not in ``__metadata__``: the metadata map is part of the
safetensors header, which readers parse in full before anything can be checked (the
reference implementation accepts headers up to 100 MB), and a package of X_u completions
runs to megabytes. As a tensor, its size is read from the header and checked against
``max_text_bytes`` before a byte of it is parsed; the header itself is capped at 64 KiB.

Decoding is strict: every field is type-, size- and range-checked, log-probabilities must be
finite and <= 0, and any violation raises :class:`PackageError` with a readable message.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypedDict

import numpy as np
import numpy.typing as npt
import safetensors.numpy

from peerlm.pki.identity import validate_name

if TYPE_CHECKING:
    from peerlm.agent.vetting.guardrail import Guardrail

__all__ = [
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MAX_ITEM_TEXT_BYTES",
    "DEFAULT_MAX_POSITIONS",
    "DEFAULT_MAX_TEXT_BYTES",
    "FORMAT",
    "FORMAT_VERSION",
    "ITEM_OVERHEAD_BYTES",
    "MAX_TOP_K",
    "PACKAGE_CONTENT_TYPE",
    "KnowledgePackage",
    "LogitsItem",
    "LogitsPackage",
    "PackageError",
    "PackageLimits",
    "TextItem",
    "TextPackage",
    "build_logits_package",
    "build_text_package",
    "decode_package",
    "encode_package",
    "item_prompts",
    "package_size_kb",
    "prompt_sha256",
    "student_limits",
    "text_pairs",
]

#: Media type of an encoded package on the wire (first Chunk's ``content_type``).
PACKAGE_CONTENT_TYPE: Final = "application/vnd.peerlm.akd+safetensors"
FORMAT: Final = "peerlm.akd"
FORMAT_VERSION: Final = "1"

MiB: Final = 1024 * 1024
#: Default bounds for decode_package (principle 4); X_u has hundreds of prompts, not 100k.
DEFAULT_MAX_ITEMS: Final = 100_000
DEFAULT_MAX_TEXT_BYTES: Final = 64 * MiB
DEFAULT_MAX_POSITIONS: Final = 4_000_000
#: One completion's UTF-8 bytes: a completion of ``max_new_tokens`` (at most 4096) tokens of
#: code is a few KiB; 64 KiB leaves room for verbose teachers and bounds what a student
#: holds and tokenises per item whatever the package carries.
DEFAULT_MAX_ITEM_TEXT_BYTES: Final = 64 * 1024
#: JSON framing of one item besides its text: ids, hashes, keys, escapes of a short prompt id.
ITEM_OVERHEAD_BYTES: Final = 1024
MAX_TOP_K: Final = 1024
#: Our header holds a handful of short strings and at most four tensor entries.
_MAX_HEADER_BYTES: Final = 64 * 1024
_MAX_PROMPT_ID: Final = 256
_MAX_FAMILY: Final = 64
# Log-probs are <= 0 in exact arithmetic; float16 rounding of log(1) may land a hair above.
_LOGPROB_SLACK: Final = 1e-3

_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_DIRECTIVE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PROMPT_ID: Final = re.compile(rf"[^\x00-\x1f\x7f]{{1,{_MAX_PROMPT_ID}}}")

Mode = Literal["text", "logits"]


class PackageError(ValueError):
    """A knowledge package is malformed, oversized, inconsistent or not the one expected;
    ``reason`` is a metric label (``invalid``, ``item_too_large``)."""

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TextItem:
    """The teacher's decoded completion for one prompt of X_u."""

    prompt_id: str
    prompt_sha256: str
    text: str


@dataclass(frozen=True, eq=False)
class LogitsItem:
    """The teacher's top-k distribution at each of L positions for one prompt of X_u."""

    prompt_id: str
    prompt_sha256: str
    token_ids: npt.NDArray[np.int32]  # [L, k]
    logprobs: npt.NDArray[np.floating[Any]]  # [L, k], float16 or float32


@dataclass(frozen=True)
class TextPackage:
    """A text-mode AKD package (see the module docstring)."""

    teacher: str
    directive_id: str
    transfer_sha256: str
    model_family: str
    items: tuple[TextItem, ...]
    created_at: float = field(default_factory=time.time)

    @property
    def mode(self) -> Literal["text"]:
        return "text"


@dataclass(frozen=True, eq=False)
class LogitsPackage:
    """A logits-mode AKD package (see the module docstring)."""

    teacher: str
    directive_id: str
    transfer_sha256: str
    model_family: str
    items: tuple[LogitsItem, ...]
    temperature: float
    tokenizer_sha256: str
    vocab_size: int
    created_at: float = field(default_factory=time.time)

    @property
    def mode(self) -> Literal["logits"]:
        return "logits"

    @property
    def top_k(self) -> int:
        """k of the top-k arrays (0 for a package without items)."""
        return int(self.items[0].token_ids.shape[1]) if self.items else 0


KnowledgePackage = TextPackage | LogitsPackage


def prompt_sha256(prompt: str) -> str:
    """Lower-case hex SHA-256 of a prompt's UTF-8 bytes; how packages name prompts."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def package_size_kb(data: bytes | int) -> float:
    """Size of an encoded package in KB for Eq. 3's ``delta * KB`` term (1 KB = 1024 bytes,
    as the CPM's synthetic federation and the reward reported to the CPM use)."""
    size = data if isinstance(data, int) else len(data)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return size / 1024.0


# -- building ---------------------------------------------------------------------------------


def build_text_package(
    *,
    prompts: Sequence[str],
    completions: Sequence[str],
    teacher: str,
    directive_id: str,
    transfer_sha256: str,
    family: str,
    guardrail: Guardrail,
    prompt_ids: Sequence[str] | None = None,
    created_at: float | None = None,
) -> bytes:
    """Encode a text package of ``completions`` to ``prompts``, every text guardrailed first.

    ``prompt_ids`` default to each prompt's position in X_u (``"0"``, ``"1"``, ...).
    """
    if len(prompts) != len(completions):
        raise PackageError(f"{len(prompts)} prompts but {len(completions)} completions")
    ids = [str(i) for i in range(len(prompts))] if prompt_ids is None else list(prompt_ids)
    if len(ids) != len(prompts):
        raise PackageError(f"{len(ids)} prompt ids for {len(prompts)} prompts")
    # The prompts are public (X_u): what an answer repeats from its prompt is no leak.
    vetted = guardrail.filter_many(completions, prompts)
    items = tuple(
        TextItem(pid, prompt_sha256(prompt), result.text)
        for pid, prompt, result in zip(ids, prompts, vetted, strict=True)
    )
    return encode_package(
        TextPackage(
            teacher=teacher,
            directive_id=directive_id,
            transfer_sha256=transfer_sha256,
            model_family=family,
            items=items,
            created_at=time.time() if created_at is None else created_at,
        )
    )


def build_logits_package(
    *,
    prompts: Sequence[str],
    token_ids: Sequence[npt.NDArray[np.integer[Any]]],
    logprobs: Sequence[npt.NDArray[np.floating[Any]]],
    teacher: str,
    directive_id: str,
    transfer_sha256: str,
    family: str,
    temperature: float,
    tokenizer_sha256: str,
    vocab_size: int,
    guardrail: Guardrail,
    detokenize: Callable[[Sequence[int]], str],
    prompt_ids: Sequence[str] | None = None,
    created_at: float | None = None,
) -> tuple[bytes, list[str]]:
    """Encode a logits package; returns the bytes and the ids of withheld prompts.

    Token ids are numbers the guardrail cannot read, so each item is vetted through its
    text: ``detokenize`` (the teacher's tokenizer) turns column 0 (the completion's own
    tokens) back into text, and an item whose text the guardrail would change in any way is
    withheld whole (cutting rows out of a distribution would leave it inconsistent). The
    other columns are the likeliest alternatives at each position; single tokens, they are
    not vetted.
    """
    n = len(prompts)
    if len(token_ids) != n or len(logprobs) != n:
        raise PackageError(f"{n} prompts but {len(token_ids)} id and {len(logprobs)} arrays")
    ids = [str(i) for i in range(n)] if prompt_ids is None else list(prompt_ids)
    if len(ids) != n:
        raise PackageError(f"{len(ids)} prompt ids for {n} prompts")
    greedy = [
        detokenize([int(t) for t in np.asarray(ids_, dtype=np.int64)[:, 0]])
        if np.asarray(ids_).ndim == 2 and np.asarray(ids_).shape[1] > 0
        else ""
        for ids_ in token_ids
    ]
    vetted = guardrail.filter_many(greedy, prompts)
    items: list[LogitsItem] = []
    withheld: list[str] = []
    for pid, prompt, ids_, lps, result in zip(
        ids, prompts, token_ids, logprobs, vetted, strict=True
    ):
        if result.removals:
            withheld.append(pid)
            continue
        items.append(
            LogitsItem(
                pid,
                prompt_sha256(prompt),
                np.ascontiguousarray(ids_, dtype=np.int32),
                np.ascontiguousarray(lps),
            )
        )
    package = LogitsPackage(
        teacher=teacher,
        directive_id=directive_id,
        transfer_sha256=transfer_sha256,
        model_family=family,
        items=tuple(items),
        temperature=temperature,
        tokenizer_sha256=tokenizer_sha256,
        vocab_size=vocab_size,
        created_at=time.time() if created_at is None else created_at,
    )
    return encode_package(package), withheld


def item_prompts(package: KnowledgePackage, prompts: Sequence[str]) -> list[str | None]:
    """Per item of ``package``, the prompt of ``prompts`` it answers (matched by hash: a
    package carries hashes, not prompts), or None for one it does not know."""
    by_hash = {prompt_sha256(p): p for p in prompts}
    return [by_hash.get(item.prompt_sha256) for item in package.items]


def text_pairs(package: TextPackage, prompts: Sequence[str]) -> list[tuple[str, str]]:
    """(prompt, completion) pairs, each prompt taken from the student's own copy of X_u.

    A package carries prompt hashes, not prompts: the student knows X_u. An item whose hash
    is not one of ``prompts`` raises :class:`PackageError` (the teacher answered something
    that is not our transfer set).
    """
    pairs: list[tuple[str, str]] = []
    for item, prompt in zip(package.items, item_prompts(package, prompts), strict=True):
        if prompt is None:
            raise PackageError(
                f"item {item.prompt_id!r} answers a prompt (sha256 {item.prompt_sha256[:12]}…) "
                "that is not in our transfer set"
            )
        pairs.append((prompt, item.text))
    return pairs


# -- encoding ---------------------------------------------------------------------------------


def encode_package(package: KnowledgePackage) -> bytes:
    """The package as one safetensors file. Validates first: we never send what we'd refuse."""
    _check_header_fields(
        package.teacher,
        package.directive_id,
        package.transfer_sha256,
        package.model_family,
        package.created_at,
    )
    _check_item_ids([(i.prompt_id, i.prompt_sha256) for i in package.items])
    metadata = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "mode": package.mode,
        "teacher": package.teacher,
        "directive_id": package.directive_id,
        "transfer_sha256": package.transfer_sha256,
        "model_family": package.model_family,
        "created_at": repr(float(package.created_at)),
        "items": str(len(package.items)),
    }
    if isinstance(package, TextPackage):
        tensors = _text_tensors(package)
    else:
        tensors = _logits_tensors(package)
        metadata |= {
            "temperature": repr(float(package.temperature)),
            "tokenizer_sha256": package.tokenizer_sha256,
            "vocab_size": str(package.vocab_size),
            "top_k": str(package.top_k),
        }
    return bytes(safetensors.numpy.save(tensors, metadata=metadata))


def _text_tensors(package: TextPackage) -> dict[str, npt.NDArray[Any]]:
    entries: list[dict[str, str]] = []
    for item in package.items:
        if not isinstance(item.text, str):
            raise PackageError(f"item {item.prompt_id!r}: text is not a string")
        entries.append(
            {"prompt_id": item.prompt_id, "prompt_sha256": item.prompt_sha256, "text": item.text}
        )
    return {"items": _json_tensor(entries)}


def _logits_tensors(package: LogitsPackage) -> dict[str, npt.NDArray[Any]]:
    _check_logits_header(package.temperature, package.tokenizer_sha256, package.vocab_size)
    k, items = package.top_k, package.items
    dtypes = {item.logprobs.dtype for item in items}
    if len(dtypes) > 1:
        raise PackageError(f"items mix log-prob dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else np.dtype(np.float16)
    if dtype not in (np.float16, np.float32):
        raise PackageError(f"log-probs must be float16 or float32, not {dtype}")
    rows = [0]
    for item in items:
        _check_item_arrays(item.prompt_id, item.token_ids, item.logprobs, k)
        rows.append(rows[-1] + int(item.token_ids.shape[0]))
    if items:
        ids = np.concatenate([item.token_ids for item in items]).astype(np.int32)
        lps = np.concatenate([item.logprobs for item in items]).astype(dtype)
    else:
        ids, lps = np.zeros((0, k), dtype=np.int32), np.zeros((0, k), dtype=dtype)
    _check_logits_values(ids, lps, package.vocab_size)
    return {
        "items": _json_tensor(
            [{"prompt_id": i.prompt_id, "prompt_sha256": i.prompt_sha256} for i in items]
        ),
        "offsets": np.asarray(rows, dtype=np.int64),
        "token_ids": np.ascontiguousarray(ids),
        "logprobs": np.ascontiguousarray(lps),
    }


def _json_tensor(entries: list[dict[str, str]]) -> npt.NDArray[np.uint8]:
    try:
        raw = json.dumps(entries, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as err:
        raise PackageError(f"a text is not valid Unicode (lone surrogate?): {err}") from None
    return np.frombuffer(raw, dtype=np.uint8).copy()


# -- decoding ---------------------------------------------------------------------------------

_DTYPE_SIZES: Final = {"U8": 1, "I32": 4, "I64": 8, "F16": 2, "F32": 4}
_EXPECTED_TENSORS: Final[dict[str, dict[str, frozenset[str]]]] = {
    "text": {"items": frozenset({"U8"})},
    "logits": {
        "items": frozenset({"U8"}),
        "offsets": frozenset({"I64"}),
        "token_ids": frozenset({"I32"}),
        "logprobs": frozenset({"F16", "F32"}),
    },
}
_BASE_KEYS: Final = frozenset(
    {
        "format",
        "version",
        "mode",
        "teacher",
        "directive_id",
        "transfer_sha256",
        "model_family",
        "created_at",
        "items",
    }
)
_LOGITS_KEYS: Final = frozenset({"temperature", "tokenizer_sha256", "vocab_size", "top_k"})


def decode_package(
    data: bytes,
    *,
    max_items: int = DEFAULT_MAX_ITEMS,
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    max_item_text_bytes: int = DEFAULT_MAX_ITEM_TEXT_BYTES,
    expect_transfer_sha256: str | None = None,
    expect_directive_id: str | None = None,
    expect_teacher: str | None = None,
    expect_prompts: Mapping[str, str] | None = None,
) -> KnowledgePackage:
    """Parse and validate an encoded package; raises :class:`PackageError` on any flaw.

    Bounds: at most ``max_items`` items, ``max_text_bytes`` bytes of item JSON (texts
    included), ``max_item_text_bytes`` UTF-8 bytes per completion (reason
    ``item_too_large``: one huge completion inside the package limit would otherwise cost
    the student gigabytes to tokenise) and, in logits mode, ``max_positions`` rows of top-k
    arrays; :func:`student_limits` derives them from the transfer set's size. The
    ``expect_*`` arguments pin what the student asked for: the transfer-set hash of its
    X_u, the directive and the teacher it holds, and ``expect_prompts`` (prompt id ->
    prompt SHA-256 of its X_u): every item must answer one of those prompts under the same hash.
    """
    header, metadata = _read_header(bytes(data))
    mode = metadata["mode"]
    expected = _EXPECTED_TENSORS[mode]
    if set(header) != set(expected):
        raise PackageError(
            f"{mode} package must hold tensors {sorted(expected)}, found {sorted(header)}"
        )
    for name, info in header.items():
        _check_tensor_entry(name, info, expected[name])
    n_items = _parse_int(metadata, "items", 0, max_items)
    items_shape = header["items"]["shape"]
    if len(items_shape) != 1:
        raise PackageError("tensor 'items' must be one-dimensional")
    if items_shape[0] > max_text_bytes:
        raise PackageError(
            f"item JSON of {items_shape[0]} bytes exceeds max_text_bytes ({max_text_bytes})"
        )
    created_at = _parse_float(metadata, "created_at")
    _check_header_fields(
        metadata["teacher"],
        metadata["directive_id"],
        metadata["transfer_sha256"],
        metadata["model_family"],
        created_at,
    )
    if mode == "logits":
        _check_logits_shapes(header, metadata, n_items, max_positions)
    try:
        tensors = safetensors.numpy.load(bytes(data))
    except Exception as err:  # the Rust reader's own checks: offsets, overlaps, sizes
        raise PackageError(f"not a valid safetensors file: {err}") from None

    entries = _parse_items(
        tensors["items"], n_items, with_text=mode == "text", max_text=max_item_text_bytes
    )
    _check_item_ids([(e["prompt_id"], e["prompt_sha256"]) for e in entries])
    _check_expectations(
        metadata,
        entries,
        expect_transfer_sha256=expect_transfer_sha256,
        expect_directive_id=expect_directive_id,
        expect_teacher=expect_teacher,
        expect_prompts=expect_prompts,
    )
    if mode == "text":
        return TextPackage(
            teacher=metadata["teacher"],
            directive_id=metadata["directive_id"],
            transfer_sha256=metadata["transfer_sha256"],
            model_family=metadata["model_family"],
            items=tuple(TextItem(e["prompt_id"], e["prompt_sha256"], e["text"]) for e in entries),
            created_at=created_at,
        )
    vocab_size = _parse_int(metadata, "vocab_size", 1, 2**31 - 1)
    offsets, ids, lps = tensors["offsets"], tensors["token_ids"], tensors["logprobs"]
    if offsets[0] != 0 or offsets[-1] != ids.shape[0] or bool(np.any(np.diff(offsets) < 0)):
        raise PackageError("offsets must rise from 0 to the number of top-k rows")
    _check_logits_values(ids, lps, vocab_size)
    return LogitsPackage(
        teacher=metadata["teacher"],
        directive_id=metadata["directive_id"],
        transfer_sha256=metadata["transfer_sha256"],
        model_family=metadata["model_family"],
        items=tuple(
            LogitsItem(
                e["prompt_id"],
                e["prompt_sha256"],
                ids[int(offsets[i]) : int(offsets[i + 1])],
                lps[int(offsets[i]) : int(offsets[i + 1])],
            )
            for i, e in enumerate(entries)
        ),
        temperature=_parse_float(metadata, "temperature"),
        tokenizer_sha256=metadata["tokenizer_sha256"],
        vocab_size=vocab_size,
        created_at=created_at,
    )


def _check_logits_shapes(
    header: Mapping[str, Mapping[str, Any]],
    metadata: Mapping[str, str],
    n_items: int,
    max_positions: int,
) -> None:
    # k is read from the items, so a package whose items were all withheld has k = 0.
    k = _parse_int(metadata, "top_k", 1 if n_items else 0, MAX_TOP_K)
    vocab_size = _parse_int(metadata, "vocab_size", 1, 2**31 - 1)
    _check_logits_header(
        _parse_float(metadata, "temperature"), metadata["tokenizer_sha256"], vocab_size
    )
    positions = header["token_ids"]["shape"]
    if len(positions) != 2 or positions[1] != k:
        raise PackageError(f"token_ids must have shape [P, {k}], not {positions}")
    if header["logprobs"]["shape"] != positions:
        raise PackageError("token_ids and logprobs shapes differ")
    if positions[0] > max_positions:
        raise PackageError(f"{positions[0]} top-k rows exceed max_positions ({max_positions})")
    if header["offsets"]["shape"] != [n_items + 1]:
        raise PackageError(f"offsets must have shape [{n_items + 1}]")


def _read_header(data: bytes) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The tensor entries and the metadata, checked before safetensors reads anything."""
    if len(data) < 8:
        raise PackageError(f"{len(data)} bytes is too short for a safetensors file")
    size = int.from_bytes(data[:8], "little")
    if size > _MAX_HEADER_BYTES:
        raise PackageError(f"header of {size} bytes exceeds {_MAX_HEADER_BYTES}")
    if 8 + size > len(data):
        raise PackageError(f"header of {size} bytes runs past the end of {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise PackageError(f"header is not UTF-8 JSON: {err}") from None
    if not isinstance(header, dict):
        raise PackageError("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise PackageError("header lacks a string-to-string __metadata__ map")
    if metadata.get("format") != FORMAT:
        raise PackageError(f"not a knowledge package (format {metadata.get('format')!r})")
    if metadata.get("version") != FORMAT_VERSION:
        raise PackageError(
            f"package format version {metadata.get('version')!r} is not supported "
            f"(this agent reads version {FORMAT_VERSION})"
        )
    mode = metadata.get("mode")
    if mode not in _EXPECTED_TENSORS:
        raise PackageError(f"unknown package mode {mode!r}; expected 'text' or 'logits'")
    wanted = _BASE_KEYS | (_LOGITS_KEYS if mode == "logits" else frozenset())
    if set(metadata) != wanted:
        missing, extra = sorted(wanted - set(metadata)), sorted(set(metadata) - wanted)
        raise PackageError(f"metadata keys wrong: missing {missing}, unexpected {extra}")
    return header, metadata


def _check_tensor_entry(name: str, info: Any, dtypes: frozenset[str]) -> None:
    if not isinstance(info, dict):
        raise PackageError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in dtypes:
        raise PackageError(f"tensor {name!r} has dtype {dtype!r}, expected {sorted(dtypes)}")
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise PackageError(f"tensor {name!r} has a bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise PackageError(f"tensor {name!r} has bad data offsets")
    size = _DTYPE_SIZES[dtype] * math.prod(shape)
    if offsets[1] - offsets[0] != size:
        raise PackageError(f"tensor {name!r}: offsets span {offsets[1] - offsets[0]}, not {size}")


def _parse_int(metadata: Mapping[str, str], key: str, low: int, high: int) -> int:
    text = metadata[key]
    if not re.fullmatch(r"[0-9]{1,12}", text):
        raise PackageError(f"metadata {key}={text!r} is not a non-negative integer")
    value = int(text)
    if not low <= value <= high:
        raise PackageError(f"metadata {key}={value} is outside {low}..{high}")
    return value


def _parse_float(metadata: Mapping[str, str], key: str) -> float:
    try:
        value = float(metadata[key])
    except ValueError:
        raise PackageError(f"metadata {key}={metadata[key]!r} is not a number") from None
    if not math.isfinite(value):
        raise PackageError(f"metadata {key} is not finite")
    return value


def _parse_items(
    raw: npt.NDArray[np.uint8], count: int, *, with_text: bool, max_text: int
) -> list[dict[str, str]]:
    try:
        entries = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise PackageError(f"items are not UTF-8 JSON: {err}") from None
    if not isinstance(entries, list):
        raise PackageError("items JSON is not a list")
    if len(entries) != count:
        raise PackageError(f"metadata announces {count} items, the package holds {len(entries)}")
    keys = {"prompt_id", "prompt_sha256"} | ({"text"} if with_text else set())
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != keys:
            raise PackageError(f"item {i} must be an object with exactly {sorted(keys)}")
        if not all(isinstance(v, str) for v in entry.values()):
            raise PackageError(f"item {i}: every field must be a string")
        text = entry.get("text", "")
        # Characters first (free); UTF-8 bytes only where they could exceed the limit.
        if len(text) > max_text or (4 * len(text) > max_text and len(text.encode()) > max_text):
            raise PackageError(
                f"item {i}: completion of {len(text.encode())} bytes exceeds the per-item "
                f"limit of {max_text}",
                reason="item_too_large",
            )
    return entries


class PackageLimits(TypedDict):
    """The size bounds of :func:`decode_package`, as keyword arguments."""

    max_items: int
    max_text_bytes: int
    max_item_text_bytes: int


def student_limits(n_prompts: int, max_item_text_bytes: int) -> PackageLimits:
    """:func:`decode_package` bounds for a student whose X_u has ``n_prompts`` prompts.

    A package answers each prompt at most once, so it holds at most ``n_prompts`` items of
    at most ``max_item_text_bytes`` each, plus :data:`ITEM_OVERHEAD_BYTES` of framing:
    what the student parses, holds and tokenises is bounded by its own configuration
    whatever the teacher sends.
    """
    n = max(1, n_prompts)
    return PackageLimits(
        max_items=n,
        max_text_bytes=n * (max_item_text_bytes + ITEM_OVERHEAD_BYTES),
        max_item_text_bytes=max_item_text_bytes,
    )


def _check_header_fields(
    teacher: str, directive_id: str, transfer_sha256: str, family: str, created_at: float
) -> None:
    try:
        validate_name(teacher)
    except (ValueError, TypeError) as err:
        raise PackageError(f"teacher: {err}") from None
    if not isinstance(directive_id, str) or not _DIRECTIVE_ID.fullmatch(directive_id):
        raise PackageError(f"directive id {directive_id!r} must be 1-128 of [A-Za-z0-9_-]")
    if not isinstance(transfer_sha256, str) or not _HEX64.fullmatch(transfer_sha256):
        raise PackageError(
            "transfer-set SHA-256 missing or malformed (64 lower-case hex digits required)"
        )
    if not isinstance(family, str) or not 1 <= len(family) <= _MAX_FAMILY:
        raise PackageError(f"model family must be 1-{_MAX_FAMILY} characters")
    if not isinstance(created_at, float | int) or not math.isfinite(created_at):
        raise PackageError("created_at must be a finite number of seconds")


def _check_item_ids(ids: Sequence[tuple[str, str]]) -> None:
    seen: set[str] = set()
    for pid, digest in ids:
        if not isinstance(pid, str) or not _PROMPT_ID.fullmatch(pid):
            raise PackageError(
                f"prompt id {pid!r} must be 1-{_MAX_PROMPT_ID} characters without controls"
            )
        if pid in seen:
            raise PackageError(f"prompt id {pid!r} appears twice")
        seen.add(pid)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise PackageError(f"item {pid!r}: prompt SHA-256 must be 64 lower-case hex digits")


def _check_logits_header(temperature: float, tokenizer_sha256: str, vocab_size: int) -> None:
    if not math.isfinite(temperature) or temperature <= 0:
        raise PackageError(f"temperature must be finite and > 0, got {temperature}")
    if not isinstance(tokenizer_sha256, str) or not _HEX64.fullmatch(tokenizer_sha256):
        raise PackageError("tokenizer SHA-256 must be 64 lower-case hex digits")
    if not isinstance(vocab_size, int) or not 1 <= vocab_size < 2**31:
        raise PackageError(f"vocab_size must be in 1..2^31-1, got {vocab_size}")


def _check_item_arrays(pid: str, ids: npt.NDArray[Any], lps: npt.NDArray[Any], k: int) -> None:
    if ids.ndim != 2 or lps.ndim != 2 or ids.shape != lps.shape:
        raise PackageError(f"item {pid!r}: token ids and log-probs must both be [L, k]")
    if ids.shape[1] != k or not 1 <= k <= MAX_TOP_K:
        raise PackageError(f"item {pid!r}: k={ids.shape[1]}, expected {k} in 1..{MAX_TOP_K}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise PackageError(f"item {pid!r}: token ids must be integers, not {ids.dtype}")


def _check_logits_values(ids: npt.NDArray[Any], lps: npt.NDArray[Any], vocab_size: int) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise PackageError(f"token ids must lie in 0..{vocab_size - 1}")
    if not bool(np.all(np.isfinite(lps))):
        raise PackageError("log-probs contain NaN or infinity")
    if lps.size and float(lps.max()) > _LOGPROB_SLACK:
        raise PackageError("log-probs must be <= 0")


def _check_expectations(
    metadata: Mapping[str, str],
    entries: Sequence[Mapping[str, str]],
    *,
    expect_transfer_sha256: str | None,
    expect_directive_id: str | None,
    expect_teacher: str | None,
    expect_prompts: Mapping[str, str] | None,
) -> None:
    if expect_transfer_sha256 is not None and metadata["transfer_sha256"] != expect_transfer_sha256:
        raise PackageError(
            f"package answers transfer set {metadata['transfer_sha256'][:12]}…, "
            f"ours is {expect_transfer_sha256[:12]}…; the teacher uses a different X_u"
        )
    if expect_directive_id is not None and metadata["directive_id"] != expect_directive_id:
        raise PackageError(
            f"package is for directive {metadata['directive_id']!r}, "
            f"we fetched {expect_directive_id!r}"
        )
    if expect_teacher is not None and metadata["teacher"] != expect_teacher:
        raise PackageError(
            f"package names teacher {metadata['teacher']!r}, the directive {expect_teacher!r}"
        )
    if expect_prompts is not None:
        for entry in entries:
            want = expect_prompts.get(entry["prompt_id"])
            if want is None:
                raise PackageError(f"prompt id {entry['prompt_id']!r} is not in our X_u")
            if want != entry["prompt_sha256"]:
                raise PackageError(
                    f"prompt {entry['prompt_id']!r}: SHA-256 differs from our X_u's prompt"
                )
