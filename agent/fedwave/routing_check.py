"""An expert's check of a round's router aggregate on its own stage's data, before it adopts
the aggregate (docs/fedwave.md, section 5, "A hostile member of the workflow").

The norm bounds (:mod:`~peerlm.agent.fedwave.part_admission`) and the robust aggregate
(:func:`~peerlm.agent.fedwave.router.median_routers`) bound what one member's router can do
to the aggregate; neither looks at what the aggregate *does*. Agent i is the one member
that knows, from its private examples, where its stage's inputs must go: to expert i. So
before adopting a round's aggregate it routes a fixed sample of its own examples with the
aggregate and with the router it held before the round, and compares the mean routing
weight on its own expert (its *share*):

* refused if the share falls by more than ``margin`` (``fedwave.routing_check_margin``,
  default 0.1) in one round, or falls below ``1/N − margin`` (N experts: under the uniform
  router's share by more than the margin, wherever the previous round left it), so a
  member cannot erode the share by just under the margin round after round past the
  uniform router's;
* a refused aggregate is not adopted: the agent keeps the router it held before the round
  (counted ``peerlm_agent_fedwave_aggregates_rejected_total{reason="routing"}``, logged
  ``fedwave_aggregate_rejected``).

Why the router held before the round and not the agent's own trained one: the trained
router has just been fitted to stage i alone (its share is near 1 after a round), so every
honest aggregate, which must also route the other stages, would look like a large fall.
The cost of the check: an agent that refuses keeps another router than the agents that
adopted the aggregate, so the workflow's routers differ for a round (as with a late agent,
docs/fedwave.md section 4); an honest round that lowers a stage's share by more than the
margin is refused too. Pure (no I/O): the trainer supplies the pooled features
(:meth:`~peerlm.agent.fedwave.expert_round.ExpertTrainer.own_features`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from peerlm.agent.fedwave.router import MoERouter

__all__ = ["ROUTING_REASON", "own_expert_share", "routing_refusal"]

#: The rejection reason (metric label) of an aggregate refused by the routing check.
ROUTING_REASON = "routing"


def own_expert_share(
    template: MoERouter,
    state: Mapping[str, torch.Tensor],
    features: torch.Tensor,
    expert: int,
) -> float:
    """Mean routing weight α_expert of the router ``state`` (shaped as ``template``, which
    is left as it is) over the pooled features ``(B, d)``."""
    router = copy.deepcopy(template)
    router.load_state_dict(dict(state))
    router.eval()
    with torch.no_grad():
        alpha = router.route_pooled(features.to(torch.float32))
    return float(alpha[:, expert].mean())


def routing_refusal(before: float, after: float, *, n_experts: int, margin: float) -> str | None:
    """Why an aggregate whose own-expert share is ``after`` is refused by an agent whose
    router before the round had share ``before`` (a message), or None if it is accepted
    (module docstring). A NaN share is refused."""
    floor = 1.0 / n_experts - margin
    if after >= before - margin and (after >= floor or after >= before):
        return None
    return (
        f"the aggregate routes this agent's own stage examples to its expert with mean "
        f"weight {after:.4g}, against {before:.4g} with its router before the round: a fall "
        f"of more than {margin:g} (fedwave.routing_check_margin) or below 1/{n_experts} - "
        f"{margin:g}"
    )
