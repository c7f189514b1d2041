"""FedWave's collaborative loss (Eq. 2-6): the VCLayers learn the value chain's structure.

    L_total = L_SFT + γ · L_VC                                         (Eq. 2)
    L_VC    = λ_pos · L_pos + λ_cont · L_cont + λ_cons · L_cons        (Eq. 3)
    L_pos   = Σ_i (cos(e_i, e_{i+1}) − T_pos^(i))²                      (Eq. 4)
    L_cont  = Σ_i (cos(vec W_q,i, vec W_q,i+1) − T_cont)²               (Eq. 5)
    L_cons  = (cos(f_i(H̄), f_{i−1}(H̄)) − T_cons)²,  i > 0             (Eq. 6)

Sans-IO: tensors in, scalar tensors out. :func:`positional_loss`, :func:`continuity_loss`
and :func:`consistency_loss` are the equations over whatever they are given;
:func:`local_vc_loss` is what an agent at stage i computes each step from its own VCLayer
and the adjacent stages' VCLayers pulled this round (detached: a neighbour's parameters are
fixed during our step). The terms of Eq. 4-5 between two *other* stages carry no gradient to
agent i's parameters, so summing only the (at most two) pairs that involve stage i gives
exactly the gradient of the full sums. ``f_i`` and ``f_{i−1}`` are applied to the same input:
agent i's hidden states ``H`` (only the predecessor's VCLayer travels, never its data or
LoRA adapter); ``f`` is the mean-pooled branch output (:meth:`VCLayer.pooled_branch`). Eq. 6
is averaged over the batch.

Defaults (Section 4.4 where it gives them; docs/fedwave.md argues the others): γ = 0.5,
λ_pos = λ_cont = 0.1, λ_cons = 0.1 (Figure 2: robust to λ_cons, the same weight as the
others), T_pos = 0.5 (adjacent roles related but distinguishable: 1 would merge their
embeddings, 0 make them unrelated), T_cont = 0.9 ("a high target similarity"), T_cons = 0.8
(successive outputs should agree, a little less than the attention projections: the stages
do produce different things).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peerlm.agent.fedwave.params import CollabLossSettings
from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = [
    "CollabLossSettings",
    "VCLossTerms",
    "consistency_loss",
    "continuity_loss",
    "local_vc_loss",
    "positional_loss",
    "total_loss",
]

_EPS = 1e-8


@dataclass(frozen=True)
class VCLossTerms:
    """The three terms of Eq. 3 and their weighted sum ``L_VC``."""

    pos: torch.Tensor
    cont: torch.Tensor
    cons: torch.Tensor
    total: torch.Tensor


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.reshape(-1), b.reshape(-1), dim=0, eps=_EPS)


def _targets(target: float | Sequence[float], pairs: int) -> list[float]:
    if isinstance(target, int | float):
        return [float(target)] * pairs
    values = [float(t) for t in target]
    if len(values) != pairs:
        raise ValueError(f"{len(values)} targets for {pairs} adjacent pairs")
    return values


def positional_loss(
    embeddings: Sequence[torch.Tensor], target: float | Sequence[float]
) -> torch.Tensor:
    """Eq. 4 over stage embeddings in workflow order; ``target`` is one T_pos or one per pair."""
    if len(embeddings) < 2:
        raise ValueError("L_pos needs at least two stage embeddings")
    targets = _targets(target, len(embeddings) - 1)
    terms = [(_cos(embeddings[i], embeddings[i + 1]) - t) ** 2 for i, t in enumerate(targets)]
    return torch.stack(terms).sum()


def continuity_loss(queries: Sequence[torch.Tensor], target: float) -> torch.Tensor:
    """Eq. 5 over the stages' ``W_q`` in workflow order (cosine of the flattened matrices)."""
    if len(queries) < 2:
        raise ValueError("L_cont needs at least two stages")
    shapes = {tuple(q.shape) for q in queries}
    if len(shapes) != 1:
        raise ValueError(f"W_q shapes differ across stages: {sorted(shapes)}")
    terms = [(_cos(queries[i], queries[i + 1]) - target) ** 2 for i in range(len(queries) - 1)]
    return torch.stack(terms).sum()


def consistency_loss(own: torch.Tensor, predecessor: torch.Tensor, target: float) -> torch.Tensor:
    """Eq. 6, averaged over the batch: ``own`` and ``predecessor`` are ``(B, d)`` pooled outputs."""
    if own.shape != predecessor.shape or own.dim() != 2:
        raise ValueError(
            f"pooled outputs must be equal (B, d), got {own.shape} and {predecessor.shape}"
        )
    cos = F.cosine_similarity(own, predecessor, dim=1, eps=_EPS)
    return ((cos - target) ** 2).mean()


def local_vc_loss(
    own: VCLayer,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    predecessor: VCLayer | None,
    successor: VCLayer | None,
    settings: CollabLossSettings | None = None,
) -> VCLossTerms:
    """Eq. 3 as agent i computes it: its layer against the adjacent stages' (detached).

    ``hidden`` is agent i's ``H`` for the batch. A stage with no predecessor has no
    ``L_cons`` (Eq. 6 is for i > 0); a stage alone has no ``L_pos`` or ``L_cont``
    (terms then are zero tensors).
    """
    s = settings or CollabLossSettings()
    zero = hidden.new_zeros(())
    pos, cont, cons = zero, zero, zero
    for before, after in ((predecessor, own), (own, successor)):
        if before is None or after is None:
            continue
        e_a, e_b = (
            _maybe_detached(before, own, "stage_embedding"),
            _maybe_detached(after, own, "stage_embedding"),
        )
        q_a, q_b = _maybe_detached(before, own, "w_q"), _maybe_detached(after, own, "w_q")
        pos = pos + positional_loss([e_a, e_b], s.t_pos)
        cont = cont + continuity_loss([q_a, q_b], s.t_cont)
    if predecessor is not None:
        mine = own.pooled_branch(hidden, attention_mask)
        with torch.no_grad():
            theirs = predecessor.pooled_branch(hidden.detach(), attention_mask)
        cons = consistency_loss(mine, theirs, s.t_cons)
    total = s.lambda_pos * pos + s.lambda_cont * cont + s.lambda_cons * cons
    return VCLossTerms(pos=pos, cont=cont, cons=cons, total=total)


def _maybe_detached(layer: VCLayer, own: VCLayer, name: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(layer, name)
    return tensor if layer is own else tensor.detach()


def total_loss(sft: torch.Tensor, vc: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 2: ``L_SFT + γ · L_VC``."""
    return sft + gamma * vc
