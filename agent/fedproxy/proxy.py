"""FedProxy's proxy: a sub-network of a causal LM made of some of its blocks, and the way back.

Section 4.1 compresses the owner's model ``M`` into a proxy that keeps only its most
influential transformer blocks (:mod:`peerlm.agent.fedproxy.compress` picks them); Section 4.3
writes the trained proxy back into ``M`` ("plug-in" fusion, ``φ ⊂ θ``). Both directions are
a renaming of state-dict keys, which this module holds:

* :func:`block_list` / :func:`blocks_path` — where a model keeps its blocks (the one
  ``nn.ModuleList`` of ``config.num_hidden_layers`` entries: ``transformer.h`` for GPT-2
  and BLOOM, ``gpt_neox.layers``, ``model.layers`` for Qwen2 and Llama-like models).
* :func:`proxy_state` — the proxy's state dict from ``M``'s: block ``kept[j]`` becomes block
  ``j``, every tensor outside the blocks (embeddings, final norm, head) is kept as is, the
  other blocks are dropped.
* :func:`build_proxy` — the proxy as a model of ``M``'s class whose configuration has
  ``len(kept)`` layers and records :class:`ProxyInfo` under ``peerlm_proxy``, so
  ``save_pretrained`` / ``from_pretrained`` carry it.
* :func:`fuse_state` / :func:`fuse_into` — ``M'``: ``M`` with every proxy tensor written
  back to the tensor it came from; the removed blocks stay ``M``'s.

Sans-IO except :func:`build_proxy` and :func:`fuse_into`, which only build or load modules
in memory; saving is the caller's (the CLI in ``peerlm/app/cli_fedproxy.py``). Every refusal
is a :class:`ProxyError` whose ``reason`` is a metric label.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch
from torch import nn
from transformers import PreTrainedModel

__all__ = [
    "PROXY_CONFIG_KEY",
    "ProxyError",
    "ProxyInfo",
    "block_list",
    "blocks_path",
    "build_proxy",
    "fuse_into",
    "fuse_state",
    "proxy_info",
    "proxy_state",
]

#: The configuration attribute that marks a model as a proxy and says where it came from.
PROXY_CONFIG_KEY: Final = "peerlm_proxy"


class ProxyError(ValueError):
    """A model, proxy or ratio that does not fit: ``reason`` is a short label (``model``,
    ``ratio``, ``empty``, ``shape``, ``keys``, ``mismatch``, ``non_finite``, ``blocks``)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ProxyInfo:
    """What a proxy records in its configuration (``config.peerlm_proxy``).

    ``kept_blocks`` are indices into the *source* model's blocks, ascending; block ``j`` of
    the proxy is block ``kept_blocks[j]`` of the source. ``block_influence`` holds the
    source's BI per block (Eq. 4) when the blocks were chosen by it.
    """

    source_model_type: str
    source_layers: int
    kept_blocks: tuple[int, ...]
    blocks_path: str
    ratio: float
    block_influence: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (lists, not tuples)."""
        out = asdict(self)
        out["kept_blocks"] = list(self.kept_blocks)
        out["block_influence"] = list(self.block_influence)
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> ProxyInfo:
        """Parse and check what :meth:`to_dict` wrote (a configuration is input too)."""
        if not isinstance(raw, Mapping):
            raise ProxyError(f"{PROXY_CONFIG_KEY} is not an object", reason="model")
        try:
            info = cls(
                source_model_type=str(raw["source_model_type"]),
                source_layers=int(raw["source_layers"]),
                kept_blocks=tuple(int(i) for i in raw["kept_blocks"]),
                blocks_path=str(raw["blocks_path"]),
                ratio=float(raw["ratio"]),
                block_influence=tuple(float(v) for v in raw.get("block_influence", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProxyError(f"{PROXY_CONFIG_KEY} is malformed: {exc}", reason="model") from exc
        kept = info.kept_blocks
        if not kept or list(kept) != sorted(set(kept)) or kept[0] < 0:
            raise ProxyError(f"kept blocks {list(kept)} are not ascending", reason="blocks")
        if kept[-1] >= info.source_layers:
            raise ProxyError(
                f"kept block {kept[-1]} beyond the source's {info.source_layers}", reason="blocks"
            )
        return info


# ------------------------------------------------------------------------ block layout


def blocks_path(model: nn.Module) -> str:
    """The dotted name of the model's block list (the one ``nn.ModuleList`` whose length is
    ``config.num_hidden_layers``)."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ProxyError("the model's configuration names no num_hidden_layers", reason="model")
    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == layers and name
    ]
    if len(found) != 1:
        raise ProxyError(
            f"expected one block list of {layers} modules, found {found or 'none'}",
            reason="model",
        )
    return str(found[0])


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks, in order (see :func:`blocks_path`)."""
    module = model.get_submodule(blocks_path(model))
    assert isinstance(module, nn.ModuleList)
    return module


def _block_pattern(path: str) -> re.Pattern[str]:
    return re.compile(re.escape(path) + r"\.(\d+)\.(.+)")


def _check_kept(kept: Sequence[int], layers: int) -> tuple[int, ...]:
    out = tuple(int(i) for i in kept)
    if not out:
        raise ProxyError("a proxy keeps at least one block", reason="blocks")
    if list(out) != sorted(set(out)) or out[0] < 0 or out[-1] >= layers:
        raise ProxyError(
            f"kept blocks {list(out)} must be ascending, distinct and in [0, {layers})",
            reason="blocks",
        )
    return out


# ------------------------------------------------------------------------ compression


def proxy_state(
    full: Mapping[str, torch.Tensor], path: str, kept: Sequence[int], layers: int
) -> dict[str, torch.Tensor]:
    """The proxy's state dict: block ``kept[j]`` renamed to block ``j``, other blocks
    dropped, every tensor outside ``path`` unchanged (the same tensor objects)."""
    kept_t = _check_kept(kept, layers)
    new_index = {old: new for new, old in enumerate(kept_t)}
    pattern = _block_pattern(path)
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        match = pattern.fullmatch(key)
        if match is None:
            out[key] = value
            continue
        old = int(match.group(1))
        if old >= layers:
            raise ProxyError(f"{key}: block {old} beyond {layers}", reason="keys")
        if old in new_index:
            out[f"{path}.{new_index[old]}.{match.group(2)}"] = value
    return out


def proxy_info(model: nn.Module) -> ProxyInfo | None:
    """The model's :class:`ProxyInfo`, or None when it is not a proxy."""
    raw = getattr(getattr(model, "config", None), PROXY_CONFIG_KEY, None)
    return None if raw is None else ProxyInfo.from_dict(raw)


def build_proxy(
    model: PreTrainedModel,
    kept: Sequence[int],
    *,
    ratio: float,
    influence: Sequence[float] = (),
) -> PreTrainedModel:
    """A proxy of ``model`` made of the blocks ``kept`` (ascending source indices).

    The proxy is a model of the same class and dtype whose configuration has
    ``len(kept)`` layers (``layer_types``, where the configuration has them, sliced the same
    way) and records :class:`ProxyInfo` under ``peerlm_proxy``. Its tensors are copies of
    ``model``'s. A proxy of a proxy records indices into the original source.

    Refuses GPT-2 configurations with ``scale_attn_by_inverse_layer_idx``: there a block's
    computation depends on its position, so a renumbered block is not the same function.
    """
    config = model.config
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ProxyError(
            "scale_attn_by_inverse_layer_idx makes a block depend on its index", reason="model"
        )
    path = blocks_path(model)
    layers = int(config.num_hidden_layers)
    kept_t = _check_kept(kept, layers)
    if influence and len(influence) != layers:
        raise ProxyError(f"{len(influence)} influences for {layers} blocks", reason="blocks")
    parent = proxy_info(model)
    if parent is None:
        info = ProxyInfo(
            source_model_type=str(config.model_type),
            source_layers=layers,
            kept_blocks=kept_t,
            blocks_path=path,
            ratio=float(ratio),
            block_influence=tuple(float(v) for v in influence),
        )
    else:
        info = ProxyInfo(
            source_model_type=parent.source_model_type,
            source_layers=parent.source_layers,
            kept_blocks=tuple(parent.kept_blocks[i] for i in kept_t),
            blocks_path=path,
            ratio=1.0 - len(kept_t) / parent.source_layers,
            block_influence=parent.block_influence,
        )
    new_config = copy.deepcopy(config)
    new_config.num_hidden_layers = len(kept_t)
    layer_types = getattr(new_config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == layers:
        new_config.layer_types = [layer_types[i] for i in kept_t]
    setattr(new_config, PROXY_CONFIG_KEY, info.to_dict())
    dtype = next(model.parameters()).dtype
    proxy: PreTrainedModel = type(model)(new_config)
    as_module: nn.Module = proxy  # transformers' own .to/.eval signatures do not type-check
    as_module.to(dtype=dtype)
    state = proxy_state(model.state_dict(), path, kept_t, layers)
    proxy.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    as_module.eval()
    return proxy


# ------------------------------------------------------------------------ fusion


def fuse_state(
    base: Mapping[str, torch.Tensor],
    proxy: Mapping[str, torch.Tensor],
    info: ProxyInfo,
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """``M'``'s state dict and the base keys whose values changed.

    Every proxy tensor is written to the base tensor it came from (proxy block ``j`` to
    source block ``info.kept_blocks[j]``; tensors outside the blocks by name), cast to the
    base tensor's dtype. Refuses a proxy key with no counterpart, a base tensor outside the
    blocks that the proxy lacks, another shape, or a non-finite value.
    """
    pattern = _block_pattern(info.blocks_path)
    out = dict(base)
    covered: set[str] = set()
    for key, value in proxy.items():
        match = pattern.fullmatch(key)
        if match is None:
            target = key
        else:
            j = int(match.group(1))
            if j >= len(info.kept_blocks):
                raise ProxyError(
                    f"{key}: the proxy records {len(info.kept_blocks)} blocks", reason="keys"
                )
            target = f"{info.blocks_path}.{info.kept_blocks[j]}.{match.group(2)}"
        if target not in base:
            raise ProxyError(f"{key}: the base model has no {target}", reason="keys")
        if tuple(value.shape) != tuple(base[target].shape):
            raise ProxyError(
                f"{key}: shape {tuple(value.shape)}, the base's {target} is "
                f"{tuple(base[target].shape)}",
                reason="shape",
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ProxyError(f"{key}: non-finite values", reason="non_finite")
        out[target] = value.detach().to(dtype=base[target].dtype, device=base[target].device)
        covered.add(target)
    outside = [k for k in base if pattern.fullmatch(k) is None and k not in covered]
    if outside:
        raise ProxyError(f"the proxy lacks {outside[:3]}", reason="keys")
    changed = tuple(k for k in covered if not torch.equal(out[k], base[k]))
    return out, tuple(sorted(changed))


def fuse_into(base: PreTrainedModel, proxy: PreTrainedModel) -> tuple[str, ...]:
    """Write ``proxy`` into ``base`` in place (Section 4.3); the base keys that changed.

    Checks that ``proxy`` is a proxy of a model like ``base``: same model type, the same
    number of source blocks, the same block list.
    """
    info = proxy_info(proxy)
    if info is None:
        raise ProxyError(f"the proxy's configuration has no {PROXY_CONFIG_KEY}", reason="model")
    config = base.config
    if proxy_info(base) is not None:
        raise ProxyError("the base model is itself a proxy", reason="mismatch")
    if str(config.model_type) != info.source_model_type:
        raise ProxyError(
            f"the proxy comes from a {info.source_model_type} model, the base is "
            f"{config.model_type}",
            reason="mismatch",
        )
    if int(config.num_hidden_layers) != info.source_layers:
        raise ProxyError(
            f"the proxy comes from a model of {info.source_layers} blocks, the base has "
            f"{config.num_hidden_layers}",
            reason="mismatch",
        )
    if blocks_path(base) != info.blocks_path:
        raise ProxyError(
            f"the proxy's blocks are {info.blocks_path}, the base's {blocks_path(base)}",
            reason="mismatch",
        )
    fused, changed = fuse_state(base.state_dict(), proxy.state_dict(), info)
    base.load_state_dict(fused, strict=True)
    return changed
