"""Synthetic clustered non-IID signature populations for the simulator and the benchmark.

:class:`ClusteredPopulation` draws model vectors ``w`` in ``R^M`` with a two-level latent
structure, like data classes inside super-classes: ``groups`` super-centres ``g_a ~ N(0, I)``,
``clusters`` cluster centres ``c = g_a + cluster_spread * z`` spread round-robin over the
groups, and members ``w = c + member_noise * e``. Each member's signature is its Top-P
masked vector by magnitude (``make_signature(w, |w|, P)``, i.e. ``beta = 0``), and its
``P_min`` is Alg. 1's minimal P for ``tau_min``. Members are assigned to clusters
round-robin (balanced), or by a Dirichlet draw of cluster sizes (``size_alpha``).

:func:`population_from_vectors` builds signatures from real vectors (e.g. flattened LoRA
adapters from :func:`~peerlm.overlay.signature.flatten_adapter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from peerlm.overlay.signature import Signature, make_signature, minimal_p

__all__ = ["ClusteredPopulation", "Member", "PopulationSpec", "population_from_vectors"]


@dataclass(frozen=True, slots=True)
class PopulationSpec:
    """Shape of a synthetic population (defaults: 10 clusters in 5 super-groups)."""

    dim: int = 1024
    p_fraction: float = 0.12
    clusters: int = 10
    groups: int = 5
    cluster_spread: float = 0.9
    member_noise: float = 0.55
    size_alpha: float | None = None
    tau_min: float = 0.8
    space: str = "synthetic"

    def __post_init__(self) -> None:
        if self.dim < 2 or not 0 < self.p_fraction <= 1:
            raise ValueError("need dim >= 2 and 0 < p_fraction <= 1")
        if self.clusters < 1 or not 1 <= self.groups <= self.clusters:
            raise ValueError("need clusters >= 1 and 1 <= groups <= clusters")

    @property
    def p(self) -> int:
        return max(1, round(self.p_fraction * self.dim))


@dataclass(frozen=True, slots=True)
class Member:
    """One synthetic peer: its latent cluster, model vector, signature and ``P_min``."""

    cluster: int
    vector: npt.NDArray[np.float64]
    signature: Signature
    p_min: int


class ClusteredPopulation:
    """A seeded generator of clustered members (see the module docstring)."""

    def __init__(self, spec: PopulationSpec, seed: int) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(seed)
        groups = self._rng.standard_normal((spec.groups, spec.dim))
        self.centres = np.stack(
            [
                groups[c % spec.groups] + spec.cluster_spread * self._rng.standard_normal(spec.dim)
                for c in range(spec.clusters)
            ]
        )
        if spec.size_alpha is None:
            self._weights = np.full(spec.clusters, 1.0 / spec.clusters)
        else:
            self._weights = self._rng.dirichlet(np.full(spec.clusters, spec.size_alpha))
        self._next = 0

    def member(self, cluster: int) -> Member:
        """A new member of latent cluster ``cluster``."""
        spec = self.spec
        w = self.centres[cluster] + spec.member_noise * self._rng.standard_normal(spec.dim)
        scores = np.abs(w)
        sig = make_signature(w, scores, spec.p, spec.space)
        p_min = minimal_p(w, scores, spec.tau_min)
        return Member(cluster, w, sig, int(p_min))

    def draw(self, n: int) -> list[Member]:
        """``n`` members: balanced round-robin over clusters, or by the Dirichlet sizes."""
        out = []
        for _ in range(n):
            if self.spec.size_alpha is None:
                cluster = self._next % self.spec.clusters
                self._next += 1
            else:
                cluster = int(self._rng.choice(self.spec.clusters, p=self._weights))
            out.append(self.member(cluster))
        return out

    def drift(self, member: Member, amount: float) -> Member:
        """``member`` after one round of drift: ``w += amount * noise``."""
        spec = self.spec
        w = member.vector + amount * spec.member_noise * self._rng.standard_normal(spec.dim)
        scores = np.abs(w)
        return Member(
            member.cluster,
            w,
            make_signature(w, scores, spec.p, spec.space),
            int(minimal_p(w, scores, spec.tau_min)),
        )


def population_from_vectors(
    vectors: Sequence[npt.ArrayLike], p: int, space: str, tau_min: float = 0.8
) -> list[Member]:
    """Members from real model vectors (cluster label -1: unknown)."""
    out = []
    for v in vectors:
        w = np.asarray(v, dtype=np.float64)
        scores = np.abs(w)
        out.append(
            Member(-1, w, make_signature(w, scores, p, space), int(minimal_p(w, scores, tau_min)))
        )
    return out
