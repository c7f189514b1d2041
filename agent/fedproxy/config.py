"""A member's check of the proxy configuration its owner sends: only what the member's own
base model implies is accepted.

The owner's proxy payload carries a configuration (``peerlm.config``) from which a member
used to build the model. Every size in it (vocabulary, hidden size, positions, heads,
intermediate size) was the owner's to choose, and building even on the meta device costs
memory in some of them (buffers made eagerly, quadratic in the positions), so a hostile
owner could make a member allocate gigabytes from a config of a few hundred kilobytes.

Here the member builds nothing from the owner's numbers. :func:`member_proxy_config`
derives the proxy configuration from the member's **own** base configuration (the model it
holds: same architecture and ``model_type``, the same sizes), taking only the kept-block
list from the owner (:class:`~peerlm.agent.fedproxy.proxy.ProxyInfo`, checked to be ascending
indices of the base's blocks), and refuses an owner's configuration that says anything
else, before any model is constructed. So the proxy a member builds is never larger than
its own base model, whatever the owner sends. The same check pins the embeddings: a
member's base with tied embeddings accepts only a proxy with tied embeddings, and a
configuration with a field its base does not have (an extra trainable part) is refused.

Refusals are :class:`~peerlm.agent.fedproxy.proxy.ProxyError`: ``config`` (a field differs
from what the base implies, or is extra), ``mismatch`` (another model type or block count),
``model`` / ``blocks`` (malformed ``peerlm_proxy``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from peerlm.agent.fedproxy.proxy import (
    PROXY_CONFIG_KEY,
    ProxyError,
    ProxyInfo,
    blocks_path,
)
from transformers import AutoModelForCausalLM, PretrainedConfig

__all__ = ["CONFIG_REASON", "DerivedProxy", "member_proxy_config"]

#: The refusal reason (metric label) of an owner's configuration the base does not imply.
CONFIG_REASON: Final = "config"

#: Fields that say nothing about the model's shape or computation: where the files came
#: from, which library wrote them, how it caches at inference, the dtype it was saved in
#: (the tensors' own dtypes are checked by the codec).
_IGNORED: Final = frozenset(
    {"_name_or_path", "transformers_version", "use_cache", "torch_dtype", "dtype"}
)


@dataclass(frozen=True)
class DerivedProxy:
    """The proxy a member accepts: its configuration (derived from the member's base),
    the blocks, and the state-dict shapes the payload must have."""

    config: PretrainedConfig
    info: ProxyInfo
    shapes: dict[str, tuple[int, ...]]


def _derive(base: PretrainedConfig, info: ProxyInfo) -> PretrainedConfig:
    """``base``'s configuration with ``len(kept)`` layers and ``peerlm_proxy`` set, as
    :func:`~peerlm.agent.fedproxy.proxy.build_proxy` makes it from the same base."""
    layers = int(base.num_hidden_layers)
    derived = copy.deepcopy(base)
    derived.num_hidden_layers = len(info.kept_blocks)
    layer_types = getattr(derived, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == layers:
        derived.layer_types = [layer_types[i] for i in info.kept_blocks]
    setattr(derived, PROXY_CONFIG_KEY, info.to_dict())
    return derived


def _differences(derived: dict[str, Any], offered: Mapping[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(derived) | set(offered)):
        if key in _IGNORED or key == PROXY_CONFIG_KEY:
            continue
        if key not in derived:
            out.append(f"{key} (not in the base's configuration)")
        elif key not in offered or offered[key] != derived[key]:
            out.append(f"{key}={offered.get(key)!r} (the base implies {derived[key]!r})")
    return out


def member_proxy_config(base: PretrainedConfig, offered: Mapping[str, Any]) -> DerivedProxy:
    """The proxy configuration a member with base configuration ``base`` accepts for the
    owner's ``offered`` one (its ``to_dict`` form, from the payload's header).

    Order matters: the owner's numbers are compared as JSON values first, and only the
    configuration derived from ``base`` is ever built (on the meta device, for the shapes),
    so a refused configuration allocates nothing and an accepted one costs at most what
    ``base`` costs.
    """
    if getattr(base, PROXY_CONFIG_KEY, None) is not None:
        raise ProxyError("the member's base model is itself a proxy", reason="mismatch")
    info = ProxyInfo.from_dict(offered.get(PROXY_CONFIG_KEY))
    model_type = str(base.model_type)
    layers = getattr(base, "num_hidden_layers", None)
    if info.source_model_type != model_type or info.source_layers != layers:
        raise ProxyError(
            f"the proxy comes from a {info.source_model_type} of {info.source_layers} blocks; "
            f"this member's base is a {model_type} of {layers}",
            reason="mismatch",
        )
    derived = _derive(base, info)
    # Compared as the owner's configuration travels (JSON: integer keys become strings).
    wrong = _differences(json.loads(json.dumps(derived.to_dict(), sort_keys=True)), offered)
    if wrong:
        raise ProxyError(
            f"the owner's proxy configuration is not derived from this member's base: "
            f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}",
            reason=CONFIG_REASON,
        )
    # A configuration of the member's own sizes: building it on the meta device costs at
    # most what the member's base model costs.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(derived)  # type: ignore[no-untyped-call]
    if blocks_path(model) != info.blocks_path:
        raise ProxyError(
            f"the proxy's blocks are {info.blocks_path}, this base's {blocks_path(model)}",
            reason="mismatch",
        )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return DerivedProxy(derived, info, shapes)
