"""An expert agent's FedWave state between rounds, as one checkpoint (issue 10, resume).

What a restarted expert needs to go on where it stopped, saved after each concluded round
``t`` through the agent's :class:`~peerlm.agent.checkpoint.CheckpointStore` (atomic and
verified: a SIGKILL mid-save leaves the previous round's checkpoint):

* tensors: ``adapter/…`` (the LoRA factors), ``router/…`` (the round's aggregate, Eq. 9,
  adopted as the router of round t+1), ``vclayer/…`` (this stage's VCLayer as trained in
  round t), ``predecessor/…`` / ``successor/…`` (the adjacent stages' VCLayers that round
  t+1's collaborative loss uses; absent for a stage that does not exist or never arrived);
* state: the round ``t``, the loop's report so far and the trainer's batch-sampling RNG.

:func:`pack_expert_state` and :func:`unpack_expert_state` are pure (no I/O): the loop
(:class:`~peerlm.agent.fedwave.expert_loop.ExpertLoop`) saves and loads on its model thread.
A checkpoint whose tensors do not fit this agent's router, VCLayer or adapter is refused
(``ValueError``) before anything is loaded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from peerlm.agent.fedwave.params import VCLayerSettings
from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = ["ExpertState", "pack_expert_state", "unpack_expert_state"]

_GROUPS = ("adapter", "router", "vclayer", "predecessor", "successor")
#: ``state["kind"]``: a FedWave expert's checkpoint (not a CPM round's).
KIND = "fedwave-expert"


@dataclass(frozen=True)
class ExpertState:
    """A restored expert: the last round it concluded and what it held after it."""

    round: int
    adapter: dict[str, torch.Tensor]
    router: dict[str, torch.Tensor]
    vclayer: dict[str, torch.Tensor]
    predecessor: VCLayer | None
    successor: VCLayer | None
    report: dict[str, Any]
    rng: Any  # random.Random.getstate() of the trainer's batch sampler


def pack_expert_state(
    round_: int,
    *,
    adapter: Mapping[str, torch.Tensor],
    router: Mapping[str, torch.Tensor],
    vclayer: VCLayer,
    predecessor: VCLayer | None,
    successor: VCLayer | None,
    report: Mapping[str, Any],
    rng: random.Random,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON state) of round ``round_``'s end for ``CheckpointStore.save``."""
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, Mapping[str, torch.Tensor] | None] = {
        "adapter": adapter,
        "router": router,
        "vclayer": vclayer.state_dict(),
        "predecessor": predecessor.state_dict() if predecessor is not None else None,
        "successor": successor.state_dict() if successor is not None else None,
    }
    for group, part in groups.items():
        for name, tensor in (part or {}).items():
            tensors[f"{group}/{name}"] = tensor.detach().to("cpu").contiguous().clone()
    version, internal, gauss = rng.getstate()
    state = {
        "kind": KIND,
        "round": round_,
        "report": _finite(dict(report)),
        "rng": [version, list(internal), gauss],
    }
    return tensors, state


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None (the checkpoint's JSON refuses NaN; a
    round's loss can be one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def unpack_expert_state(
    tensors: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    *,
    router_shapes: Mapping[str, tuple[int, ...]],
    hidden_size: int,
    vclayer: VCLayerSettings,
) -> ExpertState:
    """The expert state of a checkpoint; ``ValueError`` if it is not a FedWave expert's or
    its router / VCLayers do not fit this agent (the adapter is checked when loaded)."""
    if state.get("kind") != KIND:
        raise ValueError(f"checkpoint is not a FedWave expert's (kind {state.get('kind')!r})")
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in _GROUPS}
    for key, tensor in tensors.items():
        group, _, name = key.partition("/")
        if group not in groups or not name:
            raise ValueError(f"checkpoint tensor {key!r} belongs to no part of the expert")
        groups[group][name] = tensor
    shapes = {k: tuple(v.shape) for k, v in groups["router"].items()}
    if shapes != dict(router_shapes):
        raise ValueError(f"checkpoint router shapes {shapes} are not this agent's")

    def layer(group: str, required: bool) -> VCLayer | None:
        if not groups[group]:
            if required:
                raise ValueError(f"checkpoint holds no {group} VCLayer")
            return None
        out = VCLayer(hidden_size, vclayer)
        try:
            out.load_state_dict(groups[group])
        except RuntimeError as err:  # names or shapes that do not fit
            raise ValueError(f"checkpoint {group} VCLayer does not fit: {err}") from None
        out.requires_grad_(group == "vclayer")
        return out

    own = layer("vclayer", True)
    assert own is not None
    version, internal, gauss = state["rng"]
    return ExpertState(
        round=int(state["round"]),
        adapter=groups["adapter"],
        router=groups["router"],
        vclayer=own.state_dict(),
        predecessor=layer("predecessor", False),
        successor=layer("successor", False),
        report=dict(state["report"]),
        rng=(int(version), tuple(internal), gauss),
    )
