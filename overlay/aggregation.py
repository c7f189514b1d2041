"""Personalised aggregation of pulled neighbours (SemanticDFL Sec. 2.1, PDFL).

Client i holds its locally trained parameters ``w_i`` and the Top-K neighbours ``S_i`` an
overlay search returned, each with a similarity ``s_ij``. It forms row-stochastic weights
over ``S_i ∪ {i}`` (with ``s_ii`` = 1 for cosine, ``c_i`` the largest similarity)::

    W_ij = exp((s_ij - c_i) / kappa) / sum_{k in S_i ∪ {i}} exp((s_ik - c_i) / kappa)

the client-specific anchor ``m_i = sum_j W_ij w_j`` and one proximal step towards it::

    w_i <- (1 - alpha) w_i + alpha m_i,    alpha = eta psi / (1 + eta psi)

Defaults and why:

* ``psi = 2`` (:data:`DEFAULT_PSI`): the paper's setting for all clients (Sec. 5.1) and the
  best point of its psi sweep (Table 11).
* ``eta = 1`` (:data:`DEFAULT_ETA`): the paper does not state eta, but Table 11 lists alpha
  for each psi (0.1 -> 0.09, 0.5 -> 0.33, 1 -> 0.50, 2 -> 0.67, 5 -> 0.83), which is
  ``psi / (1 + psi)``, i.e. eta = 1. With the defaults alpha = 2/3.
* ``kappa = 0.25`` (:data:`DEFAULT_KAPPA`): not given by the paper. Similarities are
  cosines in [-1, 1] and the self-similarity 1 is always the largest, so kappa sets how fast
  a neighbour's weight falls with its distance from the client: a drop of 0.25 in cosine
  costs a factor e. Ten neighbours at cosine 0.75 leave the client about a fifth of the
  anchor, at 0.5 about two fifths, at 0.25 about two thirds; a neighbour at cosine 0 weighs
  1/55 of the client. Much smaller (0.05) makes the anchor the client itself unless
  neighbours are near-duplicates, so pulling achieves nothing; much larger (1) weighs a
  cosine-0 neighbour at 0.37 of the client and blends clusters, which the similarity
  search exists to avoid.

**Weight cap** (``max_share``, our choice beyond the paper): with a cap, no neighbour's
``W_ij`` exceeds ``max_share / |S_i ∪ {i}|`` (``max_share`` times an equal share of the
row) and what a capped neighbour loses goes to the client's own entry, never to another
neighbour: a member that advertises a signature close to everyone's cannot become the
largest part of their anchors. :func:`personalised_update` reports the capped neighbours.

Neighbours are untrusted: :func:`check_neighbour` refuses one whose tensor names or shapes
differ from the client's, whose values are not finite floating point, or whose similarity is
missing or not finite; :func:`personalised_update` drops it with the reason in its
:class:`AggregationReport` and aggregates the rest. With no neighbour left the update is
the identity (the client's own tensors, unchanged). Arithmetic is float32; each result is
cast back to the dtype of the client's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import torch

__all__ = [
    "DEFAULT_ETA",
    "DEFAULT_KAPPA",
    "DEFAULT_PSI",
    "AggregationError",
    "AggregationReport",
    "Refusal",
    "check_neighbour",
    "neighbour_weights",
    "personalised_update",
    "proximal_alpha",
]

#: Softmax temperature of the neighbour weights (see the module docstring).
DEFAULT_KAPPA: Final = 0.25
#: Proximal step size; eta = 1 reproduces the alphas of the paper's Table 11.
DEFAULT_ETA: Final = 1.0
#: Personalisation weight psi (paper, Sec. 5.1 and Table 11).
DEFAULT_PSI: Final = 2.0


class AggregationError(ValueError):
    """Inputs that cannot be aggregated; ``reason`` is a short machine-readable label."""

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Refusal:
    """A neighbour left out of the anchor, and why."""

    peer: str
    reason: str
    detail: str


@dataclass(frozen=True)
class AggregationReport:
    """What :func:`personalised_update` did.

    ``weights`` are the ``W_ij`` used (the client's own id included; just the client, at
    1.0, when nothing was accepted), ``alpha`` the mixing coefficient, ``accepted`` the
    neighbours in the anchor, ``refused`` those left out, ``delta_norm`` the Euclidean norm
    of the change ``w_new - w`` over all tensors (0.0 for the identity).
    """

    weights: dict[str, float]
    alpha: float
    accepted: tuple[str, ...]
    refused: tuple[Refusal, ...] = ()
    delta_norm: float = 0.0
    identity: bool = field(default=False)
    #: Neighbours whose weight the cap (``max_share``) lowered.
    capped: tuple[str, ...] = ()


def _finite(value: float, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise AggregationError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise AggregationError(f"{what} must be finite, got {value!r}")
    return number


def neighbour_weights(
    similarities: Mapping[str, float],
    *,
    self_id: str,
    self_similarity: float = 1.0,
    kappa: float = DEFAULT_KAPPA,
    max_share: float | None = None,
) -> dict[str, float]:
    """Row-stochastic softmax weights ``W_ij`` over the neighbours and the client itself.

    ``similarities`` maps each neighbour in ``S_i`` to ``s_ij``; the client's own entry is
    ``self_similarity`` under ``self_id`` (which must not also be a neighbour). Subtracting
    ``c_i = max`` keeps every exponent <= 0, so no overflow. The weights sum to 1. With
    ``max_share`` (>= 1) no neighbour weighs more than ``max_share`` equal shares of the
    row; the excess goes to the client's own entry (module docstring).
    """
    k = _finite(kappa, "kappa")
    if k <= 0.0:
        raise AggregationError(f"kappa must be > 0, got {kappa}")
    if self_id in similarities:
        raise AggregationError(f"neighbour {self_id!r} has the client's own id", reason="self")
    scores = {name: _finite(s, f"similarity of {name!r}") for name, s in similarities.items()}
    scores[self_id] = _finite(self_similarity, "self_similarity")
    top = max(scores.values())
    raw = {name: math.exp((s - top) / k) for name, s in scores.items()}
    total = math.fsum(raw.values())  # >= 1: the maximum contributes exp(0)
    weights = {name: r / total for name, r in raw.items()}
    if max_share is not None:
        share = _finite(max_share, "max_share")
        if share < 1.0:
            raise AggregationError(f"max_share must be >= 1 (an equal share), got {max_share}")
        cap = share / len(weights)
        for name in weights:
            if name != self_id and weights[name] > cap:
                weights[self_id] += weights[name] - cap
                weights[name] = cap
    return weights


def proximal_alpha(eta: float = DEFAULT_ETA, psi: float = DEFAULT_PSI) -> float:
    """``alpha = eta psi / (1 + eta psi)`` in [0, 1): the one-step proximal mixing weight."""
    e = _finite(eta, "eta")
    p = _finite(psi, "psi")
    if e <= 0.0:
        raise AggregationError(f"eta (the proximal step size) must be > 0, got {eta}")
    if p < 0.0:
        raise AggregationError(f"psi (the personalisation weight) must be >= 0, got {psi}")
    return e * p / (1.0 + e * p)


def check_neighbour(
    own: Mapping[str, torch.Tensor], neighbour: Mapping[str, torch.Tensor], peer: str
) -> None:
    """Raise :class:`AggregationError` unless ``neighbour`` can be averaged with ``own``.

    Same tensor names, same shapes, floating point, all values finite. ``reason`` is
    ``keys``, ``shape``, ``dtype`` or ``non_finite``.
    """
    missing = sorted(set(own) - set(neighbour))
    extra = sorted(set(neighbour) - set(own))
    if missing or extra:
        parts = []
        for label, names in (("missing", missing), ("unexpected", extra)):
            if names:
                more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
                parts.append(f"{label}: {', '.join(names[:3])}{more}")
        raise AggregationError(
            f"adapter of {peer} has other tensors than ours; " + "; ".join(parts), reason="keys"
        )
    for name in sorted(own):
        theirs = neighbour[name]
        if not isinstance(theirs, torch.Tensor):
            raise AggregationError(f"{peer}: {name} is not a tensor", reason="dtype")
        if tuple(theirs.shape) != tuple(own[name].shape):
            raise AggregationError(
                f"adapter of {peer}: {name} has shape {tuple(theirs.shape)}, "
                f"ours {tuple(own[name].shape)}",
                reason="shape",
            )
        if not torch.is_floating_point(theirs):
            raise AggregationError(
                f"adapter of {peer}: {name} is {theirs.dtype}, not floating point",
                reason="dtype",
            )
        if not bool(torch.isfinite(theirs).all()):
            raise AggregationError(
                f"adapter of {peer}: {name} has non-finite values", reason="non_finite"
            )


def _check_own(own: Mapping[str, torch.Tensor]) -> None:
    if len(own) == 0:
        raise AggregationError("the client's own parameters are empty")
    for name, tensor in own.items():
        if not isinstance(tensor, torch.Tensor) or not torch.is_floating_point(tensor):
            raise AggregationError(f"own parameter {name} is not a floating-point tensor")
        if not bool(torch.isfinite(tensor).all()):
            raise AggregationError(f"own parameter {name} has non-finite values")


def _neighbour_similarity(peer: str, similarities: Mapping[str, float], self_id: str) -> float:
    if peer == self_id:
        raise AggregationError(f"neighbour {peer!r} has the client's own id", reason="self")
    if peer not in similarities:
        raise AggregationError(f"no similarity for {peer}", reason="no_similarity")
    try:
        similarity = float(similarities[peer])
    except (TypeError, ValueError):
        similarity = math.nan
    if not math.isfinite(similarity):
        raise AggregationError(
            f"similarity of {peer} is {similarities[peer]!r}, not a finite number",
            reason="bad_similarity",
        )
    return similarity


def personalised_update(
    own: Mapping[str, torch.Tensor],
    neighbours: Mapping[str, Mapping[str, torch.Tensor]],
    similarities: Mapping[str, float],
    *,
    kappa: float = DEFAULT_KAPPA,
    eta: float = DEFAULT_ETA,
    psi: float = DEFAULT_PSI,
    self_id: str = "self",
    self_similarity: float = 1.0,
    max_share: float | None = None,
) -> tuple[dict[str, torch.Tensor], AggregationReport]:
    """One PDFL step: ``w <- (1 - alpha) w + alpha sum_j W_ij w_j`` over accepted neighbours.

    ``neighbours`` maps a peer to its tensors, ``similarities`` a peer to ``s_ij``. A
    neighbour that fails :func:`check_neighbour`, lacks a finite similarity, or carries
    ``self_id`` is dropped and listed in the report's ``refused``. Returns new tensors (``own``
    is never modified) and the report. Invalid ``own``, ``kappa``, ``eta`` or ``psi`` raise
    :class:`AggregationError`. Without accepted neighbours the result is a copy of ``own``.
    ``max_share`` caps each neighbour's weight (:func:`neighbour_weights`).
    """
    _check_own(own)
    alpha = proximal_alpha(eta, psi)
    k = _finite(kappa, "kappa")
    if k <= 0.0:
        raise AggregationError(f"kappa must be > 0, got {kappa}")
    accepted: dict[str, Mapping[str, torch.Tensor]] = {}
    sims: dict[str, float] = {}
    refused: list[Refusal] = []
    for peer in sorted(neighbours):
        try:
            similarity = _neighbour_similarity(peer, similarities, self_id)
            tensors = neighbours[peer]
            if not isinstance(tensors, Mapping):
                raise AggregationError(f"{peer}: not a mapping of tensors", reason="keys")
            check_neighbour(own, tensors, peer)
        except AggregationError as err:
            refused.append(Refusal(peer, err.reason, str(err)))
            continue
        accepted[peer] = neighbours[peer]
        sims[peer] = similarity
    if not accepted:
        copy = {name: t.detach().clone() for name, t in own.items()}
        report = AggregationReport(
            weights={self_id: 1.0},
            alpha=alpha,
            accepted=(),
            refused=tuple(refused),
            identity=True,
        )
        return copy, report
    weights = neighbour_weights(
        sims, self_id=self_id, self_similarity=self_similarity, kappa=k, max_share=max_share
    )
    capped = tuple(
        p
        for p, w in neighbour_weights(
            sims, self_id=self_id, self_similarity=self_similarity, kappa=k
        ).items()
        if p != self_id and w > weights[p]
    )
    updated: dict[str, torch.Tensor] = {}
    delta_sq = 0.0
    for name, tensor in own.items():
        mine = tensor.detach().to(torch.float32)
        anchor = weights[self_id] * mine
        for peer, tensors in accepted.items():
            theirs = tensors[name].detach().to(device=mine.device, dtype=torch.float32)
            anchor = anchor + weights[peer] * theirs
        mixed = (1.0 - alpha) * mine + alpha * anchor
        out = mixed.to(tensor.dtype)
        delta_sq += float(torch.sum((out.to(torch.float32) - mine) ** 2))
        updated[name] = out
    report = AggregationReport(
        weights=weights,
        alpha=alpha,
        accepted=tuple(accepted),
        refused=tuple(refused),
        delta_norm=math.sqrt(delta_sq),
        capped=capped,
    )
    return updated, report
