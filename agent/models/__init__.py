"""Models for the agent: locally built tiny LMs (:mod:`.tiny`) and LoRA (:mod:`.lora`).

Lazy (:mod:`peerlm.exports`): reading the models cache imports no peft or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peerlm.exports import lazy_exports

if TYPE_CHECKING:
    from peerlm.agent.models.lora import (
        LoraSettings,
        apply_lora,
        default_target_modules,
        trainable_share,
    )
    from peerlm.agent.models.tiny import ARCHITECTURES, BuildEvent, ModelInfo, build_models

_EXPORTS = {
    "ARCHITECTURES": ("peerlm.agent.models.tiny", "ARCHITECTURES"),
    "BuildEvent": ("peerlm.agent.models.tiny", "BuildEvent"),
    "LoraSettings": ("peerlm.agent.models.lora", "LoraSettings"),
    "ModelInfo": ("peerlm.agent.models.tiny", "ModelInfo"),
    "apply_lora": ("peerlm.agent.models.lora", "apply_lora"),
    "build_models": ("peerlm.agent.models.tiny", "build_models"),
    "default_target_modules": ("peerlm.agent.models.lora", "default_target_modules"),
    "trainable_share": ("peerlm.agent.models.lora", "trainable_share"),
}

__all__ = [
    "ARCHITECTURES",
    "BuildEvent",
    "LoraSettings",
    "ModelInfo",
    "apply_lora",
    "build_models",
    "default_target_modules",
    "trainable_share",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
