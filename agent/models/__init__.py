"""Models for the agent: locally built tiny LMs (:mod:`.tiny`) and LoRA (:mod:`.lora`)."""

from __future__ import annotations

from peerlm.agent.models.lora import (
    LoraSettings,
    apply_lora,
    default_target_modules,
    trainable_share,
)
from peerlm.agent.models.tiny import ARCHITECTURES, BuildEvent, ModelInfo, build_models

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
