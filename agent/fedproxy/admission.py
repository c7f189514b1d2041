"""What a FedProxy owner lets into its merge (poisoned updates to the cohort's proxy).

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

The norm bound is one number over the whole proxy, so an update concentrated on a few
coordinates (a competitor's vocabulary rows, at 0.42x the proxy's norm) passes it. Three
more checks bound an update where it lands (docs/fedproxy.md, "Hostile members"):

* **Frozen token embeddings** (:func:`frozen_refusal`): members send no update for the
  token embedding rows (an embedding row moves only for the tokens a member trained on,
  so those rows tell the owner which tokens they were); an update that changes them is
  refused (``frozen``).
* **Per-group bounds** (:func:`group_refusal`): every tensor, and every row of a tensor of
  two or more dimensions, may move by at most ``max_group_norm_ratio`` times its own
  reference (the group's norm, or its fair share of the proxy's norm where that is larger,
  so that a bias at zero can move at all), refused ``group_norm``;
* the owner's merge itself is robust to one member
  (:func:`~peerlm.agent.fedproxy.hties.support_clip`), and every member reports the harm a
  published proxy did on its own validation (:func:`harm_of`), which rolls it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = [
    "FROZEN_REASON",
    "GROUP_REASON",
    "NORM_REASON",
    "frozen_refusal",
    "group_refusal",
    "harm_of",
    "norm_refusal",
    "state_norm",
    "token_embedding_keys",
    "update_norm",
]

#: The refusal reason (metric label) of an update over the norm bound.
NORM_REASON = "norm"
#: ... of an update that changes the token embeddings (members send none).
FROZEN_REASON = "frozen"
#: ... of an update over a per-tensor or per-row bound.
GROUP_REASON = "group_norm"


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


def token_embedding_keys(model: torch.nn.Module) -> tuple[str, ...]:
    """The state-dict keys of ``model``'s token embeddings, input and output (a tied head
    is one tensor under two keys: both are named), sorted."""
    targets: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            targets.add(id(weight))
    return tuple(
        sorted(
            name
            for name, parameter in model.named_parameters(remove_duplicate=False)
            if id(parameter) in targets
        )
    )


def frozen_refusal(
    base: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor], keys: tuple[str, ...]
) -> str | None:
    """Why ``update`` is refused for changing a frozen tensor (``keys``), or None."""
    changed = [key for key in keys if key in base and not torch.equal(update[key], base[key])]
    if not changed:
        return None
    return (
        f"the update changes {changed[:3]}: the token embeddings are frozen in a cohort "
        "(members send no update for embedding rows)"
    )


def group_refusal(
    base: Mapping[str, torch.Tensor],
    update: Mapping[str, torch.Tensor],
    *,
    max_ratio: float | None,
    base_norm: float | None = None,
) -> str | None:
    """Why ``update`` moves one parameter group too far, or None (no bound: None).

    The groups: each floating tensor, and each row (first index) of a tensor of two or
    more dimensions. A group ``g`` of base values ``φ_g`` may move by
    ``‖τ_g‖ ≤ max_ratio · max(‖φ_g‖, share_g)``, where a tensor's share is the proxy's RMS
    entry times ``√numel`` and a row's share is its tensor's reference times
    ``√(row size / numel)``: relative to what the group holds, with a floor so that a
    tensor or row at zero (a bias at initialisation) can move at all. Float64.
    """
    if max_ratio is None:
        return None
    keys = _floating(base)
    total = state_norm(base) if base_norm is None else base_norm
    count = sum(base[key].numel() for key in keys)
    rms = total / math.sqrt(count) if count else 0.0
    for key in keys:
        old = base[key].detach().to("cpu", torch.float64)
        diff = update[key].detach().to("cpu", torch.float64) - old
        numel = max(1, old.numel())
        reference = max(float(torch.linalg.vector_norm(old)), rms * math.sqrt(numel))
        moved = float(torch.linalg.vector_norm(diff))
        # Not ``moved > limit``: a NaN must be refused too.
        if not moved <= max_ratio * reference:
            return (
                f"{key} moved by {moved:.4g}, over {max_ratio:g} x its reference "
                f"{reference:.4g} (fedproxy.max_group_norm_ratio)"
            )
        if old.dim() < 2:
            continue
        rows_old = old.reshape(old.shape[0], -1)
        rows = diff.reshape(old.shape[0], -1)
        share = reference * math.sqrt(rows_old.shape[1] / numel)
        row_reference = torch.clamp(torch.linalg.vector_norm(rows_old, dim=1), min=share)
        ratio = torch.linalg.vector_norm(rows, dim=1) / row_reference
        worst = int(torch.argmax(torch.nan_to_num(ratio, nan=math.inf)))
        if not float(ratio[worst]) <= max_ratio:
            return (
                f"{key} row {worst} moved by {float(ratio[worst]):.4g} x its reference, over "
                f"{max_ratio:g} (fedproxy.max_group_norm_ratio)"
            )
    return None


def harm_of(loss: float, previous_loss: float) -> float:
    """The harm a member reports of a published proxy: how much its held-out loss (nats,
    on the member's own validation texts) rose over the proxy it held before; NaN or inf
    count as infinite harm."""
    harm = loss - previous_loss
    return harm if math.isfinite(harm) else math.inf
