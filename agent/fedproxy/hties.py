"""FedProxy's server-side analysis (Eq. 5–7), H-TIES merging (Eq. 10–14) and two baselines.

Sans-IO: state dicts in, a state dict out. The inputs are the global proxy of the previous
round ``φ^(t−1)`` and the cohort's trained proxies ``φ_k`` (the same keys and shapes); the
output is the next global proxy and the analysis the owner publishes with it.

* :func:`task_vectors` — ``τ_k = φ_k − φ^(t−1)`` over the floating-point tensors, float64.
* :func:`analyse` — Eq. 5–7: pairwise cosine ``S_kj`` of the flattened task vectors,
  heterogeneity ``h_k = 1 − (1/(K−1)) Σ_{j≠k} max(0, S_kj)`` and its min–max normalisation,
  weights ``w_k = softmax_k(Σ_{j≠k} |S_kj|)`` and per-parameter conflict
  ``C_d = 1 − |Σ_k sign(τ_k[d])| / K``.
* :func:`retention` — Eq. 10: ``r_k = clip(r0 − δ · h_k,norm, 0, 1)``.
* :func:`dominant_sign_merge` — Eq. 11–13 for one tensor: ``τ̂_k = w_k τ̃_k``, the
  positive and negative mass ``P_d``, ``N_d``, and the weighted mean of the entries of the
  dominant sign when its mass is at least ``ρ`` times the other's (plus ``ε``), else 0.
* :func:`h_ties` — the whole round: analysis, magnitude sparsification of each ``τ_k`` to
  its ``r_k`` (peft's ``prune``), Eq. 11–13, and Eq. 14 ``φ^(t) = φ^(t−1) + Δφ``.
* :func:`support_clip` — not the paper's: a per-coordinate robust step before the merge
  (``h_ties(..., robust=True)``, what the FedProxy owner uses): no coordinate moves further
  than a second client moved it, so one hostile client cannot set a coordinate alone.
* Baselines: :func:`fedavg_proxies` (plain FedAvg of the proxies) and :func:`ties_merge`
  (TIES without the heterogeneity terms: peft's ``ties``, uniform weights and density).

What comes from ``peft.utils.merge_utils`` and what is written here: the sparsification of
Eq. 10's step is ``prune(τ, r_k, "magnitude")`` (top ``int(r_k · numel)`` entries of each
tensor by magnitude), exactly the TIES trim step with a per-client density. Eq. 12–13 are
written by hand: peft's ``calculate_majority_sign_mask`` elects the sign of the sum with no
dominance threshold (``ρ``, ``ε``), and its ``disjoint_merge`` divides by the *number* of
agreeing clients, where Eq. 13 divides by the sum of their *weights* ``w_k``. The TIES
baseline is peft's ``ties`` unchanged. The analysis (Eq. 5–7) has no library counterpart.

Choices the paper leaves open (also in ``docs/fedproxy.md``): the cosine of a zero task
vector is 0; with one client ``h = 0``; when every ``h_k`` is equal (within ``1e-9``: the
rounding of sums taken in another client order must not decide) the normalised ``h`` is 0
for all (so ``r_k = r0``), and rates are rounded to 9 decimals (float64 noise must not
change how many entries a small tensor keeps); the sparsification is per tensor, not over
the whole vector; ``ε = 1e-12`` (compared in float64); non-floating tensors (none in the
bundled models) must equal the base's and are kept. Every refusal is a
:class:`~peerlm.agent.fedproxy.proxy.ProxyError` with a metric label as ``reason``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from peerlm.agent.fedproxy.proxy import ProxyError
from peft.utils.merge_utils import prune, ties

__all__ = [
    "DEFAULT_DELTA",
    "DEFAULT_EPSILON",
    "DEFAULT_R0",
    "DEFAULT_RHO",
    "CohortAnalysis",
    "HTiesResult",
    "analyse",
    "conflict_scores",
    "dominant_sign_merge",
    "fedavg_proxies",
    "h_ties",
    "retention",
    "support_clip",
    "task_vectors",
    "ties_merge",
]

#: Appendix B.1: base retention rate r0, heterogeneity penalty δ, consensus reward ρ.
DEFAULT_R0: Final = 1.0
DEFAULT_DELTA: Final = 0.2
DEFAULT_RHO: Final = 1.1
#: Eq. 13's stability constant (the paper gives no value): far below any float32 update.
DEFAULT_EPSILON: Final = 1e-12

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class CohortAnalysis:
    """Eq. 5–7 for one round, clients in input order.

    ``similarity`` is ``S`` (``K x K``, float64, ones on the diagonal for non-zero task
    vectors); ``conflict`` holds ``C_d`` per floating tensor (float32, the shape of the
    tensor), which the owner sends to clients for PCR (Eq. 9) in the next round.
    """

    similarity: torch.Tensor
    heterogeneity: tuple[float, ...]
    heterogeneity_norm: tuple[float, ...]
    weights: tuple[float, ...]
    conflict: dict[str, torch.Tensor]


@dataclass(frozen=True)
class HTiesResult:
    """The next global proxy ``φ^(t)`` (Eq. 14), the analysis, and ``r_k`` used."""

    state: dict[str, torch.Tensor]
    analysis: CohortAnalysis
    retention: tuple[float, ...]


# ----------------------------------------------------------------------------- inputs


def _check(base: StateDict, clients: Sequence[StateDict]) -> list[str]:
    """The floating keys to merge, after checking every client against ``base``."""
    if not clients:
        raise ProxyError("no client proxies to merge", reason="empty")
    for key, value in base.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ProxyError(f"base {key}: non-finite values", reason="non_finite")
    for k, state in enumerate(clients):
        if set(state) != set(base):
            extra = sorted(set(state) - set(base))[:3]
            lacking = sorted(set(base) - set(state))[:3]
            raise ProxyError(
                f"client {k}: keys differ from the global proxy (extra {extra}, missing {lacking})",
                reason="keys",
            )
        for key, value in state.items():
            if tuple(value.shape) != tuple(base[key].shape):
                raise ProxyError(
                    f"client {k} {key}: shape {tuple(value.shape)}, expected "
                    f"{tuple(base[key].shape)}",
                    reason="shape",
                )
            if value.is_floating_point() != base[key].is_floating_point():
                raise ProxyError(f"client {k} {key}: dtype {value.dtype}", reason="dtype")
            if value.is_floating_point():
                if not bool(torch.isfinite(value).all()):
                    raise ProxyError(f"client {k} {key}: non-finite values", reason="non_finite")
            elif not torch.equal(value, base[key]):
                raise ProxyError(
                    f"client {k} {key}: a non-floating tensor differs from the global proxy",
                    reason="keys",
                )
    return sorted(k for k, v in base.items() if v.is_floating_point())


def task_vectors(base: StateDict, clients: Sequence[StateDict]) -> list[dict[str, torch.Tensor]]:
    """``τ_k = φ_k − φ^(t−1)`` for every floating tensor, in float64 on the CPU."""
    keys = _check(base, clients)
    return [
        {
            key: state[key].detach().to("cpu", torch.float64)
            - base[key].detach().to("cpu", torch.float64)
            for key in keys
        }
        for state in clients
    ]


# ----------------------------------------------------------------------------- Eq. 5–7


#: Decimal digits kept of a retention rate (Eq. 10).
_RATE_DIGITS = 9
#: Heterogeneities whose spread is at most this are equal (they lie in [0, 1]).
_EQUAL_HETEROGENEITY = 1e-9


def _flat(tau: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tau[key].reshape(-1) for key in sorted(tau)])


def analyse(taus: Sequence[Mapping[str, torch.Tensor]]) -> CohortAnalysis:
    """Eq. 5–7 from the clients' task vectors (the same keys and shapes)."""
    if not taus:
        raise ProxyError("no task vectors", reason="empty")
    count = len(taus)
    flat = torch.stack([_flat(t).to(torch.float64) for t in taus])
    norms = flat.norm(dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = flat / safe[:, None]
    # A zero vector's row and column are 0; rounding can put a cosine just past +-1.
    similarity = (unit @ unit.T).clamp(-1.0, 1.0)
    off = ~torch.eye(count, dtype=torch.bool)
    if count == 1:
        hetero = torch.zeros(1, dtype=torch.float64)
    else:
        positive = torch.where(off, similarity.clamp(min=0.0), torch.zeros_like(similarity))
        hetero = 1.0 - positive.sum(dim=1) / (count - 1)
    spread = hetero.max() - hetero.min()
    # h lies in [0, 1]; equal heterogeneities computed in another order differ by float64
    # rounding (~1e-16), which min-max normalisation would blow up to 0 versus 1.
    if float(spread) > _EQUAL_HETEROGENEITY:
        hetero_norm = (hetero - hetero.min()) / spread
    else:
        hetero_norm = torch.zeros_like(hetero)
    consensus = torch.where(off, similarity.abs(), torch.zeros_like(similarity)).sum(dim=1)
    weights = torch.softmax(consensus, dim=0)
    conflict: dict[str, torch.Tensor] = {}
    for key in sorted(taus[0]):
        signs = torch.stack([t[key].sign() for t in taus]).sum(dim=0)
        conflict[key] = conflict_scores(signs.abs(), count)
    return CohortAnalysis(
        similarity=similarity,
        heterogeneity=tuple(float(v) for v in hetero),
        heterogeneity_norm=tuple(float(v) for v in hetero_norm),
        weights=tuple(float(v) for v in weights),
        conflict=conflict,
    )


# ----------------------------------------------------------------------------- Eq. 10–14


def _check_parameters(r0: float, delta: float, rho: float, epsilon: float) -> None:
    if not (math.isfinite(r0) and r0 >= 0.0):
        raise ProxyError(f"r0 must be finite and >= 0, got {r0}", reason="parameters")
    if not (math.isfinite(delta) and delta >= 0.0):
        raise ProxyError(f"delta must be finite and >= 0, got {delta}", reason="parameters")
    if not (math.isfinite(rho) and rho >= 1.0):
        raise ProxyError(f"rho must be >= 1 (Eq. 13), got {rho}", reason="parameters")
    if not (math.isfinite(epsilon) and epsilon > 0.0):
        raise ProxyError(f"epsilon must be > 0, got {epsilon}", reason="parameters")


def conflict_scores(agreement: torch.Tensor, count: int) -> torch.Tensor:
    """Eq. 7, ``C_d = 1 − |Σ_k sign(τ_k[d])| / K``, from ``agreement = |Σ_k sign(τ_k[d])|``
    (whole numbers in [0, K]) and ``count = K``, as float32.

    The one formula for the scores: :func:`analyse` computes them with it, and the payload
    codec (:mod:`peerlm.agent.fedproxy.codec`), which sends ``K − agreement`` in one byte,
    rebuilds them with it, so a decoded score is bit for bit the one the owner computed.
    """
    return (1.0 - agreement.to(torch.float64) / count).to(torch.float32)


def retention(
    heterogeneity_norm: Sequence[float], *, r0: float = DEFAULT_R0, delta: float = DEFAULT_DELTA
) -> tuple[float, ...]:
    """Eq. 10: ``r_k = max(0, min(1, r0 − δ · h_k,norm))``, rounded to 1e-9.

    The rounding keeps float64 noise out of the sparsification: a rate of 1 − 1e-16 (equal
    heterogeneities summed in another client order) would otherwise keep one entry fewer
    of a small tensor than a rate of 1 (peft's magnitude prune keeps ``int(r · n)``).
    """
    _check_parameters(r0, delta, DEFAULT_RHO, DEFAULT_EPSILON)
    return tuple(
        round(max(0.0, min(1.0, r0 - delta * float(h))), _RATE_DIGITS) for h in heterogeneity_norm
    )


def dominant_sign_merge(
    sparse: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    rho: float = DEFAULT_RHO,
    epsilon: float = DEFAULT_EPSILON,
) -> torch.Tensor:
    """Eq. 11–13 for one tensor: ``Δφ`` from the sparsified updates ``τ̃_k`` and ``w_k``.

    ``τ̂_k = w_k τ̃_k``; ``P_d`` and ``N_d`` are the positive and negative mass of ``τ̂``;
    where ``P_d / (N_d + ε) ≥ ρ`` the result is ``Σ_{τ̂_k[d] > 0} τ̂_k[d] / Σ_{τ̂_k[d] > 0}
    w_k``, where ``N_d / (P_d + ε) ≥ ρ`` the same over the negative entries, else 0. With
    ``ρ ≥ 1`` at most one sign can dominate. Float64 in, float64 out.
    """
    _check_parameters(DEFAULT_R0, DEFAULT_DELTA, rho, epsilon)
    if len(sparse) != len(weights) or not sparse:
        raise ProxyError(f"{len(sparse)} updates for {len(weights)} weights", reason="empty")
    for k, value in enumerate(weights):
        if not (math.isfinite(value) and value > 0):
            raise ProxyError(f"weight {k} is {value}: weights must be > 0", reason="weights")
    stacked = torch.stack([s.to(torch.float64) for s in sparse])
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64).reshape(
        (-1,) + (1,) * (stacked.dim() - 1)
    )
    hat = w * stacked  # Eq. 11
    pos, neg = hat > 0, hat < 0
    p_mass = torch.where(pos, hat, 0.0).sum(dim=0)  # Eq. 12
    n_mass = torch.where(neg, -hat, 0.0).sum(dim=0)
    w_pos = torch.where(pos, w.expand_as(hat), 0.0).sum(dim=0)
    w_neg = torch.where(neg, w.expand_as(hat), 0.0).sum(dim=0)
    positive_wins = p_mass / (n_mass + epsilon) >= rho  # Eq. 13
    negative_wins = n_mass / (p_mass + epsilon) >= rho
    up = p_mass / torch.where(w_pos > 0, w_pos, 1.0)
    down = -n_mass / torch.where(w_neg > 0, w_neg, 1.0)
    return torch.where(positive_wins, up, torch.where(negative_wins, down, 0.0))


def _sparsify(tensor: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1.0:  # peft warns and returns the tensor: the same, without the warning
        return tensor
    return prune(tensor, density, method="magnitude")


def _apply(base: StateDict, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Eq. 14: ``φ^(t−1) + Δφ`` in the base's dtype and device; other tensors kept."""
    out: dict[str, torch.Tensor] = {}
    for key, value in base.items():
        if key in delta:
            merged = value.detach().to("cpu", torch.float64) + delta[key]
            out[key] = merged.to(dtype=value.dtype, device=value.device)
        else:
            out[key] = value.detach().clone()
    return out


def h_ties(
    base: StateDict,
    clients: Sequence[StateDict],
    *,
    r0: float = DEFAULT_R0,
    delta: float = DEFAULT_DELTA,
    rho: float = DEFAULT_RHO,
    epsilon: float = DEFAULT_EPSILON,
    robust: bool = False,
) -> HTiesResult:
    """One FedProxy aggregation round (Algorithm 1, lines 16–21).

    ``base`` is ``φ^(t−1)``, ``clients`` the cohort's ``φ_k``. Returns ``φ^(t)``, the
    analysis (``C_d`` for the next round's PCR) and the retention rates ``r_k``.

    ``robust``: the task vectors pass :func:`support_clip` first (before the analysis, so
    that one client's outsized entries weigh neither in ``S``, ``h``, ``w`` nor in Eq. 13):
    no coordinate then moves further than a second client moved it. The paper's H-TIES is
    ``robust=False``; a FedProxy owner merges with ``robust=True`` (docs/fedproxy.md,
    "Hostile members").
    """
    _check_parameters(r0, delta, rho, epsilon)
    taus = task_vectors(base, clients)
    if robust:
        taus = support_clip(taus)
    analysis = analyse(taus)
    rates = retention(analysis.heterogeneity_norm, r0=r0, delta=delta)
    merged: dict[str, torch.Tensor] = {}
    for key in taus[0]:
        sparse = [_sparsify(tau[key], rate) for tau, rate in zip(taus, rates, strict=True)]
        merged[key] = dominant_sign_merge(sparse, analysis.weights, rho=rho, epsilon=epsilon)
    return HTiesResult(state=_apply(base, merged), analysis=analysis, retention=rates)


def support_clip(taus: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each client's entry clipped, coordinate by coordinate, to the largest magnitude any
    *other* client has there (its sign kept): ``τ'_k[d] = sign(τ_k[d]) · min(|τ_k[d]|,
    max_{j≠k} |τ_j[d]|)``.

    Only the single largest entry of a coordinate can exceed the others, so this is: the
    largest magnitude is cut to the second largest. Why: a coordinate one client alone
    moves (a competitor's vocabulary rows, say) is a coordinate the merge has no evidence
    for but that client's word; after the clip no coordinate of Eq. 13's weighted mean of
    agreeing entries exceeds what a second client moved it, so one hostile client is
    bounded by the honest clients' own steps, per coordinate, whatever its total norm. The
    cost: a coordinate only one client learns is not learnt (with two clients every
    coordinate moves by the smaller of the two steps). One client (``K = 1``) is returned
    as is (nothing to corroborate against; the owner's other checks hold). Float64 in,
    float64 out; the clients' keys and shapes are the same (:func:`task_vectors`).
    """
    if len(taus) < 2:
        return [dict(t) for t in taus]
    out: list[dict[str, torch.Tensor]] = [{} for _ in taus]
    for key in taus[0]:
        stacked = torch.stack([t[key].to(torch.float64) for t in taus])
        magnitude = stacked.abs()
        second = torch.topk(magnitude, 2, dim=0).values[1]
        clipped = stacked.sign() * torch.minimum(magnitude, second)
        for k in range(len(taus)):
            out[k][key] = clipped[k]
    return out


# ----------------------------------------------------------------------------- baselines


def fedavg_proxies(
    base: StateDict, clients: Sequence[StateDict], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Plain FedAvg of the proxies: ``Σ λ_k φ_k`` (``λ`` normalised; uniform by default).

    Computed as ``φ^(t−1) + Σ λ_k τ_k``, the same thing, so that non-floating tensors and
    the checks are shared with :func:`h_ties`.
    """
    taus = task_vectors(base, clients)
    lam = [1.0] * len(taus) if weights is None else [float(w) for w in weights]
    if len(lam) != len(taus):
        raise ProxyError(f"{len(lam)} weights for {len(taus)} clients", reason="weights")
    if any(not math.isfinite(w) or w < 0 for w in lam) or math.fsum(lam) <= 0:
        raise ProxyError(f"weights {lam} must be finite, >= 0, not all 0", reason="weights")
    total = math.fsum(lam)
    delta: dict[str, torch.Tensor] = {}
    for key in taus[0]:
        acc = torch.zeros_like(taus[0][key])
        for w, tau in zip(lam, taus, strict=True):
            acc += (w / total) * tau[key]
        delta[key] = acc
    return _apply(base, delta)


def ties_merge(
    base: StateDict, clients: Sequence[StateDict], *, density: float = DEFAULT_R0
) -> dict[str, torch.Tensor]:
    """TIES without the heterogeneity terms: peft's ``ties`` on the task vectors, uniform
    weights, one density for every client (default ``r0`` = 1: no trim, so the only
    difference from :func:`h_ties` is the missing ``h``, ``w`` and ``ρ``; 0.2 is TIES'
    own default), sign elected by total mass, disjoint mean; then Eq. 14."""
    if not (math.isfinite(density) and 0.0 <= density <= 1.0):
        raise ProxyError(f"density must be in [0, 1], got {density}", reason="parameters")
    taus = task_vectors(base, clients)
    ones = torch.ones(len(taus), dtype=torch.float64)
    delta: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft warns at density 1 (no trim)
        for key in taus[0]:
            delta[key] = ties([tau[key] for tau in taus], ones, density, "total")
    return _apply(base, delta)
