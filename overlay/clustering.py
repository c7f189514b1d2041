"""Intra-zone clustering (SemanticDFL Sec. 3.3.2-3.3.3) on a cosine similarity matrix.

:func:`affinity_clusters` runs scikit-learn's ``AffinityPropagation`` with
``affinity="precomputed"`` on the signatures' (or prototypes') cosine matrix, a fixed
``random_state`` and the preference set to a quantile of the off-diagonal similarities
(``ap_preference_quantile``; 0.5 is the median, scikit-learn's default and the paper's
"standard settings" of Sec. 5.1).

AP has not converged when it stops at ``max_iter`` or returns no exemplars (scikit-learn
then labels every sample -1). The documented fallback chain is:

1. retry with the higher dampings in ``OverlayParams.ap_fallback_dampings`` (oscillations
   are what damping suppresses);
2. a deterministic k-medoids split with ``k = round(sqrt(n / 2))`` (a common rule of thumb),
   seeded by farthest-point selection from the most central item.

:func:`cap_group_size` enforces the fan-out cap ``F`` on clusters above level 1 by splitting
an oversized cluster with the same k-medoids routine. :func:`choose_replicas` picks the
replica set ``R_j``: the ``r`` candidates closest to the prototype, in succession order
``(VRF score, id)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from peerlm.overlay.params import OverlayParams
from sklearn.cluster import AffinityPropagation
from sklearn.exceptions import ConvergenceWarning

__all__ = ["Clustering", "affinity_clusters", "cap_group_size", "choose_replicas", "k_medoids"]

FloatMatrix = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Clustering:
    """Groups of item indices (each sorted) with one exemplar index per group."""

    groups: tuple[tuple[int, ...], ...]
    exemplars: tuple[int, ...]
    method: str
    converged: bool
    iterations: int


def _preference(sim: FloatMatrix, quantile: float) -> float:
    n = sim.shape[0]
    off = sim[~np.eye(n, dtype=bool)]
    if off.size == 0:
        return 0.0
    return float(np.quantile(off, quantile))


def _run_ap(sim: FloatMatrix, params: OverlayParams, damping: float) -> Clustering | None:
    model = AffinityPropagation(
        affinity="precomputed",
        damping=damping,
        max_iter=params.ap_max_iter,
        convergence_iter=params.ap_convergence_iter,
        preference=_preference(sim, params.ap_preference_quantile),
        random_state=params.ap_random_state,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", UserWarning)
        model.fit(sim)
    iterations = int(model.n_iter_)
    labels = np.asarray(model.labels_)
    centers = np.asarray(model.cluster_centers_indices_, dtype=np.int64).ravel()
    if iterations >= params.ap_max_iter or centers.size == 0 or bool((labels < 0).any()):
        return None
    groups: list[tuple[int, ...]] = []
    exemplars: list[int] = []
    for c, center in enumerate(centers):
        members = tuple(int(i) for i in np.flatnonzero(labels == c))
        if members:
            groups.append(members)
            exemplars.append(int(center))
    return Clustering(
        tuple(groups),
        tuple(exemplars),
        "affinity_propagation" if damping == params.ap_damping else f"ap(damping={damping})",
        True,
        iterations,
    )


def k_medoids(sim: FloatMatrix, k: int, max_iter: int = 20) -> Clustering:
    """Deterministic k-medoids on a similarity matrix (higher = closer).

    Medoids start at the most central item (largest similarity sum) and grow by
    farthest-point selection; then assignment and medoid update alternate until stable.
    Ties go to the lower index everywhere.
    """
    n = sim.shape[0]
    k = max(1, min(k, n))
    medoids = [int(np.argmax(sim.sum(axis=1)))]
    while len(medoids) < k:
        closeness = sim[:, medoids].max(axis=1)
        closeness[medoids] = np.inf
        medoids.append(int(np.argmin(closeness)))
    labels = np.zeros(n, dtype=np.int64)
    for _ in range(max_iter):
        labels = np.argmax(sim[:, medoids], axis=1)
        labels[medoids] = np.arange(len(medoids))
        new = []
        for c in range(len(medoids)):
            members = np.flatnonzero(labels == c)
            inner = sim[np.ix_(members, members)].sum(axis=1)
            new.append(int(members[int(np.argmax(inner))]))
        if new == medoids:
            break
        medoids = new
    groups: list[tuple[int, ...]] = []
    exemplars: list[int] = []
    for c, medoid in enumerate(medoids):
        group = tuple(int(i) for i in np.flatnonzero(labels == c))
        if group:
            groups.append(group)
            exemplars.append(medoid)
    return Clustering(tuple(groups), tuple(exemplars), f"k_medoids(k={k})", True, 0)


def affinity_clusters(sim: FloatMatrix, params: OverlayParams) -> Clustering:
    """Cluster ``n`` items given their symmetric cosine matrix (see the module docstring)."""
    sim = np.asarray(sim, dtype=np.float64)
    n = sim.shape[0]
    if sim.shape != (n, n):
        raise ValueError(f"similarity matrix must be square, got {sim.shape}")
    if n == 0:
        return Clustering((), (), "empty", True, 0)
    if n == 1:
        return Clustering(((0,),), (0,), "single", True, 0)
    off = sim[~np.eye(n, dtype=bool)]
    if float(off.max() - off.min()) < 1e-12:
        # All pairs equally similar: AP's answer would be arbitrary; one cluster is honest.
        central = int(np.argmax(sim.sum(axis=1)))
        return Clustering((tuple(range(n)),), (central,), "uniform", True, 0)
    for damping in (params.ap_damping, *params.ap_fallback_dampings):
        result = _run_ap(sim, params, damping)
        if result is not None:
            return result
    fallback = k_medoids(sim, max(1, round(math.sqrt(n / 2))))
    return Clustering(fallback.groups, fallback.exemplars, fallback.method, False, 0)


def cap_group_size(
    sim: FloatMatrix, clustering: Clustering, max_size: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Split every group larger than ``max_size`` (the fan-out cap ``F``).

    An oversized group of ``n`` is split by :func:`k_medoids` into ``ceil(n / max_size)``
    parts; a part that is still too large is cut into consecutive chunks in order of
    similarity to its medoid. Returns ``(groups, exemplars)`` in global indices.
    """
    groups: list[tuple[int, ...]] = []
    exemplars: list[int] = []
    for group, exemplar in zip(clustering.groups, clustering.exemplars, strict=True):
        if len(group) <= max_size:
            groups.append(group)
            exemplars.append(exemplar)
            continue
        idx = np.asarray(group, dtype=np.int64)
        sub = k_medoids(sim[np.ix_(idx, idx)], math.ceil(len(group) / max_size))
        for part, medoid in zip(sub.groups, sub.exemplars, strict=True):
            members = [int(idx[i]) for i in part]
            centre = int(idx[medoid])
            if len(members) <= max_size:
                groups.append(tuple(sorted(members)))
                exemplars.append(centre)
                continue
            order = sorted(members, key=lambda m: (-sim[centre, m], m))
            for start in range(0, len(order), max_size):
                chunk = order[start : start + max_size]
                groups.append(tuple(sorted(chunk)))
                exemplars.append(chunk[0])
    return tuple(groups), tuple(exemplars)


def choose_replicas(
    candidates: Sequence[str],
    closeness: Sequence[float],
    scores: Sequence[int],
    r: int,
) -> list[int]:
    """Indices of the replica set: the ``r`` candidates with the highest ``closeness`` to the
    prototype (ties: lower id), ordered for succession by ``(VRF score, id)``."""
    if not len(candidates) == len(closeness) == len(scores):
        raise ValueError("candidates, closeness and scores must have the same length")
    best = sorted(range(len(candidates)), key=lambda i: (-closeness[i], candidates[i]))[:r]
    return sorted(best, key=lambda i: (scores[i], candidates[i]))
