"""Compact top-P model signatures (SemanticDFL Sec. 3.2, App. B.1).

A client keeps a magnitude-based importance score per coordinate,
``s_r <- beta * s_r + (1 - beta) * |w_r|`` (:class:`ImportanceTracker`), and publishes the
*raw masked vector* ``u = mask(w, Top_P(s))``: the current weights at the P coordinates of
largest importance, zero elsewhere, with no normalisation (:func:`make_signature`). Peers
compare signatures by cosine, ``sum_{r in I_a ∩ I_b} u_a,r u_b,r / (||u_a|| ||u_b||)``,
computed by merging the sorted index lists (:func:`sparse_cosine`, and the batch forms
:func:`cosine_to_many` and :func:`cosine_matrix` that the overlay's search and affinity
propagation use). A cluster is summarised by its prototype ``Top_P(mean of members)``
(:func:`prototype`). P is chosen per client by Alg. 1 (:func:`minimal_p`: the smallest P
whose masked vector keeps ``cos(w, u) >= tau_min``) and fixed network-wide by a quantile of
those (:func:`network_p`).

Choices the paper leaves open, made here:

* **Values travel as float16** (the paper: "optionally quantized"; its cost example uses a
  4-byte index and a 2-byte value). A :class:`Signature` therefore holds float16 values and
  every cosine is computed in float64 *from those float16 values*, so a signature compares
  the same before and after the wire. A weight outside float16's range (|w| > 65504) is
  refused rather than silently turned into infinity.
* **Top-P ties** are broken by the lower coordinate index (the paper: "ties broken by
  index"); :func:`top_p_indices` is O(M) (a partition plus a tie fix-up), not a full sort.
* **Parameter spaces.** Signatures of models whose parameter lists differ (other names or
  shapes) are not comparable coordinate by coordinate; each signature carries the
  fingerprint of its space (:func:`flatten_adapter`) and the cosine across spaces is 0.0.
* **Alg. 1's tolerance.** The paper loops ``while h - l > eps_P`` and returns h; with its
  default eps_P = 1 that can stop at ``h = l + 1`` with l already feasible, i.e. one above
  the minimum. :func:`minimal_p` loops ``while h - l >= tolerance``, so ``tolerance=1``
  returns the exact minimum and in general ``P* <= result < P* + tolerance``.
* **Quantile method** for the network-wide P: the lower empirical quantile (numpy's
  ``inverted_cdf``), the smallest reported ``P_i^min`` such that at least a q-fraction of
  clients report a value <= it — exactly the paper's guarantee that a q-fraction of clients
  reach ``tau_min`` — and always one of the reported values.
* **EMA smoothing** ``beta`` defaults to 0.5 (the paper gives only ``beta in [0, 1)``): an
  effective memory of ``1 / (1 - beta) = 2`` rounds damps one-round jitter of the index set
  without letting it lag the adapter by many rounds (values are always current anyway).
  The first update initialises the scores with ``|w|`` instead of decaying from zero.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
from scipy import sparse

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BETA",
    "MAX_DIM",
    "MAX_SPACE_LEN",
    "ImportanceTracker",
    "Signature",
    "SignatureError",
    "cosine_matrix",
    "cosine_rows",
    "cosine_to_many",
    "flatten_adapter",
    "make_signature",
    "minimal_p",
    "network_p",
    "prototype",
    "sparse_cosine",
    "top_p_indices",
]

#: Indices travel as uint32, so a parameter space has at most 2**32 coordinates.
MAX_DIM: Final = 2**32
#: Longest space fingerprint a signature may carry (printable ASCII).
MAX_SPACE_LEN: Final = 128
#: Default EMA smoothing of the importance scores (see the module docstring).
DEFAULT_BETA: Final = 0.5

_MAGIC: Final = b"PSIG"
_VERSION: Final = 1
# magic, version, flags, space length, dim, p
_HEADER: Final = struct.Struct("<4sBBHQI")
_FP16_MAX: Final = float(np.finfo(np.float16).max)
# cosine_to_many switches to a value table when dim <= this x the coordinates it locates.
_LOOKUP_FACTOR: Final = 16

FloatArray = npt.NDArray[np.float64]


class SignatureError(ValueError):
    """A signature, its inputs or its encoding are invalid; the message says which and why."""


def _is_printable_ascii(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


@dataclass(frozen=True, eq=False)
class Signature:
    """A top-P masked vector: ``values`` at ``indices`` of a ``dim``-long parameter space.

    ``indices`` are strictly ascending and ``< dim`` (stored as int64), ``values`` are float16
    (as transmitted) and finite, ``space`` fingerprints the parameter space (names and
    shapes). Both arrays are read-only copies; construction validates everything and raises
    :class:`SignatureError`. Equality compares all four fields exactly.
    """

    indices: npt.NDArray[np.int64]
    values: npt.NDArray[np.float16]
    dim: int
    space: str
    _values64: FloatArray = field(init=False, repr=False, compare=False)
    _norm: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int | np.integer):
            raise SignatureError(f"dim must be an integer, got {type(self.dim).__name__}")
        dim = int(self.dim)
        if not 1 <= dim <= MAX_DIM:
            raise SignatureError(f"dim must lie in [1, 2**32], got {dim}")
        if not isinstance(self.space, str) or not 1 <= len(self.space) <= MAX_SPACE_LEN:
            raise SignatureError(f"space must be a string of 1-{MAX_SPACE_LEN} characters")
        if not _is_printable_ascii(self.space):
            raise SignatureError("space must be printable ASCII")
        idx = np.asarray(self.indices)
        vals = np.asarray(self.values)
        if idx.ndim != 1 or vals.ndim != 1:
            raise SignatureError("indices and values must be one-dimensional")
        if idx.shape != vals.shape:
            raise SignatureError(
                f"{idx.shape[0]} indices but {vals.shape[0]} values; they must pair up"
            )
        if idx.shape[0] == 0:
            raise SignatureError("a signature needs at least one coordinate (P >= 1)")
        if idx.shape[0] > dim:
            raise SignatureError(f"P = {idx.shape[0]} exceeds the dimension {dim}")
        if not np.issubdtype(idx.dtype, np.integer):
            raise SignatureError(f"indices must be integers, got {idx.dtype}")
        if vals.dtype != np.float16:
            raise SignatureError(f"values must be float16 (as transmitted), got {vals.dtype}")
        idx64 = idx.astype(np.int64, copy=True)
        if idx64[0] < 0 or int(idx64[-1]) >= dim:
            raise SignatureError(f"indices must lie in [0, {dim})")
        if idx64.shape[0] > 1 and not bool(np.all(np.diff(idx64) > 0)):
            raise SignatureError("indices must be strictly ascending (sorted, unique)")
        if not bool(np.isfinite(vals).all()):
            raise SignatureError("signature values must be finite (no NaN or infinity)")
        vals16 = vals.copy()
        idx64.setflags(write=False)
        vals16.setflags(write=False)
        values64 = vals16.astype(np.float64)
        values64.setflags(write=False)
        object.__setattr__(self, "indices", idx64)
        object.__setattr__(self, "values", vals16)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "_values64", values64)
        object.__setattr__(self, "_norm", float(np.sqrt(np.dot(values64, values64))))

    # ------------------------------------------------------------------ accessors

    @property
    def p(self) -> int:
        """Number of stored coordinates (the signature cardinality P)."""
        return int(self.indices.shape[0])

    def norm(self) -> float:
        """Euclidean norm of the masked vector, in float64 from the float16 values (cached)."""
        return self._norm

    def values64(self) -> FloatArray:
        """The values as read-only float64 (what every similarity computes with)."""
        return self._values64

    def dense(self) -> FloatArray:
        """The masked vector as a dense float64 array of length ``dim`` (small dims only)."""
        out = np.zeros(self.dim, dtype=np.float64)
        out[self.indices] = self._values64
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Signature):
            return NotImplemented
        return (
            self.dim == other.dim
            and self.space == other.space
            and np.array_equal(self.indices, other.indices)
            and self.values.tobytes() == other.values.tobytes()
        )

    def __hash__(self) -> int:
        return hash((self.dim, self.space, self.indices.tobytes(), self.values.tobytes()))

    # ------------------------------------------------------------------ wire format

    def to_bytes(self) -> bytes:
        """Encode as ``header | space (ASCII) | P x uint32 indices | P x float16 values``.

        The header is ``b"PSIG"``, version (1), flags (0), space length (u16), dim (u64),
        P (u32), little-endian: 20 bytes, so a signature costs ``20 + len(space) + 6 P``.
        """
        space = self.space.encode("ascii")
        header = _HEADER.pack(_MAGIC, _VERSION, 0, len(space), self.dim, self.p)
        return b"".join(
            (
                header,
                space,
                self.indices.astype("<u4").tobytes(),
                self.values.astype("<f2").tobytes(),
            )
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, max_p: int) -> Signature:
        """Decode :meth:`to_bytes` output from an untrusted peer.

        Checks, each with its own message: length, magic, version, flags, space (1-128
        printable ASCII), dim in [1, 2**32], ``1 <= P <= min(max_p, dim)``, exact total
        size, indices strictly ascending and ``< dim``, values finite.
        """
        if max_p < 1:
            raise ValueError(f"max_p must be >= 1, got {max_p}")
        raw = bytes(data)
        if len(raw) < _HEADER.size:
            raise SignatureError(
                f"signature of {len(raw)} bytes is shorter than its {_HEADER.size}-byte header"
            )
        magic, version, flags, space_len, dim, p = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise SignatureError(f"not a signature: magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise SignatureError(f"unsupported signature version {version} (know {_VERSION})")
        if flags != 0:
            raise SignatureError(f"unknown signature flags {flags:#x}")
        if not 1 <= space_len <= MAX_SPACE_LEN:
            raise SignatureError(f"space length {space_len} outside [1, {MAX_SPACE_LEN}]")
        if not 1 <= dim <= MAX_DIM:
            raise SignatureError(f"dim {dim} outside [1, 2**32]")
        if p < 1:
            raise SignatureError("signature has P = 0 coordinates")
        if p > max_p:
            raise SignatureError(f"signature has P = {p} coordinates, over the limit of {max_p}")
        if p > dim:
            raise SignatureError(f"signature has P = {p} coordinates in a {dim}-dim space")
        expected = _HEADER.size + space_len + 6 * p
        if len(raw) != expected:
            raise SignatureError(
                f"signature is {len(raw)} bytes; its header (P = {p}, space of {space_len} "
                f"bytes) implies {expected}"
            )
        at = _HEADER.size
        try:
            space = raw[at : at + space_len].decode("ascii")
        except UnicodeDecodeError:
            raise SignatureError("signature space is not ASCII") from None
        at += space_len
        indices = np.frombuffer(raw, dtype="<u4", count=p, offset=at).astype(np.int64)
        values = np.frombuffer(raw, dtype="<f2", count=p, offset=at + 4 * p).astype(np.float16)
        return cls(indices=indices, values=values, dim=int(dim), space=space)


# --------------------------------------------------------------------- similarity


def sparse_cosine(a: Signature, b: Signature) -> float:
    """Cosine of two signatures' masked vectors: O(P log P), vectorised over sorted indices.

    0.0 when the parameter spaces (fingerprint or dim) differ or either vector is zero.
    """
    if a.space != b.space or a.dim != b.dim or a.norm() == 0.0 or b.norm() == 0.0:
        return 0.0
    pos = np.searchsorted(b.indices, a.indices)
    pos[pos == b.p] = b.p - 1
    hit = b.indices[pos] == a.indices
    dot = float(np.dot(a.values64()[hit], b.values64()[pos[hit]]))
    return _clip_cos(dot / (a.norm() * b.norm()))


def _clip_cos(value: float) -> float:
    # Rounding can push |cos| a hair past 1 for (nearly) identical vectors.
    return min(1.0, max(-1.0, value))


def cosine_to_many(query: Signature, others: Sequence[Signature]) -> FloatArray:
    """``[sparse_cosine(query, o) for o in others]`` as one vectorised pass (float64 array).

    All others' coordinates are concatenated and looked up in the query at once (one
    ``searchsorted``, or a value table when dim is at most 16 times the number of
    coordinates: O(sum P + dim) instead of O(sum P log P)); the per-signature dot products
    are one segmented sum (``np.add.reduceat``).
    """
    n = len(others)
    out = np.zeros(n, dtype=np.float64)
    if n == 0 or query.norm() == 0.0:
        return out
    same = [
        k
        for k, o in enumerate(others)
        if o.space == query.space and o.dim == query.dim and o.norm() > 0.0
    ]
    if not same:
        return out
    members = [others[k] for k in same]
    lengths = np.fromiter((o.p for o in members), dtype=np.int64, count=len(members))
    idx = np.concatenate([o.indices for o in members])
    vals = np.concatenate([o.values64() for o in members])
    starts = np.zeros(len(members), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    # Every signature has P >= 1, so the segments are non-empty and reduceat sums each.
    dots = np.add.reduceat(vals * _query_values_at(query, idx), starts)
    norms = np.fromiter((o.norm() for o in members), dtype=np.float64, count=len(members))
    out[np.asarray(same, dtype=np.int64)] = np.clip(dots / (norms * query.norm()), -1.0, 1.0)
    return out


def _query_values_at(query: Signature, needles: npt.NDArray[np.int64]) -> FloatArray:
    """The query's value at each needle coordinate (0.0 where the query has none).

    Binary search in the query's sorted indices by default; when the space is small next
    to the number of needles, a dim-long value table is an order of magnitude faster.
    """
    if query.dim <= _LOOKUP_FACTOR * needles.shape[0]:
        table = np.zeros(query.dim, dtype=np.float64)
        table[query.indices] = query.values64()
        return table[needles]
    pos = np.searchsorted(query.indices, needles)
    pos[pos == query.p] = query.p - 1
    return np.where(query.indices[pos] == needles, query.values64()[pos], 0.0)


def cosine_matrix(signatures: Sequence[Signature]) -> FloatArray:
    """Symmetric n x n cosine matrix (affinity propagation's input), float64.

    The signatures become the rows of a CSR matrix over a compacted column space (one
    column per distinct (space, index) pair, so different spaces never share a column),
    rows are scaled to unit norm and the Gram matrix is one sparse product. The diagonal is
    1 for non-zero signatures and 0 for all-zero ones; cross-space entries are 0.
    """
    n = len(signatures)
    if n == 0:
        return np.zeros((0, 0), dtype=np.float64)
    matrix, norms = _unit_rows(signatures)
    gram = np.asarray((matrix @ matrix.T).toarray(), dtype=np.float64)
    gram = np.clip((gram + gram.T) / 2.0, -1.0, 1.0)
    np.fill_diagonal(gram, np.where(norms > 0.0, 1.0, 0.0))
    return gram


def cosine_rows(signatures: Sequence[Signature], rows: Sequence[int]) -> FloatArray:
    """``cosine_matrix(signatures)[rows]``, equal to it bit for bit, in ``O(len(rows) N)``
    memory (the benchmark's exact top-K at N = 10,000 would need the whole ``N x N``)."""
    n = len(signatures)
    picked = np.asarray(rows, dtype=np.int64)
    if n == 0 or picked.size == 0:
        return np.zeros((picked.size, n), dtype=np.float64)
    matrix, norms = _unit_rows(signatures)
    part = matrix[picked]
    # Both halves of the symmetrised Gram matrix, each summed in the order the full
    # product sums it, so the result matches cosine_matrix exactly.
    upper = np.asarray((part @ matrix.T).toarray(), dtype=np.float64)
    lower = np.asarray((matrix @ part.T).toarray(), dtype=np.float64).T
    block = np.clip((upper + lower) / 2.0, -1.0, 1.0)
    block[np.arange(picked.size), picked] = np.where(norms[picked] > 0.0, 1.0, 0.0)
    return block


def _unit_rows(signatures: Sequence[Signature]) -> tuple[sparse.csr_matrix, FloatArray]:
    """The signatures as unit-norm CSR rows over a compacted column space, and their norms."""
    n = len(signatures)
    space_ids: dict[tuple[str, int], int] = {}
    keys = []
    data = []
    lengths = np.empty(n, dtype=np.int64)
    norms = np.empty(n, dtype=np.float64)
    for row, sig in enumerate(signatures):
        sid = space_ids.setdefault((sig.space, sig.dim), len(space_ids))
        keys.append(sig.indices + (sid << 32))
        norms[row] = sig.norm()
        scale = 1.0 / norms[row] if norms[row] > 0.0 else 0.0
        data.append(sig.values64() * scale)
        lengths[row] = sig.p
    columns, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    rows = np.repeat(np.arange(n), lengths)
    matrix = sparse.csr_matrix(
        (np.concatenate(data), (rows, inverse.ravel())), shape=(n, columns.shape[0])
    )
    return matrix, norms


# ----------------------------------------------------------------- construction


def _vector(values: Any, what: str) -> FloatArray:
    """``values`` as a finite, non-empty, one-dimensional float64 array."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise SignatureError(f"{what} must be a numeric vector: {err}") from None
    if arr.ndim != 1:
        raise SignatureError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise SignatureError(f"{what} is empty")
    if not bool(np.isfinite(arr).all()):
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise SignatureError(f"{what} has {bad} non-finite entries (NaN or infinity)")
    return arr


def _check_p(p: int, m: int) -> int:
    if isinstance(p, bool) or not isinstance(p, int | np.integer):
        raise SignatureError(f"P must be an integer, got {type(p).__name__}")
    if not 1 <= int(p) <= m:
        raise SignatureError(f"P must lie in [1, M = {m}], got {p}")
    return int(p)


def top_p_indices(scores: npt.ArrayLike, p: int) -> npt.NDArray[np.int64]:
    """Indices of the ``p`` largest scores, ties broken by the lower index, sorted ascending.

    O(M): a partition finds the p-th largest value; everything above it is taken and the
    remaining places go to the lowest indices holding exactly that value.
    """
    s = _vector(scores, "scores")
    p = _check_p(p, s.shape[0])
    m = s.shape[0]
    kth = np.partition(s, m - p)[m - p]
    above = np.flatnonzero(s > kth)
    ties = np.flatnonzero(s == kth)[: p - above.shape[0]]
    return np.sort(np.concatenate((above, ties))).astype(np.int64)


def _to_float16(values: FloatArray, what: str) -> npt.NDArray[np.float16]:
    if values.size and float(np.max(np.abs(values))) > _FP16_MAX:
        raise SignatureError(
            f"{what} has magnitudes above float16's maximum {_FP16_MAX:g}; "
            "signature values travel as float16"
        )
    return values.astype(np.float16)


def make_signature(weights: npt.ArrayLike, scores: npt.ArrayLike, p: int, space: str) -> Signature:
    """The raw masked vector ``mask(w, Top_P(s))`` as a :class:`Signature` (float16 values)."""
    w = _vector(weights, "weights")
    s = _vector(scores, "scores")
    if w.shape != s.shape:
        raise SignatureError(f"weights ({w.shape[0]}) and scores ({s.shape[0]}) differ in length")
    idx = top_p_indices(s, p)
    return Signature(
        indices=idx, values=_to_float16(w[idx], "weights"), dim=w.shape[0], space=space
    )


def minimal_p(
    weights: npt.ArrayLike,
    scores: npt.ArrayLike,
    tau_min: float,
    *,
    lo: int = 1,
    hi: int | None = None,
    tolerance: int = 1,
) -> int:
    """Alg. 1: the smallest P in [lo, hi] with ``cos(w, mask(w, Top_P(s))) >= tau_min``.

    One stable sort by descending score (ties by index), prefix sums ``c_k`` of the squared
    weights in that order, then a binary search on ``c_P >= tau^2 ||w||^2`` (the cosine is
    non-decreasing in P because supports are nested): O(M log M) time, O(M) memory. A zero
    ``w`` returns ``hi`` (M by default, Alg. 1 line 2). ``hi`` caps the answer: when even ``hi``
    does not reach ``tau_min``, ``hi`` is returned (the paper's corner case (i) returns M).
    The result lies in ``[P*, P* + tolerance)`` where P* is the exact minimum in [lo, hi]
    (see the module docstring for the deviation from the paper's loop condition).
    """
    w = _vector(weights, "weights")
    s = _vector(scores, "scores")
    m = int(w.shape[0])
    if s.shape != w.shape:
        raise SignatureError(f"weights ({m}) and scores ({s.shape[0]}) differ in length")
    tau = float(tau_min)
    if not 0.0 < tau <= 1.0:
        raise SignatureError(f"tau_min must lie in (0, 1], got {tau_min}")
    high = m if hi is None else _check_p(hi, m)
    low = _check_p(lo, m)
    if low > high:
        raise SignatureError(f"lo = {lo} exceeds hi = {high}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int) or tolerance < 1:
        raise SignatureError(f"tolerance must be an integer >= 1, got {tolerance}")
    order = np.argsort(-s, kind="stable")
    prefix = np.cumsum(np.square(w[order]))
    total = float(prefix[-1])
    if total == 0.0:
        return high
    target = tau * tau * total

    def feasible(p: int) -> bool:
        return bool(prefix[p - 1] >= target)

    if not feasible(high):
        return high
    while high - low >= tolerance:
        mid = (low + high) // 2
        if feasible(mid):
            high = mid
        else:
            low = mid + 1
    return high


def network_p(p_mins: Sequence[int], q: float, p_max: int) -> int:
    """Network-wide P: ``min(Quantile_q({P_i^min}), P_max)`` (App. B.1).

    The quantile is the lower empirical one (numpy ``method="inverted_cdf"``): the
    ``ceil(q n)``-th smallest report, so at least a q-fraction of clients have
    ``P_i^min <= P`` and thus reach ``tau_min``. ``q`` in (0, 1]; reports and ``p_max``
    must be integers >= 1.
    """
    if len(p_mins) == 0:
        raise SignatureError("network_p needs at least one P_i^min report")
    if not 0.0 < float(q) <= 1.0 or math.isnan(float(q)):
        raise SignatureError(f"q must lie in (0, 1], got {q}")
    if isinstance(p_max, bool) or not isinstance(p_max, int | np.integer) or p_max < 1:
        raise SignatureError(f"p_max must be an integer >= 1, got {p_max}")
    reports = np.asarray(p_mins)
    if reports.ndim != 1 or not np.issubdtype(reports.dtype, np.integer):
        raise SignatureError("P_i^min reports must be integers")
    if int(reports.min()) < 1:
        raise SignatureError("P_i^min reports must be >= 1")
    ordered = np.sort(reports)
    rank = max(1, math.ceil(float(q) * ordered.shape[0] - 1e-12))
    return min(int(ordered[rank - 1]), int(p_max))


def prototype(signatures: Sequence[Signature], p: int) -> Signature:
    """A cluster's prototype ``Top_P(mean of the members' masked vectors)`` (Sec. 3.3.2).

    Computed over the union of the members' supports only. Top-P ranks by magnitude with
    ties to the lower index, exactly as over the dense mean: when fewer than P coordinates
    carry a non-zero mean, the remaining places are the lowest-index zero coordinates (as a
    dense Top-P would pick them), so the prototype keeps the network-wide cardinality P.
    Members must share space and dim.
    """
    if len(signatures) == 0:
        raise SignatureError("a prototype needs at least one member signature")
    first = signatures[0]
    for sig in signatures[1:]:
        if sig.space != first.space or sig.dim != first.dim:
            raise SignatureError(
                "prototype members must share one parameter space: "
                f"{first.space}/{first.dim} vs {sig.space}/{sig.dim}"
            )
    p = _check_p(p, first.dim)
    union, inverse = np.unique(np.concatenate([s.indices for s in signatures]), return_inverse=True)
    sums = np.bincount(
        inverse.ravel(),
        weights=np.concatenate([s.values64() for s in signatures]),
        minlength=union.shape[0],
    )
    mean = sums / len(signatures)
    nonzero = mean != 0.0
    support, magnitude = union[nonzero], np.abs(mean[nonzero])
    if support.shape[0] >= p:
        chosen = top_p_indices(magnitude, p)
        idx, vals = support[chosen], mean[nonzero][chosen]
    else:
        # Fill with the lowest coordinates whose mean is zero, as a dense Top-P would.
        need = p - support.shape[0]
        candidates = np.arange(min(first.dim, need + support.shape[0]), dtype=np.int64)
        zeros = np.setdiff1d(candidates, support, assume_unique=True)[:need]
        idx = np.concatenate((support, zeros))
        vals = np.concatenate((mean[nonzero], np.zeros(zeros.shape[0])))
        order = np.argsort(idx)
        idx, vals = idx[order], vals[order]
    return Signature(indices=idx, values=vals.astype(np.float16), dim=first.dim, space=first.space)


# ------------------------------------------------------------------ importance


class ImportanceTracker:
    """Per-coordinate importance ``s_r <- beta s_r + (1 - beta) |w_r|`` (Sec. 3.2).

    ``beta`` in [0, 1) (0 = raw magnitudes; default :data:`DEFAULT_BETA`). The first
    :meth:`update` sets ``s = |w|`` (no decay from zero); later updates must keep the
    vector length.
    """

    def __init__(self, beta: float = DEFAULT_BETA) -> None:
        if not 0.0 <= float(beta) < 1.0:
            raise SignatureError(f"beta must lie in [0, 1), got {beta}")
        self._beta = float(beta)
        self._scores: FloatArray | None = None
        self._updates = 0

    @property
    def beta(self) -> float:
        """The smoothing factor."""
        return self._beta

    @property
    def updates(self) -> int:
        """How many weight vectors have been folded in."""
        return self._updates

    @property
    def scores(self) -> FloatArray | None:
        """A copy of the current scores, or None before the first update."""
        return None if self._scores is None else self._scores.copy()

    def update(self, weights: npt.ArrayLike) -> FloatArray:
        """Fold in the current weights; returns a copy of the new scores (float64)."""
        magnitude = np.abs(_vector(weights, "weights"))
        if self._scores is None:
            self._scores = magnitude
        else:
            if magnitude.shape != self._scores.shape:
                raise SignatureError(
                    f"weights have {magnitude.shape[0]} coordinates; the tracked space has "
                    f"{self._scores.shape[0]}"
                )
            self._scores = self._beta * self._scores + (1.0 - self._beta) * magnitude
        self._updates += 1
        return self._scores.copy()

    def state_dict(self) -> dict[str, Any]:
        """``{"beta", "updates", "scores"}`` (scores a float64 array or None) for checkpoints."""
        return {
            "beta": self._beta,
            "updates": self._updates,
            "scores": None if self._scores is None else self._scores.copy(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; validated, and nothing changes on error."""
        try:
            beta = float(state["beta"])
            updates = int(state["updates"])
            raw = state["scores"]
        except (KeyError, TypeError, ValueError) as err:
            raise SignatureError(f"importance state is malformed: {err!r}") from None
        if not 0.0 <= beta < 1.0:
            raise SignatureError(f"importance state has beta {beta} outside [0, 1)")
        if updates < 0:
            raise SignatureError("importance state has a negative update count")
        scores = None if raw is None else _vector(raw, "importance scores").copy()
        if scores is not None and bool((scores < 0).any()):
            raise SignatureError("importance scores must be non-negative")
        if (scores is None) != (updates == 0):
            raise SignatureError("importance state: scores present exactly when updates > 0")
        self._beta, self._updates, self._scores = beta, updates, scores


# ------------------------------------------------------------------- flattening


def _as_numpy(value: Any, name: str) -> npt.NDArray[Any]:
    if hasattr(value, "detach") and hasattr(
        value, "cpu"
    ):  # a torch.Tensor, without importing torch
        if value.is_complex():
            raise SignatureError(f"tensor {name} is complex")
        return np.asarray(value.detach().cpu().float().numpy())
    arr = np.asarray(value)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise SignatureError(f"tensor {name} has non-numeric dtype {arr.dtype}")
    return arr


def flatten_adapter(
    tensors: Mapping[str, npt.NDArray[Any] | torch.Tensor],
) -> tuple[npt.NDArray[np.float32], str]:
    """Concatenate tensors in sorted-name order into one float32 vector, plus its space.

    The space fingerprint is the first 16 hex digits of SHA-256 over the JSON list of
    ``[name, shape]`` pairs (sorted by name): adapters with the same tensor names and shapes
    share coordinates, anything else gets another fingerprint. Refuses an empty mapping and
    non-finite values.
    """
    if len(tensors) == 0:
        raise SignatureError("cannot flatten an empty set of tensors")
    parts = []
    layout = []
    for name in sorted(tensors):
        if not isinstance(name, str):
            raise SignatureError(f"tensor names must be strings, got {type(name).__name__}")
        arr = _as_numpy(tensors[name], name)
        layout.append([name, [int(d) for d in arr.shape]])
        flat = arr.astype(np.float32).ravel()
        if not bool(np.isfinite(flat).all()):
            raise SignatureError(f"tensor {name} has non-finite values (NaN or infinity)")
        parts.append(flat)
    vector = np.concatenate(parts)
    if vector.shape[0] == 0:
        raise SignatureError("the tensors hold no values")
    digest = hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
    return vector, digest[:16]
