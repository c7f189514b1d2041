"""The client-side corrections of two federated baselines, on the trainable (LoRA) parameters.

* **FedProx** (Li et al. 2020): each client minimises its local loss plus the proximal term
  ``(μ/2)·‖w − w_global‖²`` (:func:`proximal_term`; its gradient is ``μ·(w − w_global)``).
  ``μ = 0.01`` by default (:data:`DEFAULT_PROX_MU`): the middle of the grid
  {0.001, 0.01, 0.1, 1} of Li et al.; it was not tuned on the experiment's test chains.
* **SCAFFOLD** (Karimireddy et al. 2020), option II control variates: a client corrects every
  gradient by ``c − c_i`` (:func:`corrected_gradients`) and after its ``K`` local steps sets
  ``c_i⁺ = c_i − c + (x − y_i)/(K·η_l)`` (:func:`scaffold_option2`); the server (here: every
  agent, on the same averages) sets ``x ← x + η_g·mean(y_i − x)`` and
  ``c ← c + (|S|/N)·mean(c_i⁺ − c_i)`` (:func:`scaffold_server_controls`). Under local SGD
  with step ``η_l``, option II is exactly the mean of the raw minibatch gradients along the
  local trajectory (``x − y_i = η_l·Σ_k (g_k − c_i + c)``; tested), which is the form
  :class:`GradientMean` accumulates for a client whose local optimiser is not SGD.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from peerlm.agent.adapter_codec import check_tensors
from peerlm.agent.fedwave.errors import FedWaveError

__all__ = [
    "DEFAULT_PROX_MU",
    "GradientMean",
    "corrected_gradients",
    "proximal_term",
    "scaffold_option2",
    "scaffold_server_controls",
    "state_bytes",
]

#: FedProx's μ (Li et al. 2020's grid {0.001, 0.01, 0.1, 1}; the middle value).
DEFAULT_PROX_MU = 0.01


def proximal_term(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """``(μ/2)·Σ_k ‖params[k] − anchor[k]‖²``, differentiable in ``params``.

    ``anchor`` (the round's global model) must have ``params``'s names and shapes
    (``FedWaveError`` otherwise); it is detached.
    """
    if mu < 0:
        raise FedWaveError(f"FedProx mu must be >= 0, got {mu}", reason="config")
    check_tensors(
        anchor,
        {k: tuple(v.shape) for k, v in params.items()},
        what="FedProx anchor",
        error=FedWaveError,
    )
    if not params:
        raise FedWaveError("no parameters for the proximal term", reason="empty")
    total = torch.zeros((), dtype=torch.float32)
    for k in sorted(params):
        diff = params[k] - anchor[k].detach().to(params[k].device, params[k].dtype)
        total = total + (diff * diff).sum()
    return 0.5 * mu * total


def corrected_gradients(
    named: Iterable[tuple[str, torch.nn.Parameter]],
    client: Mapping[str, torch.Tensor],
    server: Mapping[str, torch.Tensor],
) -> None:
    """SCAFFOLD's local correction in place: ``grad ← grad − c_i + c`` for each named
    parameter that has a gradient (``client`` is ``c_i``, ``server`` is ``c``)."""
    with torch.no_grad():
        for name, p in named:
            if p.grad is not None:
                p.grad.add_(server[name].to(p.grad) - client[name].to(p.grad))


def scaffold_option2(
    client: Mapping[str, torch.Tensor],
    server: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    end: Mapping[str, torch.Tensor],
    *,
    steps: int,
    lr: float,
) -> dict[str, torch.Tensor]:
    """Option II: ``c_i⁺ = c_i − c + (x − y_i)/(K·η_l)`` with ``x = start``, ``y_i = end``,
    ``K = steps``, ``η_l = lr``. Shapes must agree (``FedWaveError``)."""
    if steps < 1 or not lr > 0:
        raise FedWaveError(f"need steps >= 1 and lr > 0, got {steps}, {lr}", reason="config")
    shapes = {k: tuple(v.shape) for k, v in client.items()}
    for what, state in (("server control", server), ("start", start), ("end", end)):
        check_tensors(state, shapes, what=what, error=FedWaveError)
    return {k: client[k] - server[k] + (start[k] - end[k]) / (steps * lr) for k in sorted(client)}


def scaffold_server_controls(
    server: Mapping[str, torch.Tensor],
    deltas: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    total_clients: int,
) -> dict[str, torch.Tensor]:
    """``c ← c + (|S|/N)·mean_i Δc_i`` over the agents of ``deltas`` (name → ``c_i⁺ − c_i``),
    summed in float64 in name order so that every agent computes the same bits."""
    if not deltas:
        raise FedWaveError("no control-variate deltas", reason="empty")
    if total_clients < len(deltas):
        raise FedWaveError(
            f"total_clients {total_clients} < {len(deltas)} participants", reason="config"
        )
    shapes = {k: tuple(v.shape) for k, v in server.items()}
    names = sorted(deltas)
    for name in names:
        check_tensors(
            deltas[name], shapes, what=f"agent {name!r}: control delta", error=FedWaveError
        )
    out: dict[str, torch.Tensor] = {}
    for k in sorted(server):
        acc = torch.zeros(shapes[k], dtype=torch.float64)
        for name in names:
            acc += deltas[name][k].detach().to(torch.float64)
        step = (acc / len(names)) * (len(names) / total_clients)
        out[k] = (server[k].detach().to(torch.float64) + step).to(server[k].dtype)
    return out


class GradientMean:
    """The running mean of the raw minibatch gradients of named parameters over one round:
    SCAFFOLD option II's ``c_i⁺`` for a client whose local optimiser is not plain SGD."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._sum = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
        self.count = 0

    def add(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Add the current gradients (before any correction)."""
        for name, p in named:
            if name in self._sum and p.grad is not None:
                self._sum[name] += p.grad.detach().to("cpu", torch.float64)
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """The mean over the added steps (float32)."""
        if self.count == 0:
            raise FedWaveError("no gradients accumulated", reason="empty")
        return {k: (v / self.count).to(torch.float32) for k, v in self._sum.items()}


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The raw tensor bytes of a state dict (what one copy costs on the wire, before
    framing)."""
    return sum(int(v.numel()) * int(v.element_size()) for v in state.values())
