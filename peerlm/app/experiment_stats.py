"""Paired bootstrap over seeds and test problems, for ``peerlm run-experiment``.

Every strategy of a run is measured on the same units: the same run seeds, and per seed
the same (client, test problem) pairs of a slice (the world and the models do not change
with the run seed). A metric is therefore a matrix ``values[seed, unit]`` per strategy,
and a difference between two strategies is a difference of two such matrices cell by cell.

The interval is a two-level (crossed) percentile bootstrap: each replicate draws the seeds
with replacement and, independently, the units with replacement, and takes the mean of
the selected cells. The *same* draws are used for every strategy within a replicate, so a
difference's interval is the paired one (the variance shared by two strategies on the same
problem cancels). Resampling both levels takes the seed-to-seed variance (adapters,
batches, pairing, samples) and the problem-to-problem variance into account.

Written with numpy by hand because ``scipy.stats.bootstrap`` resamples one axis of paired
samples; it has no crossed two-level resampling. The seed of the bootstrap is fixed, so a
table is reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Estimate", "paired_bootstrap", "paired_share", "stratified_bootstrap"]

Matrix = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Estimate:
    """A mean (or a difference of means) with its 95% percentile interval."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float | list[float]]:
        """JSON form: ``{"mean": m, "ci95": [low, high]}``."""
        return {"mean": self.mean, "ci95": [self.low, self.high]}


def _check(values: Mapping[str, Matrix]) -> tuple[int, int]:
    shapes = {np.shape(v) for v in values.values()}
    if len(shapes) != 1:
        raise ValueError(f"every strategy needs the same [seeds, units] matrix, got {shapes}")
    shape = shapes.pop()
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"need a non-empty [seeds, units] matrix, got shape {shape}")
    return int(shape[0]), int(shape[1])


def _replicates(
    values: Mapping[str, Matrix], replicates: int, seed: int
) -> tuple[list[str], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(names, point means, [replicates, names] bootstrap means) over crossed draws."""
    if not values:
        raise ValueError("no strategies to compare")
    n_seeds, n_units = _check(values)
    names = list(values)
    stacked = np.stack([np.asarray(values[n], dtype=np.float64) for n in names])
    if not np.all(np.isfinite(stacked)):
        raise ValueError("values must be finite")
    rng = np.random.default_rng(seed)
    boots = np.empty((replicates, len(names)))
    for r in range(replicates):
        s = rng.integers(0, n_seeds, n_seeds)
        u = rng.integers(0, n_units, n_units)
        # Mean over the crossed selection: rows s, columns u of every strategy.
        boots[r] = stacked[:, s][:, :, u].mean(axis=(1, 2))
    return names, stacked.mean(axis=(1, 2)), boots


def _estimate(center: float, dist: Matrix) -> Estimate:
    low, high = np.percentile(dist, [2.5, 97.5])
    return Estimate(float(center), float(low), float(high))


def paired_bootstrap(
    values: Mapping[str, Matrix],
    pairs: list[tuple[str, str]],
    *,
    replicates: int = 2000,
    seed: int = 12345,
) -> tuple[dict[str, Estimate], dict[tuple[str, str], Estimate]]:
    """Means per strategy and differences ``a - b`` for ``pairs``, with 95% intervals.

    ``values[name]`` is a ``[seeds, units]`` matrix (the same shape for every name);
    NaN cells are not allowed. Returns (per strategy, per pair).
    """
    for a, b in pairs:
        if a not in values or b not in values:
            raise ValueError(f"unknown strategy in pair ({a}, {b})")
    names, point, boots = _replicates(values, replicates, seed)
    means = {n: _estimate(point[i], boots[:, i]) for i, n in enumerate(names)}
    diffs: dict[tuple[str, str], Estimate] = {}
    for a, b in pairs:
        i, j = names.index(a), names.index(b)
        diffs[(a, b)] = _estimate(point[i] - point[j], boots[:, i] - boots[:, j])
    return means, diffs


def paired_share(
    values: Mapping[str, Matrix],
    a: str,
    base: str,
    top: str,
    *,
    replicates: int = 2000,
    seed: int = 12345,
) -> Estimate | None:
    """``(mean_a - mean_base) / (mean_top - mean_base)``: the share of ``top``'s gain over
    ``base`` that ``a`` reaches (the same for a metric where lower is better), with a 95%
    percentile interval from the same crossed draws as :func:`paired_bootstrap`.

    ``None`` when ``top`` equals ``base`` (the caller checks that ``top`` is the better
    one, in its metric's direction). Replicates where the denominator is not of the point
    estimate's sign are left out of the interval (a share of a gain that vanished is
    undefined); if more than half are, ``None``.
    """
    for name in (a, base, top):
        if name not in values:
            raise ValueError(f"unknown strategy {name!r}")
    names, point, boots = _replicates(values, replicates, seed)
    i, b, t = names.index(a), names.index(base), names.index(top)
    gain = point[t] - point[b]
    if gain == 0:
        return None
    denom = boots[:, t] - boots[:, b]
    keep = np.sign(denom) == np.sign(gain)
    if keep.sum() * 2 < replicates:
        return None
    dist = (boots[keep, i] - boots[keep, b]) / denom[keep]
    return _estimate(float((point[i] - point[b]) / gain), dist)


def stratified_bootstrap(
    strata: Sequence[Mapping[str, Matrix]],
    pairs: list[tuple[str, str]],
    *,
    shares: Sequence[tuple[str, str, str]] = (),
    replicates: int = 2000,
    seed: int = 12345,
) -> tuple[
    dict[str, Estimate], dict[tuple[str, str], Estimate], dict[tuple[str, str, str], Estimate]
]:
    """:func:`paired_bootstrap` pooled over independent strata (worlds): each stratum is a
    ``{strategy: [seeds, units]}`` mapping of its own shape; every replicate draws seeds and
    units within each stratum independently (a stratum's crossed draw), and the pooled value
    is the *unweighted* mean of the strata's means, so each world counts once whatever its
    number of seeds or units. Returns (per strategy, per pair ``a - b``, per share
    ``(a, base, top)`` as :func:`paired_share` defines it; a share whose pooled gain
    vanishes in more than half the replicates is left out).
    """
    if not strata:
        raise ValueError("no strata to pool")
    names = list(strata[0])
    for k, stratum in enumerate(strata):
        if list(stratum) != names:
            raise ValueError(f"stratum {k} has strategies {list(stratum)}, stratum 0 has {names}")
    for a, b in pairs:
        if a not in names or b not in names:
            raise ValueError(f"unknown strategy in pair ({a}, {b})")
    for triple in shares:
        if any(n not in names for n in triple):
            raise ValueError(f"unknown strategy in share {triple}")
    point = np.zeros(len(names))
    boots = np.zeros((replicates, len(names)))
    for k, stratum in enumerate(strata):
        _, stratum_point, stratum_boots = _replicates(stratum, replicates, seed + k)
        point += stratum_point / len(strata)
        boots += stratum_boots / len(strata)
    means = {n: _estimate(point[i], boots[:, i]) for i, n in enumerate(names)}
    diffs = {
        (a, b): _estimate(
            point[names.index(a)] - point[names.index(b)],
            boots[:, names.index(a)] - boots[:, names.index(b)],
        )
        for a, b in pairs
    }
    out_shares: dict[tuple[str, str, str], Estimate] = {}
    for a, base, top in shares:
        i, j, t = names.index(a), names.index(base), names.index(top)
        gain = point[t] - point[j]
        denom = boots[:, t] - boots[:, j]
        keep = np.sign(denom) == np.sign(gain)
        if gain == 0 or keep.sum() * 2 < replicates:
            continue
        dist = (boots[keep, i] - boots[keep, j]) / denom[keep]
        out_shares[(a, base, top)] = _estimate(float((point[i] - point[j]) / gain), dist)
    return means, diffs, out_shares
