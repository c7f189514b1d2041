"""LoRA settings and their application to a causal LM through ``peft``.

The KNEXA-FL agent keeps the base weights W0 frozen and trains only a LoRA module phi_i
("Agent-Side Operations"); the paper's Table 3/7 report the resulting *Trainable %*, which
:func:`trainable_share` computes. Which linear layers receive LoRA depends on the
architecture's module names; :func:`default_target_modules` holds the choice per model type
(attention projections, the usual LoRA placement) and refuses to guess for an unknown one.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "LoraSettings",
    "apply_lora",
    "default_target_modules",
    "known_model_types",
    "trainable_share",
]

# Attention projections per ``config.model_type``. peft matches a name in this list against
# the end of each module path, so "c_proj" in GPT-2 covers both the attention output and the
# MLP output projection (both Conv1D), while "dense" in GPT-NeoX/BLOOM is only the attention
# output ("dense_h_to_4h"/"dense_4h_to_h" do not end in ".dense"). Values are tuples so the
# table cannot be mutated at run time.
_TARGETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "gpt2": ("c_attn", "c_proj"),
        "gpt_bigcode": ("c_attn", "c_proj"),
        "gpt_neox": ("query_key_value", "dense"),
        "bloom": ("query_key_value", "dense"),
        "falcon": ("query_key_value", "dense"),
        "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "qwen3": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "llama": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mistral": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "gemma": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "opt": ("q_proj", "k_proj", "v_proj", "out_proj"),
    }
)

# Architectures whose projections are ``transformers.pytorch_utils.Conv1D`` (weight stored as
# (in, out)): peft must be told ``fan_in_fan_out=True`` or it transposes the LoRA update.
_CONV1D_TYPES = frozenset({"gpt2", "gpt_bigcode"})


class LoraSettings(BaseModel):
    """LoRA hyper-parameters (Hu et al. 2021) for the agent's adapter phi_i.

    ``target_modules=None`` takes :func:`default_target_modules` for the model's type.
    The paper tunes the rank per backbone to keep 2.2-3.0 % of parameters trainable; r=8 on
    the attention projections lands in that range for the project's tiny models.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    r: int = Field(default=8, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(default=16.0, gt=0, description="Scaling numerator (alpha / r).")
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | None = Field(
        default=None, description="Module names to adapt; None: per-architecture default."
    )


def known_model_types() -> tuple[str, ...]:
    """Model types that have default LoRA target modules."""
    return tuple(sorted(_TARGETS))


def default_target_modules(model_type: str) -> list[str]:
    """The LoRA target modules for ``config.model_type``; ``ValueError`` if unknown."""
    try:
        return list(_TARGETS[model_type])
    except KeyError:
        raise ValueError(
            f"no default LoRA target modules for model type {model_type!r} "
            f"(known: {', '.join(known_model_types())}); set target_modules explicitly, "
            "e.g. the names of the attention projection layers"
        ) from None


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with a fresh LoRA adapter; only the LoRA weights require grad.

    The A matrices are initialised from torch's global RNG (B is zero, so the wrapped model
    starts equal to the base): seed it beforehand for a reproducible initial adapter.
    """
    config: Any = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    targets = (
        list(settings.target_modules)
        if settings.target_modules
        else default_target_modules(model_type)
    )
    lora_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.r,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft computes alpha / r
        lora_dropout=settings.dropout,
        target_modules=targets,
        fan_in_fan_out=model_type in _CONV1D_TYPES,
        bias="none",
    )
    try:
        with warnings.catch_warnings():
            # peft probes the deprecated ``is_gradient_checkpointing`` attribute of
            # transformers 5 models; the FutureWarning is theirs, not actionable here.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            peft_model = get_peft_model(model, lora_config)  # type: ignore[arg-type]
    except ValueError as exc:
        # peft's message names the missing targets but not what the model offers.
        raise ValueError(
            f"cannot apply LoRA to {model_type or type(model).__name__} with target modules "
            f"{targets}: {exc}"
        ) from exc
    return peft_model  # type: ignore[no-any-return]


def trainable_share(model: torch.nn.Module) -> tuple[int, int, float]:
    """(trainable parameters, total parameters, trainable / total): Table 3's *Trainable %*.

    The total counts the frozen base and the adapter together, as peft's
    ``print_trainable_parameters`` does.
    """
    trainable = 0
    total = 0
    for param in model.parameters():
        n = param.numel()
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total, (trainable / total if total else 0.0)
