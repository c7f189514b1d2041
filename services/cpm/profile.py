"""The agent profile layout (KNEXA-FL, "Rebuttal Additions") and profile validation.

A profile ``p_i`` is a flat float vector of ``d_p = 32`` entries:

============  ==========  ==============================================================
slice         entries     meaning
============  ==========  ==============================================================
``[0:8]``     8 static    one-hot of the LLM backbone family
``[8:20]``    12 dynamic  validation metrics and their deltas; ``[8]`` is pass@1
``[20:32]``   12 distrib  normalised histogram over 12 problem categories (may carry DP
                          noise, so it is re-normalised wherever it is read as a
                          distribution)
============  ==========  ==============================================================

The matchmaker itself does not depend on this layout (any ``profile_dim`` works: the
context map treats a profile as an opaque vector); the layout is read by the
Hetero-Greedy baseline (Algorithm 4) and by the agents that build profiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "COLUMN_GROUPS",
    "DISTRIBUTION_SLICE",
    "DYNAMIC_SLICE",
    "MAX_ABS_PROFILE_VALUE",
    "PERFORMANCE_INDEX",
    "PROFILE_DIM",
    "PROFILE_LAYOUT",
    "STATIC_SLICE",
    "ProfileLayout",
    "check_context_columns",
    "context_columns",
    "validate_profile",
    "validate_profiles",
]

PROFILE_DIM = 32
STATIC_SLICE = slice(0, 8)
DYNAMIC_SLICE = slice(8, 20)
DISTRIBUTION_SLICE = slice(20, 32)
#: The first dynamic feature is the agent's recent pass@1; Algorithm 4's "performance" u_i.
PERFORMANCE_INDEX = 8
#: Larger entries are not a plausible metric or histogram value: they are a bug or an attack,
#: and left in they would dominate every inner product the bandit computes.
MAX_ABS_PROFILE_VALUE = 1e6


@dataclass(frozen=True)
class ProfileLayout:
    """Where each feature group lives in a profile vector (immutable)."""

    dim: int = PROFILE_DIM
    # default_factory only because slices are unhashable, which dataclasses take for mutable.
    static: slice = field(default_factory=lambda: STATIC_SLICE)
    dynamic: slice = field(default_factory=lambda: DYNAMIC_SLICE)
    distribution: slice = field(default_factory=lambda: DISTRIBUTION_SLICE)
    performance_index: int = PERFORMANCE_INDEX


#: The layout every peerlm agent uses (d_p = 32).
PROFILE_LAYOUT = ProfileLayout()


def validate_profile(vec: ArrayLike, dim: int = PROFILE_DIM) -> NDArray[np.float64]:
    """Return ``vec`` as a fresh 1-D float64 array of length ``dim``.

    Raises ``ValueError`` when it cannot be read as numbers, has the wrong shape, holds
    NaN or Inf, or any entry exceeds :data:`MAX_ABS_PROFILE_VALUE` in magnitude.
    """
    try:
        arr = np.array(vec, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"profile is not a numeric vector: {exc}") from None
    if arr.shape != (dim,):
        raise ValueError(f"profile must have shape ({dim},), got {arr.shape}")
    _check_values(arr)
    return arr


def validate_profiles(
    ids: Sequence[str], vectors: Sequence[ArrayLike], dim: int
) -> NDArray[np.float64]:
    """Stack many profiles into an ``(N, dim)`` matrix, validating them all at once.

    The value checks run vectorised over the whole matrix (this is on the ``select`` hot
    path); only on failure is the offending agent located, for the error message.
    """
    if len(ids) != len(vectors):
        raise ValueError("one profile per agent id")
    try:
        # Fast path: one conversion of the whole list (the per-agent loop below costs
        # ~1.5 us per agent); anything it does not turn into (N, dim) goes to the loop,
        # which finds the offending agent for the message.
        out = np.array(vectors, dtype=np.float64)
    except (TypeError, ValueError):
        out = np.empty(0)
    if out.shape == (len(vectors), dim):
        if out.size and not _values_ok(out):
            _raise_first_bad(ids, out)
        return out
    out = np.empty((len(vectors), dim), dtype=np.float64)
    for row, (agent, vec) in enumerate(zip(ids, vectors, strict=True)):
        try:
            arr = np.asarray(vec, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"profile of {agent!r} is not a numeric vector: {exc}") from None
        if arr.shape != (dim,):
            raise ValueError(f"profile of {agent!r} must have shape ({dim},), got {arr.shape}")
        out[row] = arr
    if out.size and not _values_ok(out):
        _raise_first_bad(ids, out)
    return out


def _raise_first_bad(ids: Sequence[str], out: NDArray[np.float64]) -> None:
    for agent, row_vec in zip(ids, out, strict=True):
        try:
            _check_values(row_vec)
        except ValueError as exc:
            raise ValueError(f"profile of {agent!r}: {exc}") from None


def _values_ok(arr: NDArray[np.float64]) -> bool:
    # max(|x|) is NaN if any entry is NaN and Inf if any is Inf; one pass covers all three.
    peak = float(np.max(np.abs(arr))) if arr.size else 0.0
    return math.isfinite(peak) and peak <= MAX_ABS_PROFILE_VALUE


def _check_values(arr: NDArray[np.float64]) -> None:
    if not np.all(np.isfinite(arr)):
        raise ValueError("profile holds NaN or Inf")
    if arr.size and float(np.max(np.abs(arr))) > MAX_ABS_PROFILE_VALUE:
        raise ValueError(f"profile entry exceeds {MAX_ABS_PROFILE_VALUE:g} in magnitude")


#: Named groups of profile entries, for choosing what the bandit's context sees
#: (:func:`context_columns`): the layout's three slices, and ``performance``, the one
#: entry Algorithm 4 reads (recent validation pass@1).
COLUMN_GROUPS: dict[str, tuple[int, ...]] = {
    "static": tuple(range(STATIC_SLICE.start, STATIC_SLICE.stop)),
    "dynamic": tuple(range(DYNAMIC_SLICE.start, DYNAMIC_SLICE.stop)),
    "distribution": tuple(range(DISTRIBUTION_SLICE.start, DISTRIBUTION_SLICE.stop)),
    "performance": (PERFORMANCE_INDEX,),
}


def context_columns(spec: str) -> tuple[int, ...] | None:
    """Profile indices named by ``spec``: ``"all"`` (``None``: every entry), or a
    comma-separated list of :data:`COLUMN_GROUPS` names and indices, in that order
    (``"performance,static"``, ``"8,20,21"``). Raises ``ValueError`` for an unknown
    name, a repeat or an empty list."""
    text = spec.strip()
    if text == "all":
        return None
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if part in COLUMN_GROUPS:
            out.extend(COLUMN_GROUPS[part])
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(
                f"unknown profile column {part!r}: use 'all', indices or "
                f"{', '.join(sorted(COLUMN_GROUPS))}"
            )
    check_context_columns(out, PROFILE_DIM)
    return tuple(out)


def check_context_columns(
    columns: Sequence[int] | None, profile_dim: int
) -> NDArray[np.intp] | None:
    """``columns`` as an index array after checking it (``None`` passes through): a
    non-empty list of distinct integers in ``[0, profile_dim)``."""
    if columns is None:
        return None
    cols = list(columns)
    if not cols:
        raise ValueError("context_columns must name at least one profile entry")
    if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in cols):
        raise ValueError(f"context_columns must be integers, got {cols}")
    if len(set(cols)) != len(cols):
        raise ValueError(f"context_columns has repeats: {cols}")
    bad = [c for c in cols if not 0 <= c < profile_dim]
    if bad:
        raise ValueError(f"context_columns {bad} are outside a {profile_dim}-entry profile")
    return np.asarray(cols, dtype=np.intp)
