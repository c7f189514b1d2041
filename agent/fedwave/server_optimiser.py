"""The server optimisers of Reddi et al. 2021 ("Adaptive Federated Optimization",
Algorithm 2) without a server: FedAvgM, FedAdam and FedYogi as a *replica* per agent.

Algorithm 2 treats the round's averaged client change ``Δ_t = mean_i(x_i − x_t)`` as a
pseudo-gradient (its negative) and applies a server optimiser to the global model ``x_t``:

* FedAvgM: ``v_t = μ·v_{t−1} + Δ_t``, ``x_{t+1} = x_t + η·v_t`` (heavy-ball momentum);
* FedAdam: ``m_t = β1·m_{t−1} + (1−β1)·Δ_t``, ``v_t = β2·v_{t−1} + (1−β2)·Δ_t²``,
  ``x_{t+1} = x_t + η·m_t / (√v_t + τ)``;
* FedYogi: as FedAdam with ``v_t = v_{t−1} − (1−β2)·Δ_t²·sign(v_{t−1} − Δ_t²)``;

with ``m_{−1} = 0`` and ``v_{−1} = τ²`` (the algorithm asks ``v_{−1} ≥ τ²``) and no bias
correction.

**Where the state lives.** peerlm has no server. Every agent of the workflow holds a
:class:`ServerOptimiser` replica: the global model ``x_t`` and the optimiser's moments. All
agents start from the same ``x_0`` (the workflow's seed), pull the same set of client
models each round, average them with the order-independent float64 average of
:func:`~peerlm.agent.fedwave.router.fedavg_routers`, and apply the same deterministic update
on the CPU in float32: the replicas stay bit-identical (tested), and nothing beyond the
client models travels. A replica that missed a round cannot catch up from its peers' models
alone; it would need a peer's replica (state dict below), which is how a restarted agent
would rejoin.

**Which code computes the update.** FedAvgM is ``torch.optim.SGD(momentum=μ, dampening=0)``
fed the pseudo-gradient ``−Δ_t``: its buffer rule ``b_t = μ·b_{t−1} + g_t`` (``b_0 = g_0``)
and step ``x −= η·b_t`` are exactly the update above. FedAdam and FedYogi are written by hand
(:func:`adaptive_moments`): ``torch.optim.Adam`` bias-corrects both moments and adds its
epsilon to the bias-corrected root, which is not Algorithm 2, and Yogi's second-moment rule
is in no torch optimiser.

**Defaults** (Reddi et al.): FedAvgM ``η = 1.0``, ``μ = 0.9``; FedAdam and FedYogi
``β1 = 0.9``, ``β2 = 0.99``, ``τ = 1e-3``, and ``η = 1e-2`` (see :class:`ServerOptSettings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from peerlm.agent.adapter_codec import check_tensors
from peerlm.agent.fedwave.errors import FedWaveError

__all__ = [
    "SERVER_OPTIMISERS",
    "ServerOptSettings",
    "ServerOptimiser",
    "adaptive_moments",
]

#: The server optimisers of Algorithm 2 that peerlm runs as agent replicas.
SERVER_OPTIMISERS: tuple[str, ...] = ("fedavgm", "fedadam", "fedyogi")


@dataclass(frozen=True)
class ServerOptSettings:
    """One server optimiser's hyper-parameters.

    ``lr`` (η) defaults per kind: 1.0 for FedAvgM (Reddi et al.'s FedAvgM with η = 1 is
    FedAvg plus momentum), 1e-2 for FedAdam and FedYogi. The adaptive step moves each
    coordinate by at most about η per round once the moments settle (``|m/(√v+τ)| ≲ 1``);
    1e-2 is the value of Reddi et al.'s grid (powers of ten) closest to the size of one
    FedAvg round here (client AdamW, lr 2e-3, 6-8 steps: about 1e-2 per coordinate), and is
    within the range they report best for FedAdam and FedYogi. It was not tuned on the
    experiment's test chains.
    """

    kind: str
    lr: float | None = None
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in SERVER_OPTIMISERS:
            raise FedWaveError(
                f"unknown server optimiser {self.kind!r}; one of {', '.join(SERVER_OPTIMISERS)}",
                reason="config",
            )
        if self.lr is not None and not self.lr > 0:
            raise FedWaveError(f"server lr must be > 0, got {self.lr}", reason="config")
        for name in ("momentum", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise FedWaveError(f"{name} must be in [0, 1)", reason="config")
        if not self.tau > 0:
            raise FedWaveError(f"tau must be > 0, got {self.tau}", reason="config")

    @property
    def server_lr(self) -> float:
        """η: ``lr`` if given, else the kind's default."""
        if self.lr is not None:
            return self.lr
        return 1.0 if self.kind == "fedavgm" else 1e-2


def adaptive_moments(
    m: torch.Tensor,
    v: torch.Tensor,
    delta: torch.Tensor,
    *,
    kind: str,
    beta1: float,
    beta2: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of Algorithm 2's moments for ``kind`` ``fedadam`` or ``fedyogi``:
    ``(m_t, v_t)`` from ``(m_{t−1}, v_{t−1})`` and the averaged change ``Δ_t``."""
    m_next = beta1 * m + (1.0 - beta1) * delta
    sq = delta * delta
    if kind == "fedadam":
        v_next = beta2 * v + (1.0 - beta2) * sq
    elif kind == "fedyogi":
        v_next = v - (1.0 - beta2) * sq * torch.sign(v - sq)
    else:
        raise FedWaveError(f"no adaptive moments for {kind!r}", reason="config")
    return m_next, v_next


class ServerOptimiser:
    """One agent's replica of the server optimiser and the global model ``x_t``.

    ``initial`` is ``x_0`` (a state dict of floating tensors, e.g. the LoRA factors); it is
    copied to float32 on the CPU. :meth:`step` takes the round's averaged client model,
    forms ``Δ_t = average − x_t`` and returns the new ``x_{t+1}``.
    """

    def __init__(self, settings: ServerOptSettings, initial: Mapping[str, torch.Tensor]) -> None:
        if not initial:
            raise FedWaveError("no parameters for the server optimiser", reason="empty")
        self.settings = settings
        self._shapes = {k: tuple(v.shape) for k, v in initial.items()}
        check_tensors(initial, self._shapes, what="initial model", error=FedWaveError)
        self._names = sorted(initial)
        self._x = {
            k: torch.nn.Parameter(
                initial[k].detach().to(device="cpu", dtype=torch.float32).clone(),
                requires_grad=False,
            )
            for k in self._names
        }
        self._sgd: torch.optim.SGD | None = None
        self._m: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}
        if settings.kind == "fedavgm":
            self._sgd = torch.optim.SGD(
                [self._x[k] for k in self._names],
                lr=settings.server_lr,
                momentum=settings.momentum,
                dampening=0.0,
                nesterov=False,
            )
        else:
            tau2 = settings.tau * settings.tau
            self._m = {k: torch.zeros_like(self._x[k]) for k in self._names}
            self._v = {k: torch.full_like(self._x[k], tau2) for k in self._names}
        self.rounds = 0

    def model(self) -> dict[str, torch.Tensor]:
        """A copy of ``x_t``."""
        return {k: self._x[k].detach().clone() for k in self._names}

    def state(self) -> dict[str, torch.Tensor]:
        """``x_t`` and the moments, as one flat state dict (names prefixed ``x.``, ``m.``,
        ``v.``; FedAvgM's momentum buffer as ``v.``): what a rejoining agent would copy."""
        out = {f"x.{k}": self._x[k].detach().clone() for k in self._names}
        if self._sgd is not None:
            for k in self._names:
                buf = self._sgd.state.get(self._x[k], {}).get("momentum_buffer")
                if buf is not None:
                    out[f"v.{k}"] = buf.detach().clone()
        else:
            out |= {f"m.{k}": self._m[k].clone() for k in self._names}
            out |= {f"v.{k}": self._v[k].clone() for k in self._names}
        return out

    def step(self, average: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the round's averaged client model; return ``x_{t+1}``.

        ``average`` must have exactly ``x_t``'s names and shapes and finite floating values,
        else ``FedWaveError`` (reasons ``keys``, ``shape``, ``dtype``, ``non_finite``) and
        the replica is unchanged.
        """
        check_tensors(average, self._shapes, what="averaged model", error=FedWaveError)
        delta = {
            k: average[k].detach().to(device="cpu", dtype=torch.float32) - self._x[k].detach()
            for k in self._names
        }
        if self._sgd is not None:
            for k in self._names:
                self._x[k].grad = -delta[k]  # the pseudo-gradient
            self._sgd.step()
            for k in self._names:
                self._x[k].grad = None
        else:
            s = self.settings
            for k in self._names:
                m, v = adaptive_moments(
                    self._m[k], self._v[k], delta[k], kind=s.kind, beta1=s.beta1, beta2=s.beta2
                )
                self._m[k], self._v[k] = m, v
                with torch.no_grad():
                    self._x[k].add_(s.server_lr * m / (torch.sqrt(v) + s.tau))
        self.rounds += 1
        return self.model()
