"""An expert agent's FedWave state between rounds, as one checkpoint, so a restarted agent resumes.

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

**Keyed and checked on restore** (hostile-member audit: the store's SHA-256s are unkeyed, so
whoever can write the state directory (a co-tenant, a restored backup, a sidecar) could
put a NaN router in a checkpoint, recompute the hashes, and the expert loaded it). With a
``key`` (:func:`load_or_create_key`: 32 random bytes in ``checkpoint.key`` beside the
checkpoints directory, created 0600, a key readable by others refused), the packed state
carries ``mac``, an HMAC-SHA256 over every tensor (name, dtype, shape, bytes) and the JSON
state; :func:`unpack_expert_state` refuses a checkpoint without it or with another
(reason ``mac``), then checks the values whatever the MAC says: every tensor floating
point and finite (``non_finite``), the router's and VCLayers' shapes this agent's
(``shape``), the round, report and RNG well formed (``state``). A refusal is an
:class:`ExpertCheckpointError` (a ``ValueError`` with the reason), raised before anything
is loaded; the expert loop counts it in ``peerlm_agent_fedwave_checkpoint_refusals_total``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import random
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from peerlm.agent.fedwave.params import VCLayerSettings
from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = [
    "KEY_FILE",
    "ExpertCheckpointError",
    "ExpertState",
    "load_or_create_key",
    "pack_expert_state",
    "unpack_expert_state",
]

#: The per-agent checkpoint key's file name, beside the checkpoints directory.
KEY_FILE: Final = "checkpoint.key"
_KEY_BYTES: Final = 32


class ExpertCheckpointError(ValueError):
    """A FedWave expert's checkpoint refused on restore; ``reason`` is a metric label
    (``mac``, ``non_finite``, ``shape``, ``state``)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_or_create_key(path: Path) -> bytes:
    """The agent's checkpoint key at ``path``: created (32 random bytes, mode 0600, never
    overwritten) if absent. ``ValueError`` if it is not a regular file of 32 bytes or if
    its group or others may read or write it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"checkpoint key {path} is not a regular file")
    if info.st_mode & 0o077:
        raise ValueError(
            f"checkpoint key {path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be "
            "readable by its owner only (chmod 600)"
        )
    key = path.read_bytes()
    if len(key) != _KEY_BYTES:
        raise ValueError(f"checkpoint key {path} holds {len(key)} bytes, not {_KEY_BYTES}")
    return key


def _mac(key: bytes, tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> str:
    """HMAC-SHA256 over the tensors (sorted by name: name, dtype, shape, bytes) and the
    canonical JSON of ``state`` without its ``mac``."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    body = {k: v for k, v in state.items() if k != "mac"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    return h.hexdigest()


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
    key: bytes | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON state) of round ``round_``'s end for ``CheckpointStore.save``; with
    ``key``, the state carries the HMAC of both (``mac``)."""
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
    if key is not None:
        # Through the JSON round trip the store makes, so the MAC covers what is loaded.
        state = json.loads(json.dumps(state))
        state["mac"] = _mac(key, tensors, state)
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
    key: bytes | None = None,
) -> ExpertState:
    """The expert state of a checkpoint; ``ValueError`` if it is not a FedWave expert's,
    :class:`ExpertCheckpointError` if ``key`` is given and its MAC is missing or wrong, or
    (whatever the key) a tensor is not floating point and finite, its router / VCLayers do
    not fit this agent or its state is malformed (the adapter's names and shapes are
    checked when loaded)."""
    if state.get("kind") != KIND:
        raise ValueError(f"checkpoint is not a FedWave expert's (kind {state.get('kind')!r})")
    if key is not None:
        mac = state.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, tensors, state)):
            raise ExpertCheckpointError(
                "checkpoint's MAC is missing or does not match this agent's checkpoint key "
                "(written by something else, or the key was replaced): refused",
                reason="mac",
            )
    for name, tensor in sorted(tensors.items()):
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise ExpertCheckpointError(
                f"checkpoint tensor {name!r} is not finite floating point ({tensor.dtype}): "
                "refused",
                reason="non_finite",
            )
    round_, report, rng_state = state.get("round"), state.get("report"), state.get("rng")
    if (
        isinstance(round_, bool)
        or not isinstance(round_, int)
        or round_ < 1
        or not isinstance(report, dict)
        or not (isinstance(rng_state, list) and len(rng_state) == 3)
    ):
        raise ExpertCheckpointError(
            "checkpoint state is malformed (round, report or RNG)", reason="state"
        )
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in _GROUPS}
    for label, tensor in tensors.items():
        group, _, name = label.partition("/")
        if group not in groups or not name:
            raise ExpertCheckpointError(
                f"checkpoint tensor {label!r} belongs to no part of the expert", reason="shape"
            )
        groups[group][name] = tensor
    shapes = {k: tuple(v.shape) for k, v in groups["router"].items()}
    if shapes != dict(router_shapes):
        raise ExpertCheckpointError(
            f"checkpoint router shapes {shapes} are not this agent's", reason="shape"
        )

    def layer(group: str, required: bool) -> VCLayer | None:
        if not groups[group]:
            if required:
                raise ExpertCheckpointError(f"checkpoint holds no {group} VCLayer", reason="shape")
            return None
        out = VCLayer(hidden_size, vclayer)
        try:
            out.load_state_dict(groups[group])
        except RuntimeError as err:  # names or shapes that do not fit
            raise ExpertCheckpointError(
                f"checkpoint {group} VCLayer does not fit: {err}", reason="shape"
            ) from None
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
