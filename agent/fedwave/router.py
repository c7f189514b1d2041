"""FedWave's MoE router (Eq. 7-9): routing weights, its local losses, FedAvg among agents.

    α = softmax(G(H̄)),  H̄ = mean_l H_l                                        (Eq. 7)
    L_total^(i) = α_i L_SFT^(i) + γ L_VC^(i) + δ1 L_balance + δ2 L_entropy     (Eq. 8)
    W_router^{t+1} = Σ_{i∈S_t} (n_i / n) W_router,i^{t+1}                      (Eq. 9)

:class:`MoERouter` is the lightweight MLP ``G`` (d → ``hidden`` → N, GELU) on the base LM's
mean-pooled hidden states. :func:`router_losses` gives Eq. 8's router terms for agent i's
batch; :func:`top_k_routing` the inference-time routing (top_k = 2, Figure 3c);
:func:`fedavg_routers` Eq. 9 as a pure function.

Choices the paper leaves open (also in docs/fedwave.md):

* **How the router learns at agent i (``objective``).** Read literally, Eq. 8 minimises
  ``α_i · L_SFT`` over the router too; since ``L_SFT > 0``, its gradient always *lowers* α_i,
  the weight of the only expert whose data agent i holds (a test shows it), the opposite of
  the paper's stated intent ("strengthening the gradient signal when the router correctly
  assigns a high weight to the appropriate expert"). The default ``objective="stage_label"``
  keeps the expert's weighting ``α_i · L_SFT`` with α_i detached (the expert's loss is
  scaled by the router's confidence, as described) and trains the router with the routing
  cross-entropy ``−log α_i``: every sample of agent i's private data belongs to stage i,
  the only supervision a federated router can honestly get. ``objective="paper"`` is the
  literal form, kept for the ablation.
* **Load balance.** "the variance of expert utilisation over a batch": utilisation is the
  batch mean of α (a vector over experts), the loss its population variance.
* **Entropy.** The batch mean of the routing entropy ``−Σ α log α`` (nats).
* **δ1, δ2.** Not given; 0.01 each: regularisers two orders of magnitude below the SFT term.
  Note that at agent i every sample wants expert i, so the balance term pulls against the
  routing term; with δ1 = 0.01 it only breaks ties.
* **Router width.** ``hidden`` = 64; initial weights N(0, 0.02²), biases zero, from a
  caller-given generator (every agent starts the same router from the workflow's seed).
* **Aggregation order.** Eq. 9 is computed in float64 over the agents sorted by name and
  cast back to float32, so every agent that aggregates the same set of routers gets the
  same bits whatever order they arrived in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peerlm.agent.adapter_codec import check_tensors
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.params import RouterSettings
from peerlm.agent.fedwave.vclayer import masked_mean
from torch import nn

__all__ = [
    "MoERouter",
    "RouterLossTerms",
    "RouterSettings",
    "balance_loss",
    "entropy_loss",
    "fedavg_routers",
    "median_routers",
    "router_losses",
    "top_k_routing",
]


class MoERouter(nn.Module):
    """``G``: an MLP from the mean-pooled base hidden state to logits over N experts."""

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        settings: RouterSettings | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        s = settings or RouterSettings()
        if n_experts < 2 or hidden_size < 1:
            raise FedWaveError(
                f"a router needs a positive width and at least 2 experts, got "
                f"{hidden_size} and {n_experts}",
                reason="config",
            )
        self.settings = s
        self.n_experts = n_experts
        self.fc1 = nn.Linear(hidden_size, s.hidden)
        self.fc2 = nn.Linear(s.hidden, n_experts)
        with torch.no_grad():
            for layer in (self.fc1, self.fc2):
                layer.weight.copy_(
                    torch.randn(layer.weight.shape, generator=generator) * s.init_std
                )
                layer.bias.zero_()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits ``z ∈ ℝ^N`` for pooled hidden states ``(B, d)``."""
        return self.fc2(F.gelu(self.fc1(pooled)))  # type: ignore[no-any-return]

    def route(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Eq. 7: ``α = softmax(G(H̄))`` for base hidden states ``(B, L, d)``: ``(B, N)``."""
        return self.route_pooled(masked_mean(hidden, attention_mask))

    def route_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """Eq. 7 on already pooled features ``H̄`` ``(B, d)``: ``α``, ``(B, N)``."""
        return torch.softmax(self(pooled), dim=-1)


def balance_loss(alpha: torch.Tensor) -> torch.Tensor:
    """Variance (population) over experts of their mean utilisation in the batch."""
    return alpha.mean(dim=0).var(unbiased=False)


def entropy_loss(alpha: torch.Tensor) -> torch.Tensor:
    """Batch mean of the routing entropy ``−Σ_j α_j log α_j`` (nats; 0·log 0 = 0).

    ``log α`` is taken of α clamped at the dtype's smallest normal number: the value is the
    same (an α that underflowed to 0 contributes 0), and the gradient stays finite. With
    ``xlogy(α, α)`` (as an earlier version did) a confident router whose softmax underflowed to an
    exact 0 got ``d/dα = log 0 = −inf``, and the softmax's backward turned it into NaN in
    every router parameter (Eq. 9 then refused the router as non-finite).
    """
    log_alpha = torch.log(alpha.clamp_min(torch.finfo(alpha.dtype).tiny))
    return -(alpha * log_alpha).sum(dim=-1).mean()


@dataclass(frozen=True)
class RouterLossTerms:
    """Eq. 8's router part for one batch of agent i (add ``γ L_VC`` for the total)."""

    weighted_sft: torch.Tensor  # mean over the batch of α_i · L_SFT (per sample)
    routing: torch.Tensor  # −log α_i (zero under the literal objective)
    balance: torch.Tensor
    entropy: torch.Tensor
    total: torch.Tensor  # weighted_sft + routing + δ1 balance + δ2 entropy


def router_losses(
    alpha: torch.Tensor,
    expert: int,
    per_sample_sft: torch.Tensor,
    settings: RouterSettings | None = None,
) -> RouterLossTerms:
    """Eq. 8 without ``γ L_VC`` for agent ``expert``'s batch (see the module docstring).

    ``alpha`` is ``(B, N)`` from :meth:`MoERouter.route`; ``per_sample_sft`` is ``(B,)``.
    """
    s = settings or RouterSettings()
    if alpha.dim() != 2 or per_sample_sft.shape != alpha.shape[:1]:
        raise ValueError(
            f"alpha (B, N) and per-sample SFT (B,), got {alpha.shape}, {per_sample_sft.shape}"
        )
    if not 0 <= expert < alpha.shape[1]:
        raise ValueError(f"expert {expert} outside 0..{alpha.shape[1] - 1}")
    a_i = alpha[:, expert]
    if s.objective == "paper":
        weighted = (a_i * per_sample_sft).mean()
        routing = alpha.new_zeros(())
    else:
        weighted = (a_i.detach() * per_sample_sft).mean()
        routing = -torch.log(a_i.clamp_min(1e-12)).mean()
    balance = balance_loss(alpha)
    entropy = entropy_loss(alpha)
    total = weighted + routing + s.delta_balance * balance + s.delta_entropy * entropy
    return RouterLossTerms(weighted, routing, balance, entropy, total)


def top_k_routing(alpha: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert indices, weights) of the ``k`` largest α per row, weights renormalised to 1.

    Ties go to the lower expert index (stable), so routing is deterministic.
    """
    if not 1 <= k <= alpha.shape[-1]:
        raise ValueError(f"top_k must be in 1..{alpha.shape[-1]}, got {k}")
    order = torch.sort(alpha, dim=-1, descending=True, stable=True).indices[..., :k]
    weights = torch.gather(alpha, -1, order)
    return order, weights / weights.sum(dim=-1, keepdim=True)


def fedavg_routers(
    routers: Mapping[str, tuple[Mapping[str, torch.Tensor], int]],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Eq. 9: the ``n_i``-weighted average of the agents' router state dicts.

    ``routers`` maps an agent's name to (its router's state dict, its sample count n_i).
    The result depends on the set only, not on the mapping's order: agents are taken sorted
    by name and the sum runs in float64 before the cast to float32. ``shapes`` (this
    agent's router) makes a router of another shape a refusal. ``FedWaveError`` (reasons
    ``empty``, ``weights``, ``keys``, ``shape``, ``dtype``, ``non_finite``) names the agent.
    """
    if not routers:
        raise FedWaveError("no routers to aggregate", reason="empty")
    names = sorted(routers)
    total = 0
    for name in names:
        n = routers[name][1]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise FedWaveError(
                f"agent {name!r}: n_i must be a positive integer, got {n!r}", reason="weights"
            )
        total += n
    reference = (
        shapes
        if shapes is not None
        else {k: tuple(v.shape) for k, v in routers[names[0]][0].items()}
    )
    for name in names:
        check_tensors(
            routers[name][0], reference, what=f"agent {name!r}: router", error=FedWaveError
        )
    merged: dict[str, torch.Tensor] = {}
    for key in sorted(reference):
        acc = torch.zeros(reference[key], dtype=torch.float64)
        for name in names:
            state, n = routers[name]
            acc += (n / total) * state[key].detach().to(device="cpu", dtype=torch.float64)
        merged[key] = acc.to(torch.float32)
    return merged


def _middle(values: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of same-shaped float64 tensors (for an even count, the
    mean of the two middle values): sorted first, so the order of ``values`` is irrelevant."""
    ordered = torch.sort(torch.stack(values), dim=0).values
    middle = (len(values) - 1) // 2
    if len(values) % 2:
        return ordered[middle]
    return (ordered[middle] + ordered[middle + 1]) / 2


def median_routers(
    routers: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    stages: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """The coordinate-wise median of the agents' router state dicts, computed in float64
    and cast to float32; with ``stages`` (agent → its stage), the median over the stages of
    each stage's own median (its agents that are in ``routers``).

    The robust counterpart of Eq. 9 that the expert loop uses by default
    (``fedwave.router_aggregation``; docs/fedwave.md, section 5). Each router is one value
    per entry, an equal share, whatever sample count it claims. By stage first because a
    workflow's data are split by stage: the agents of one stage learn the same thing (their
    median is robust to a minority among them), while each stage alone teaches the router
    where *its* inputs go, so a member that pushes the way its own stage does would add its
    vote to that stage's in a plain median over agents. Over three or more stages, every
    entry of the result lies between two other stages' values of that entry, whatever one
    stage's agents send. Deterministic over the *set* of routers: each entry's values are
    sorted before the middle is taken (for an even count, the mean of the two middle
    values), so agents that aggregate the same routers get the same bits in any arrival
    order. ``shapes`` and the refusals (``FedWaveError``: ``empty``, ``keys``, ``shape``,
    ``dtype``, ``non_finite``) are :func:`fedavg_routers`'.
    """
    if not routers:
        raise FedWaveError("no routers to aggregate", reason="empty")
    names = sorted(routers)
    reference = (
        shapes if shapes is not None else {k: tuple(v.shape) for k, v in routers[names[0]].items()}
    )
    for name in names:
        check_tensors(routers[name], reference, what=f"agent {name!r}: router", error=FedWaveError)
    groups: dict[str, list[str]] = {}
    for name in names:
        group = name if stages is None else stages.get(name)
        if group is None:
            raise FedWaveError(f"agent {name!r} has no stage", reason="keys")
        groups.setdefault(group, []).append(name)
    merged: dict[str, torch.Tensor] = {}
    for key in sorted(reference):
        per_group = [
            _middle([routers[n][key].detach().to(device="cpu", dtype=torch.float64) for n in g])
            for _, g in sorted(groups.items())
        ]
        merged[key] = _middle(per_group).to(torch.float32)
    return merged
