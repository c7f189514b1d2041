"""Aggregating the LoRA adapters of one backbone: OnePeFT's SVD aggregation and two baselines.

Sans-IO: state dicts in, a state dict out. The inputs are peerlm adapters as
:meth:`~peerlm.agent.modelhost.ModelHost.adapter_state` returns them (peft's names,
``<module>.lora_A.weight`` of shape ``(r_i, n)`` and ``<module>.lora_B.weight`` of shape
``(m, r_i)``), each with its LoRA ``r`` and ``alpha`` (the ``peerlm.lora`` metadata of
:mod:`peerlm.agent.adapter_codec`). A client's update of module ``W`` (``m x n``, output by
input, as peft stores A and B also for GPT-2's transposed Conv1D layers) is

    ΔW_i = s_i B_i A_i,   s_i = alpha_i / r_i.

Three aggregations, one input and output type (:class:`ClientAdapter` in,
:class:`MergedAdapter` out):

* :func:`aggregate_svd` — OnePeFT Eq. 3 (Section 3.2, Algorithm 1 phase 2):
  ``ΔW_avg = Σ λ_i s_i B_i A_i`` per module, then the rank-``r`` truncated SVD
  ``ΔW_avg ≈ U_r Σ_r V_rᵀ`` split as the paper does, ``B̃ = U_r Σ_r`` and ``Ã = V_rᵀ``.
  Clients may have different ranks (the FlexLoRA setting) and ``r`` need not be theirs.
* :func:`aggregate_fedavg_factors` — FedIT / FedPETuning: ``Ā = Σ λ_i A_i``,
  ``B̄ = Σ λ_i B_i``. ``B̄ Ā`` is not ``Σ λ_i B_i A_i`` (it adds the cross terms
  ``λ_i λ_j B_i A_j``), which is what OnePeFT's Figure 2 criticises.
* :func:`aggregate_ffa` — FFA-LoRA: A is frozen and shared, only B is averaged:
  ``B̄ Ā = Σ λ_i B_i A`` is then exact, inside the span of the shared A.

Choices the paper leaves open (also in ``docs/onepeft.md``):

* **Weights.** ``λ_i`` is the data share ``|D_i| / Σ_j |D_j|`` (Algorithm 1) unless the
  caller gives weights; either way they must be finite, non-negative, not all zero, and are
  normalised to sum 1 (:func:`normalise_weights`).
* **Scaling fold.** Each client's ``s_i`` is folded into ``ΔW_i`` before the average and
  the SVD, so clients of other ranks or alphas contribute what they actually apply. The
  output carries its own ``alpha`` for its rank ``r`` (default ``alpha = r``: scaling 1,
  the paper's factors unchanged, as peft's ``add_weighted_adapter`` does); with another
  ``alpha`` the scaling is divided out of ``B̃`` (``B̃ = U_r Σ_r · r / alpha``), so that
  ``(alpha / r) · B̃ Ã`` is the truncated ``ΔW_avg`` either way. A host with fixed
  LoRA settings passes its own ``alpha`` and ``r`` and loads the result unchanged.
* **Rank above the matrix's.** A target rank above ``min(m, n)`` pads the factors with
  zeros (the reconstruction is exact; peft's merge returns mis-shaped factors there).
* **Precision.** Products, sums, QR and SVD run in float64 on the CPU; the output tensors
  are cast to ``dtype`` (float32 by default, the codec also accepts float16 and bfloat16).

Every refusal is an :class:`~peerlm.agent.adapter_codec.AdapterError` (a ``ValueError``)
whose message names the client and module and whose ``reason`` is a metric label:
``empty`` (no adapters), ``weights``, ``lora_config`` (a bad r/alpha, or ranks or alphas
that a baseline needs equal), ``keys`` (module sets differ, or a tensor that is not a LoRA
A/B), ``shape``, ``non_finite``, ``frozen_a`` (FFA-LoRA inputs whose A differ).

Where this was written by hand and why: peft's merge
(``PeftModel.add_weighted_adapter(..., combination_type="svd")``) computes the same
``ΔW_avg`` and the same split when it is given normalised weights and no clamp (measured
in ``docs/onepeft.md``: equal to 1.7e-6), but it works on a live ``PeftModel`` holding every
client's adapter on the base model, takes the weights as given (no normalisation or
checks), runs in the adapters' dtype (``torch.linalg.svd`` accepts neither bfloat16, the
agents' CUDA dtype, nor float16), decomposes the dense ``m x n`` sum (two orders of magnitude
slower than :func:`svd_of_product` at 1024 x 1024) and mis-shapes a rank above ``min(m, n)``.
The aggregate here needs only the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import torch
from peerlm.agent.adapter_codec import AdapterError

__all__ = [
    "DEFAULT_FFA_ATOL",
    "ClientAdapter",
    "MergeMethod",
    "MergedAdapter",
    "aggregate_fedavg_factors",
    "aggregate_ffa",
    "aggregate_svd",
    "check_clients",
    "delta_weights",
    "normalise_weights",
    "svd_of_product",
]

#: Which aggregation produced a :class:`MergedAdapter`.
MergeMethod = Literal["svd", "fedavg_factors", "ffa"]

_A: Final = ".lora_A.weight"
_B: Final = ".lora_B.weight"
#: FFA-LoRA's default tolerance on the shared A: equal up to float32 rounding of a copy.
DEFAULT_FFA_ATOL: Final = 1e-6


@dataclass(frozen=True)
class ClientAdapter:
    """One client's adapter: its LoRA tensors (peft names), rank, alpha and data size.

    ``examples`` is ``|D_i|``, the size of the client's training data, which gives the
    default weight (Algorithm 1: the data share); ``None`` when the caller passes weights.
    """

    state: Mapping[str, torch.Tensor]
    r: int
    alpha: float
    examples: int | None = None
    name: str = ""

    @property
    def scaling(self) -> float:
        """``alpha / r``, the factor peft applies to ``B A``."""
        return self.alpha / self.r


@dataclass(frozen=True)
class MergedAdapter:
    """An aggregate: LoRA tensors under the inputs' names, with the ``r`` and ``alpha``
    under which ``(alpha / r) · B A`` is the aggregated update of each module.

    ``weights`` are the normalised ``λ_i`` used, in input order. ``error`` holds, per
    module, ``‖ΔW_avg − (alpha / r) B A‖_F``: how far the stored update is from the ideal
    average ``Σ λ_i ΔW_i`` (for SVD the norm of the discarded singular values, for the
    FedAvg baseline the cross terms, 0 up to rounding for FFA-LoRA).
    """

    state: dict[str, torch.Tensor]
    r: int
    alpha: float
    method: MergeMethod
    weights: tuple[float, ...]
    error: dict[str, float] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.r


# ----------------------------------------------------------------------------- validation


def normalise_weights(weights: Sequence[float]) -> tuple[float, ...]:
    """``weights / sum(weights)``; refuses non-finite, negative or all-zero weights."""
    values = [float(w) for w in weights]
    if not values:
        raise AdapterError("no weights: at least one client is needed", reason="empty")
    for i, w in enumerate(values):
        if not math.isfinite(w) or w < 0:
            raise AdapterError(
                f"weight {i} is {w}: weights must be finite and non-negative", reason="weights"
            )
    total = math.fsum(values)
    if total <= 0:
        raise AdapterError("all weights are zero", reason="weights")
    return tuple(w / total for w in values)


def _label(i: int, client: ClientAdapter) -> str:
    return f"client {i}" + (f" ({client.name})" if client.name else "")


def _weights_of(
    clients: Sequence[ClientAdapter], weights: Sequence[float] | None
) -> tuple[float, ...]:
    if weights is not None:
        if len(weights) != len(clients):
            raise AdapterError(
                f"{len(weights)} weights for {len(clients)} adapters", reason="weights"
            )
        return normalise_weights(weights)
    sizes: list[float] = []
    for i, c in enumerate(clients):
        if c.examples is None:
            raise AdapterError(
                f"{_label(i, c)} has no data size: pass weights or set examples",
                reason="weights",
            )
        sizes.append(float(c.examples))
    return normalise_weights(sizes)


def _modules(i: int, client: ClientAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` of one client, with its shapes, rank and values checked."""
    who = _label(i, client)
    if not (isinstance(client.r, int) and client.r >= 1):
        raise AdapterError(
            f"{who}: LoRA r must be a positive integer, not {client.r!r}", reason="lora_config"
        )
    if not (math.isfinite(client.alpha) and client.alpha > 0):
        raise AdapterError(
            f"{who}: LoRA alpha must be finite and positive, not {client.alpha}",
            reason="lora_config",
        )
    if not client.state:
        raise AdapterError(f"{who} has no tensors", reason="keys")
    names: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in client.state.items():
        if key.endswith(_A):
            names.setdefault(key[: -len(_A)], {})["A"] = tensor
        elif key.endswith(_B):
            names.setdefault(key[: -len(_B)], {})["B"] = tensor
        else:
            raise AdapterError(f"{who}: tensor {key} is not a LoRA A or B weight", reason="keys")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in sorted(names):
        pair = names[module]
        if "A" not in pair or "B" not in pair:
            missing = "lora_A" if "A" not in pair else "lora_B"
            raise AdapterError(f"{who}: module {module} has no {missing}", reason="keys")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != client.r or b.shape[1] != client.r:
            raise AdapterError(
                f"{who}: module {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"not (r, in) and (out, r) with r={client.r}",
                reason="shape",
            )
        for label, t in (("lora_A", a), ("lora_B", b)):
            if not torch.is_floating_point(t):
                raise AdapterError(f"{who}: module {module} {label} is {t.dtype}", reason="dtype")
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(
                    f"{who}: module {module} {label} is not finite", reason="non_finite"
                )
        out[module] = (a, b)
    return out


def _checked(
    clients: Sequence[ClientAdapter],
) -> tuple[list[dict[str, tuple[torch.Tensor, torch.Tensor]]], list[str]]:
    """Every client's modules, refusing module sets or (out, in) shapes that differ."""
    if not clients:
        raise AdapterError("no adapters to aggregate (K = 0)", reason="empty")
    per_client = [_modules(i, c) for i, c in enumerate(clients)]
    first = per_client[0]
    order = list(first)
    for i, mods in enumerate(per_client[1:], start=1):
        missing = sorted(set(first) - set(mods))
        extra = sorted(set(mods) - set(first))
        if missing or extra:
            what = f"lacks module {missing[0]}" if missing else f"has extra module {extra[0]}"
            raise AdapterError(
                f"{_label(i, clients[i])} {what} (client 0 has {len(first)} modules, "
                f"it has {len(mods)})",
                reason="keys",
            )
        for module in order:
            a0, b0 = first[module]
            a, b = mods[module]
            if (b.shape[0], a.shape[1]) != (b0.shape[0], a0.shape[1]):
                raise AdapterError(
                    f"{_label(i, clients[i])}: module {module} is "
                    f"{b.shape[0]}x{a.shape[1]} (out x in), client 0's is "
                    f"{b0.shape[0]}x{a0.shape[1]}",
                    reason="shape",
                )
    return per_client, order


def check_clients(
    clients: Sequence[ClientAdapter], weights: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Check ``clients`` as every aggregation does and return their normalised weights.

    Same module set and (out, in) shapes for all, A and B of each client's rank, finite
    floating-point values; weights as in :func:`aggregate_svd`. Raises
    :class:`AdapterError` naming the client and module.
    """
    _checked(clients)
    return _weights_of(clients, weights)


def _check_output(r: int, alpha: float | None) -> float:
    if not (isinstance(r, int) and r >= 1):
        raise AdapterError(
            f"target rank must be a positive integer, not {r!r}", reason="lora_config"
        )
    out_alpha = float(r) if alpha is None else float(alpha)
    if not (math.isfinite(out_alpha) and out_alpha > 0):
        raise AdapterError(
            f"output alpha must be finite and positive, not {alpha}", reason="lora_config"
        )
    return out_alpha


def _same_lora(clients: Sequence[ClientAdapter], method: str) -> tuple[int, float]:
    r0, alpha0 = clients[0].r, clients[0].alpha
    for i, c in enumerate(clients[1:], start=1):
        if c.r != r0 or not math.isclose(c.alpha, alpha0):
            raise AdapterError(
                f"{method} averages the factors themselves and needs equal LoRA r and alpha: "
                f"client 0 has r={r0}, alpha={alpha0}; {_label(i, c)} r={c.r}, alpha={c.alpha}",
                reason="lora_config",
            )
    return r0, alpha0


# ---------------------------------------------------------------------------------- maths


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


def _delta_avg(
    per_client: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    clients: Sequence[ClientAdapter],
    lam: Sequence[float],
    module: str,
) -> torch.Tensor:
    """``Σ λ_i s_i B_i A_i`` of one module, accumulated in float64 (one m x n buffer)."""
    total: torch.Tensor | None = None
    for mods, c, w in zip(per_client, clients, lam, strict=True):
        a, b = mods[module]
        term = (w * c.scaling) * (_f64(b) @ _f64(a))
        total = term if total is None else total.add_(term)
    assert total is not None  # _checked refuses K = 0
    return total


def delta_weights(
    state: Mapping[str, torch.Tensor], *, r: int, alpha: float
) -> dict[str, torch.Tensor]:
    """``{module: (alpha / r) B A}`` in float64, ``(out, in)`` per module: the update an
    adapter applies (peft's ``get_delta_weight`` before Conv1D's transpose)."""
    (mods,), order = _checked([ClientAdapter(state, r, alpha)])
    return {m: (alpha / r) * (_f64(mods[m][1]) @ _f64(mods[m][0])) for m in order}


def _stacked(
    per_client: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    clients: Sequence[ClientAdapter],
    lam: Sequence[float],
    module: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_cat, A_cat)`` with ``B_cat A_cat = Σ λ_i s_i B_i A_i``: the clients' factors side
    by side (``m x R`` and ``R x n``, ``R = Σ r_i``), each B scaled by ``λ_i s_i``."""
    bs = [
        (w * c.scaling) * _f64(mods[module][1])
        for mods, c, w in zip(per_client, clients, lam, strict=True)
    ]
    as_ = [_f64(mods[module][0]) for mods in per_client]
    return torch.cat(bs, dim=1), torch.cat(as_, dim=0)


def svd_of_product(
    b: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``U diag(S) Vh`` of ``b @ a`` (``m x R`` times ``R x n``) without forming
    the ``m x n`` product: ``b = Q_b R_b``, ``aᵀ = Q_a R_a``, so ``b a = Q_b (R_b R_aᵀ) Q_aᵀ``
    and only the small core ``R_b R_aᵀ`` is decomposed. ``O((m + n) R²)`` instead of the
    ``O(m n min(m, n))`` of a dense SVD; the same singular values and subspaces up to
    rounding (and the sign of each singular pair). At most ``min(m, n, R)`` values."""
    qb, rb = torch.linalg.qr(b, mode="reduced")
    qa, ra = torch.linalg.qr(a.T, mode="reduced")
    u, s, vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)
    return qb @ u, s, vh @ qa.T


def aggregate_svd(
    clients: Sequence[ClientAdapter],
    *,
    r: int,
    alpha: float | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> MergedAdapter:
    """OnePeFT's SVD-based aggregation (Eq. 3) to rank ``r`` (see the module docstring).

    Per module: ``ΔW_avg = Σ λ_i (alpha_i / r_i) B_i A_i``; ``U Σ Vᵀ = SVD(ΔW_avg)``;
    ``B̃ = U_r Σ_r · r / alpha``, ``Ã = V_rᵀ`` (``alpha`` defaults to ``r``: scaling 1, the
    paper's split exactly). Clients may have different ranks; by Eckart–Young the stored
    update is the best rank-``r`` approximation of ``ΔW_avg`` in Frobenius norm, exact when
    ``r`` is at least the rank of ``ΔW_avg``. The SVD is taken of the factored sum
    (:func:`svd_of_product`), never of a dense ``m x n`` matrix.
    """
    out_alpha = _check_output(r, alpha)
    per_client, order = _checked(clients)
    lam = _weights_of(clients, weights)
    scale_out = out_alpha / r
    state: dict[str, torch.Tensor] = {}
    error: dict[str, float] = {}
    for module in order:
        b_cat, a_cat = _stacked(per_client, clients, lam, module)
        u, s, vh = svd_of_product(b_cat, a_cat)
        k = min(r, s.shape[0])
        b = torch.zeros((b_cat.shape[0], r), dtype=torch.float64)
        a = torch.zeros((r, a_cat.shape[1]), dtype=torch.float64)
        b[:, :k] = u[:, :k] * (s[:k] / scale_out)
        a[:k, :] = vh[:k, :]
        error[module] = float(torch.linalg.vector_norm(s[k:]))
        state[module + _A] = a.to(dtype).contiguous()
        state[module + _B] = b.to(dtype).contiguous()
    return MergedAdapter(state, r, out_alpha, "svd", lam, error)


def _factor_average(
    per_client: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    lam: Sequence[float],
    module: str,
    which: int,
) -> torch.Tensor:
    total = torch.zeros_like(_f64(per_client[0][module][which]))
    for mods, w in zip(per_client, lam, strict=True):
        total.add_(w * _f64(mods[module][which]))
    return total


def _finish(
    clients: Sequence[ClientAdapter],
    per_client: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    order: Sequence[str],
    lam: tuple[float, ...],
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    r: int,
    alpha: float,
    method: MergeMethod,
    dtype: torch.dtype,
) -> MergedAdapter:
    state: dict[str, torch.Tensor] = {}
    error: dict[str, float] = {}
    for module in order:
        a, b = factors[module]
        ideal = _delta_avg(per_client, clients, lam, module)
        error[module] = float(torch.linalg.matrix_norm(ideal - (alpha / r) * (b @ a)))
        state[module + _A] = a.to(dtype).contiguous()
        state[module + _B] = b.to(dtype).contiguous()
    return MergedAdapter(state, r, alpha, method, lam, error)


def aggregate_fedavg_factors(
    clients: Sequence[ClientAdapter],
    *,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> MergedAdapter:
    """FedIT / FedPETuning: ``Ā = Σ λ_i A_i``, ``B̄ = Σ λ_i B_i`` per module.

    Needs every client at the same ``r`` and ``alpha`` (the factors of other ranks do not
    add up, and of other scalings mean other things); the output keeps them. The update it
    stores, ``s B̄ Ā``, differs from ``Σ λ_i s B_i A_i`` by the cross terms; ``error`` holds
    that difference per module.
    """
    per_client, order = _checked(clients)
    r, alpha = _same_lora(clients, "FedAvg of LoRA factors")
    lam = _weights_of(clients, weights)
    factors = {
        m: (_factor_average(per_client, lam, m, 0), _factor_average(per_client, lam, m, 1))
        for m in order
    }
    return _finish(clients, per_client, order, lam, factors, r, alpha, "fedavg_factors", dtype)


def aggregate_ffa(
    clients: Sequence[ClientAdapter],
    *,
    weights: Sequence[float] | None = None,
    atol: float = DEFAULT_FFA_ATOL,
    dtype: torch.dtype = torch.float32,
) -> MergedAdapter:
    """FFA-LoRA: A frozen and shared by all clients, ``B̄ = Σ λ_i B_i``; the output's A is
    client 0's.

    Refuses (reason ``frozen_a``) clients whose A differs from client 0's by more than
    ``atol`` in any entry: FFA-LoRA presumes one shared, frozen A, and averaging only B over
    different A's would be silently wrong. Needs equal ``r`` and ``alpha``.
    """
    if not (math.isfinite(atol) and atol >= 0):
        raise AdapterError(
            f"atol must be finite and non-negative, not {atol}", reason="lora_config"
        )
    per_client, order = _checked(clients)
    r, alpha = _same_lora(clients, "FFA-LoRA")
    lam = _weights_of(clients, weights)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in order:
        a0 = _f64(per_client[0][module][0])
        for i, mods in enumerate(per_client[1:], start=1):
            gap = float((_f64(mods[module][0]) - a0).abs().max())
            if gap > atol:
                raise AdapterError(
                    f"FFA-LoRA needs one frozen A: {_label(i, clients[i])}'s A of module "
                    f"{module} differs from client 0's by {gap:.3g} (> atol {atol:.3g})",
                    reason="frozen_a",
                )
        factors[module] = (a0, _factor_average(per_client, lam, module, 1))
    return _finish(clients, per_client, order, lam, factors, r, alpha, "ffa", dtype)
