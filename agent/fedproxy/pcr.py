"""FedProxy's Parameter-level Conflict-aware Regularisation, PCR (Eq. 8–9).

A client of round ``t + 1`` adds to its task loss (Eq. 8)

    λ_reg · Σ_d C_d^(t) · (φ_k[d] − φ^(t)[d])²                      (Eq. 9)

where ``φ^(t)`` is the global proxy it received and ``C_d^(t)`` the conflict scores the owner
published with it (:func:`peerlm.agent.fedproxy.hties.analyse`, Eq. 7). ``λ_reg = 1e-5`` (Appendix
B.1).

**The equation, not the sentence.** Section 4.2.2 says this "encourages clients to align
with the global model on consensus parameters (where C_d is high) while allowing more
freedom ... on conflicting parameters (where C_d is low)". By Eq. 7, ``C_d`` is *high*
where the clients' signs disagree (1 at an even split) and 0 where they all agree, and
the paper says so itself ("a score near 1 indicates high conflict"). Eq. 9 weights the
penalty by ``C_d``, so it holds clients to the global model on the **conflicting**
parameters and leaves consensus parameters free. peerlm implements Eq. 9 as written; the
sentence has "consensus" and "conflicting" swapped (or means ``1 − C_d``, which no equation
says). Round 0 has ``C = 0`` (Algorithm 1, line 3): no penalty.

Sans-IO and differentiable in ``params``; the global proxy and the scores are constants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import torch
from peerlm.agent.fedproxy.proxy import ProxyError
from torch import nn

__all__ = ["DEFAULT_LAMBDA_REG", "ConflictRegulariser", "pcr_penalty"]

#: Appendix B.1.
DEFAULT_LAMBDA_REG: Final = 1e-5


def pcr_penalty(
    params: Mapping[str, torch.Tensor],
    global_params: Mapping[str, torch.Tensor],
    conflict: Mapping[str, torch.Tensor],
    *,
    lambda_reg: float = DEFAULT_LAMBDA_REG,
) -> torch.Tensor:
    """``λ_reg · Σ_d C_d (φ_k[d] − φ^(t)[d])²`` over every tensor named in ``conflict``.

    ``params`` are the tensors being trained (gradients flow through them);
    ``global_params`` and ``conflict`` are detached. A name in ``conflict`` must be in both
    mappings with the same shape; scores must be finite and in [0, 1]. The result is a
    scalar in the dtype and on the device of the first parameter.
    """
    if not (math.isfinite(lambda_reg) and lambda_reg >= 0):
        raise ProxyError(
            f"lambda_reg must be finite and >= 0, got {lambda_reg}", reason="parameters"
        )
    if not conflict:
        raise ProxyError("no conflict scores", reason="empty")
    total: torch.Tensor | None = None
    for key, score in conflict.items():
        if key not in params or key not in global_params:
            raise ProxyError(f"{key}: conflict score for a tensor not trained here", reason="keys")
        phi, anchor = params[key], global_params[key]
        if not (phi.shape == anchor.shape == score.shape):
            raise ProxyError(
                f"{key}: shapes {tuple(phi.shape)}, {tuple(anchor.shape)}, {tuple(score.shape)}",
                reason="shape",
            )
        if not bool(torch.isfinite(score).all()) or bool(((score < 0) | (score > 1)).any()):
            raise ProxyError(f"{key}: conflict scores outside [0, 1]", reason="non_finite")
        c = score.detach().to(device=phi.device, dtype=phi.dtype)
        diff = phi - anchor.detach().to(device=phi.device, dtype=phi.dtype)
        term = (c * diff * diff).sum()
        total = term if total is None else total + term
    assert total is not None
    return lambda_reg * total


@dataclass(frozen=True)
class ConflictRegulariser:
    """Eq. 9 for a model in training: holds ``φ^(t)`` and ``C^(t)`` of one round.

    :meth:`penalty` reads the model's named parameters, whose names are the proxy's
    state-dict keys, so the scores the owner publishes apply unchanged. Add it to the task
    loss (Eq. 8) before ``backward``.
    """

    global_params: Mapping[str, torch.Tensor]
    conflict: Mapping[str, torch.Tensor]
    lambda_reg: float = DEFAULT_LAMBDA_REG

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """``λ_reg · L_reg,k`` of the model's current parameters.

        A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is one
        parameter: it is counted once, under the name ``named_parameters`` gives it. Scores
        for other state-dict entries of the model (aliases, buffers) are skipped; a score for
        a name the model does not have is refused.
        """
        params = dict(model.named_parameters())
        known = set(model.state_dict()) | set(params)
        unknown = sorted(k for k in self.conflict if k not in known)
        if unknown:
            raise ProxyError(f"conflict scores for {unknown[:3]}: not in the model", reason="keys")
        scores = {k: v for k, v in self.conflict.items() if k in params}
        return pcr_penalty(params, self.global_params, scores, lambda_reg=self.lambda_reg)
