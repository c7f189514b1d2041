"""What an expert agent lets into its round's conclusion beyond the codecs' checks
(hostile input): a norm bound on every router and VCLayer that arrived.

The transport and the decoders refuse a part of the wrong size, format, shape or with a
NaN/inf in it (:func:`~peerlm.agent.fedwave.exchange.accept_part`). A finite part can still
wreck the aggregate for every agent: one router of entries 1e30 dominates Eq. 9's weighted
mean whatever its ``n_i``, and a neighbour's VCLayer of 1e30 makes the collaborative loss
(Eq. 5-6) meaningless. :func:`screen_round` moves such parts from the accepted ones to the
rejected ones (reason ``norm``) before the round is concluded, with no I/O:

* **a router**: its task vector against the round's starting router ``ρ^(t−1)`` (the
  aggregate every agent adopted at the end of the previous round, the common initial router
  in round 1) may have an L2 norm of at most
  ``max(max_router_update_ratio × ‖ρ^(0)‖, max_router_update_rms × √n)``, ``n`` the
  router's number of entries, ``ρ^(0)`` the workflow's common initial router (the expert
  loop passes its norm as ``router_reference_norm``; before the hostile-member audit the
  ratio scaled ``‖ρ^(t−1)‖``, which a member with weight in the aggregate grew round after
  round, and the bound with it). The second term is the bound AdamW obeys: it moves an entry
  by at most about its learning rate a step, whatever the entry's size, so a router that
  starts small (init s.d. 0.02) leaves any ratio of its own norm within a few steps
  (measured on the tiny gpt2 chain, 8,451 entries: ratio 1.23 after 8 steps at lr 5e-3,
  2.64 after 12 at 1e-2; root-mean-square change per entry 0.025 and 0.053, at most
  ``lr × steps``). The floor is absolute and shared by the workflow's settings, so it
  keeps every honest agent's refusals equal (below).
  Relative to ``ρ^(t−1)`` and not to this agent's own trained router: every honest agent
  that concluded the previous round over the same set holds the same ``ρ^(t−1)`` bit for
  bit, so they all refuse the same routers and their aggregates stay equal (a reference of
  each agent's own would let a router placed on the edge pass at one agent and not at
  another, and split the workflow's routers). Defaults: ratio 1 (as FedProxy's
  ``max_update_norm_ratio``) and root-mean-square 0.25 per entry, about four times the
  largest honest change measured (0.062 after 24 steps at lr 1e-2); a hostile member at the
  bound moves the Eq. 9 mean by at most its weight ``n_i / Σ n`` times that.
  With the ratio set, no entry may move by more than ``max_router_update_abs`` (default 1;
  the largest honest entry change measured 0.152 after 24 or 48 steps at 1e-2): an L2
  bound alone let a hostile member spend the floor's whole budget (0.25 × √n, 23 on the
  tiny gpt2 chain) on one output bias, which turns the Eq. 9 mean of four equal-weight
  routers to its expert for every input (``tests/unit/test_fedwave_part_admission.py``);
  per entry, a crafted change is now at most 6.5 times the largest honest one measured.
  Also, Eq. 9's weight ``n_i`` is the sender's claim: it is capped
  (:func:`~peerlm.agent.fedwave.exchange.router_weights`), else "its weight" above would
  be whatever the attacker claims.
* **a VCLayer**: its L2 norm may be at most ``max_vclayer_norm_ratio ×`` this agent's own
  VCLayer's (every stage's starts from the same distribution, :meth:`FedWaveSettings.
  initial_vclayer`; stages drift apart in training, so the default is a loose 10). A
  neighbour's VCLayer only enters this agent's loss, never a shared aggregate, so an
  agent-local reference splits nothing.
* **an expert's LoRA adapter** (π_SFT's assembly after the last round, docs/fedwave.md
  section 5): its L2 norm may be at most ``fedwave.assembly.max_adapter_norm_ratio ×``
  this agent's own adapter's (floored at 1e-3: peft starts B at zero), the overlay pull's
  rule and default (10; :mod:`~peerlm.agent.merging.pull_aggregate`). Like a neighbour's VCLayer
  it enters only this agent's π_SFT.

Norms are float64 over every floating tensor (:func:`~peerlm.agent.fedproxy.admission.
state_norm`), so 1e30 entries do not overflow to inf; a NaN norm is refused too.

The aggregate itself is screened after the round by the routing check
(:mod:`~peerlm.agent.fedwave.routing_check`). Not here: an acceptance gate on the adopted
router's held-out *loss* (keep the previous one if it rises). The expert's held-out SFT
loss does not go through the router (the router
chooses among the experts in the assembled model), so that loss cannot judge it; and a
gate that kept a different router at some agents than at others would split the workflow's
routers, which Eq. 9 is there to keep equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from peerlm.agent.fedproxy.admission import state_norm, update_norm
from peerlm.agent.fedwave.exchange import PartKind, PullTarget, RoundParts
from peerlm.agent.fedwave.settings import DEFAULT_MAX_ROUTER_UPDATE_ABS
from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = [
    "NORM_REASON",
    "adapter_norm_refusal",
    "router_norm_refusal",
    "screen_round",
    "vclayer_norm_refusal",
]

#: The refusal reason (metric label) of a part over its norm bound.
NORM_REASON = "norm"


def _largest_entry_change(
    base: Mapping[str, torch.Tensor], router: Mapping[str, torch.Tensor]
) -> float:
    """``max |router − base|`` over every floating entry (float64; NaN if any is NaN)."""
    largest = 0.0
    for key, ref in base.items():
        if not ref.is_floating_point():
            continue
        diff = router[key].detach().to("cpu", torch.float64) - ref.detach().to("cpu", torch.float64)
        if diff.numel():
            change = float(diff.abs().max())
            if not change <= largest:  # a NaN change stays NaN
                largest = change
    return largest


def router_norm_refusal(
    base: Mapping[str, torch.Tensor],
    router: Mapping[str, torch.Tensor],
    *,
    max_ratio: float,
    max_rms: float = 0.0,
    max_abs: float | None = DEFAULT_MAX_ROUTER_UPDATE_ABS,
    reference_norm: float | None = None,
) -> str | None:
    """Why ``router`` is over the bound against this agent's router of the round's start
    ``base`` (a message), or None if within it: an L2 norm of at most
    ``max(max_ratio × reference_norm, max_rms × √n)`` and, unless ``max_abs`` is None, no
    entry moved by more than ``max_abs``. ``reference_norm``: the norm the ratio scales,
    the workflow's common initial router's in the expert loop (None: ``‖base‖``, which a
    member with weight in the aggregate can grow round after round, and the bound with it).
    """
    reference = state_norm(base) if reference_norm is None else reference_norm
    entries = sum(v.numel() for v in base.values() if v.is_floating_point())
    bound = max(max_ratio * reference, max_rms * math.sqrt(entries))
    norm = update_norm(base, router)
    if norm <= bound:  # not ``>``: a NaN norm is refused too
        if max_abs is None:
            return None
        largest = _largest_entry_change(base, router)
        if largest <= max_abs:
            return None
        return (
            f"router entry moved by {largest:.4g}, more than {max_abs:g} "
            f"(fedwave.max_router_update_abs), within the norm bound {bound:.4g}"
        )
    return (
        f"router update norm {norm:.4g} exceeds {bound:.4g}, the larger of {max_ratio:g} x "
        f"the reference router norm {reference:.4g} (fedwave.max_router_update_ratio) "
        f"and {max_rms:g} x the root of its {entries} entries (fedwave.max_router_update_rms)"
    )


def vclayer_norm_refusal(own: VCLayer, layer: VCLayer, *, max_ratio: float) -> str | None:
    """Why ``layer`` is over the bound against this agent's own VCLayer (a message), or
    None if within it."""
    reference = state_norm(own.state_dict())
    norm = state_norm(layer.state_dict())
    if norm <= max_ratio * reference:
        return None
    return (
        f"VCLayer norm {norm:.4g} exceeds {max_ratio:g} x this agent's own VCLayer norm "
        f"{reference:.4g} (fedwave.max_vclayer_norm_ratio)"
    )


def adapter_norm_refusal(
    own_norm: float, state: Mapping[str, torch.Tensor], *, max_ratio: float
) -> str | None:
    """Why the adapter ``state`` is over the bound against this agent's own adapter norm
    ``own_norm`` (a message), or None if within it."""
    reference = max(own_norm, 1e-3)
    norm = state_norm(state)
    if norm <= max_ratio * reference:
        return None
    return (
        f"adapter norm {norm:.4g} exceeds {max_ratio:g} x this agent's own adapter norm "
        f"{reference:.4g} (fedwave.assembly.max_adapter_norm_ratio)"
    )


def screen_round(
    parts: RoundParts,
    *,
    base_router: Mapping[str, torch.Tensor],
    own_vclayer: VCLayer,
    max_router_update_ratio: float | None,
    max_vclayer_norm_ratio: float | None,
    max_router_update_rms: float = 0.0,
    max_router_update_abs: float | None = DEFAULT_MAX_ROUTER_UPDATE_ABS,
    own_adapter_norm: float | None = None,
    max_adapter_norm_ratio: float | None = None,
    router_reference_norm: float | None = None,
) -> dict[PullTarget, str]:
    """Move the parts of ``parts`` over their norm bound (module docstring) from its
    accepted routers / VCLayers to ``parts.rejected`` (reason ``norm``); what was moved,
    with each refusal's message. A ratio of None: no bound for that kind (the router's
    root-mean-square floor only widens a ratio's bound, and its per-entry bound
    ``max_router_update_abs`` applies with the ratio; ``router_reference_norm`` is the norm
    the ratio scales, None: ``‖base_router‖``); adapters are bounded when both
    ``own_adapter_norm`` and ``max_adapter_norm_ratio`` are given."""
    refused: dict[PullTarget, str] = {}
    if max_router_update_ratio is not None:
        for agent in sorted(parts.routers):
            why = router_norm_refusal(
                base_router,
                parts.routers[agent].state,
                max_ratio=max_router_update_ratio,
                max_rms=max_router_update_rms,
                max_abs=max_router_update_abs,
                reference_norm=router_reference_norm,
            )
            if why is not None:
                refused[PullTarget(agent, PartKind.ROUTER)] = why
                del parts.routers[agent]
    if max_vclayer_norm_ratio is not None:
        for agent in sorted(parts.vclayers):
            why = vclayer_norm_refusal(
                own_vclayer, parts.vclayers[agent], max_ratio=max_vclayer_norm_ratio
            )
            if why is not None:
                refused[PullTarget(agent, PartKind.VCLAYER)] = why
                del parts.vclayers[agent]
    if own_adapter_norm is not None and max_adapter_norm_ratio is not None:
        for agent in sorted(parts.adapters):
            why = adapter_norm_refusal(
                own_adapter_norm, parts.adapters[agent], max_ratio=max_adapter_norm_ratio
            )
            if why is not None:
                refused[PullTarget(agent, PartKind.ADAPTER)] = why
                del parts.adapters[agent]
    for target in refused:
        parts.rejected[target] = NORM_REASON
    return refused
