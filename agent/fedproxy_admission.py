"""What a FedProxy owner lets into its merge (issue 11 §1.5, for the cohort's proxy).

A member is admitted to the cohort, not trusted: its update passes the codec's checks
(blocks, names, shapes, dtypes, finite) and can still wreck the merged proxy for everyone,
for instance finite values of 1e30. Two checks stand between a member's update and the
proxy the owner publishes, both with no I/O:

* **A norm bound** (:func:`norm_refusal`): the member's task vector ``τ_k = φ_k − φ^(t−1)``
  may have an L2 norm of at most ``max_update_norm_ratio`` times the norm of the owner's
  proxy ``φ^(t−1)`` (all floating tensors, flattened, float64 so that 1e30 entries do not
  overflow to inf). Relative to the owner's proxy, not to the round's median task-vector
  norm: the owner's proxy is the one reference no member controls, it exists in a round
  with a single update, and a median over a small cohort is set by whoever is the majority
  (with two members a hostile one with a tiny update would make the honest one look like
  the outlier and get it refused). The bound is loose by design (default 1: an update as
  large as the model it fine-tunes is no fine-tuning step; measured honest updates are
  ~0.1-5% of it, docs/fedproxy.md); what passes it and still harms is the gate's.
* **An acceptance gate** (:func:`~peerlm.agent.acceptance.judge`, the same rule as the
  agent's adapters): the owner measures the merged proxy's held-out loss on its own
  validation texts; if it rose by more than ``acceptance_margin`` nats over the previous
  proxy's (or is not finite), the merge is not published: the previous proxy and scores are
  republished as the next round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["NORM_REASON", "norm_refusal", "state_norm", "update_norm"]

#: The refusal reason (metric label) of an update over the norm bound.
NORM_REASON = "norm"


def _floating(state: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(k for k, v in state.items() if v.is_floating_point())


def state_norm(state: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all floating tensors of ``state`` together, in float64."""
    total = 0.0
    for key in _floating(state):
        value = state[key].detach().to("cpu", torch.float64)
        total += float(torch.linalg.vector_norm(value) ** 2)
    return math.sqrt(total)


def update_norm(base: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> float:
    """``‖φ_k − φ‖``: the L2 norm of ``update``'s task vector against ``base`` over the
    floating tensors of ``base`` (``update`` has the same keys and shapes: the codec
    checked), in float64."""
    total = 0.0
    for key in _floating(base):
        diff = update[key].detach().to("cpu", torch.float64) - base[key].detach().to(
            "cpu", torch.float64
        )
        total += float(torch.linalg.vector_norm(diff) ** 2)
    return math.sqrt(total)


def norm_refusal(
    base: Mapping[str, torch.Tensor],
    update: Mapping[str, torch.Tensor],
    *,
    max_ratio: float | None,
    base_norm: float | None = None,
) -> str | None:
    """Why ``update`` is over the bound (a message), or None if it is within it (or there
    is no bound). ``base_norm``: :func:`state_norm` of ``base`` if the caller has it."""
    if max_ratio is None:
        return None
    reference = state_norm(base) if base_norm is None else base_norm
    norm = update_norm(base, update)
    limit = max_ratio * reference
    # Not ``norm > limit``: a NaN norm must be refused too.
    if norm <= limit:
        return None
    return (
        f"task vector norm {norm:.4g} exceeds {max_ratio:g} x the owner's proxy norm "
        f"{reference:.4g} (fedproxy.max_update_norm_ratio)"
    )
