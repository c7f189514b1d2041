"""FedWave's knobs in one section: the workflow and each component's settings.

A settings model (``AgentSettings``, ``peerlm up``) can hold :class:`FedWaveSettings` as
``fedwave:``; nothing reads it there yet. Each component keeps its own model beside its
maths (one definition of every knob, its default and its bounds); this section only puts
them together and checks what spans two of them.
"""

from __future__ import annotations

import torch
from peerlm.agent.fedwave.collab_loss import CollabLossSettings
from peerlm.agent.fedwave.dpo import DPOSettings
from peerlm.agent.fedwave.router import MoERouter, RouterSettings
from peerlm.agent.fedwave.vclayer import VCLayer, VCLayerSettings
from peerlm.agent.fedwave.workflow import Workflow
from pydantic import Field, model_validator

from peerlm.config import Section

__all__ = ["FedWaveSettings"]


class FedWaveSettings(Section):
    """The workflow, VCLayer, collaborative loss, router and DPO settings."""

    workflow: Workflow | None = None
    vclayer: VCLayerSettings = VCLayerSettings()
    collab: CollabLossSettings = CollabLossSettings()
    router: RouterSettings = RouterSettings()
    dpo: DPOSettings = DPOSettings()
    # Seeds every agent's initial router (all start equal) and each stage's VCLayer
    # (stage i from seed + 1 + i, so adjacent stages do not start identical).
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _fits_workflow(self) -> FedWaveSettings:
        if self.workflow is not None and self.router.top_k > len(self.workflow.stages):
            raise ValueError(
                f"router.top_k ({self.router.top_k}) exceeds the workflow's "
                f"{len(self.workflow.stages)} stages (experts)"
            )
        return self

    def initial_vclayer(self, hidden_size: int, stage_index: int) -> VCLayer:
        """Stage ``stage_index``'s initial VCLayer (generator seeded ``seed + 1 + i``)."""
        if stage_index < 0:
            raise ValueError(f"stage index must not be negative, got {stage_index}")
        generator = torch.Generator().manual_seed(self.seed + 1 + stage_index)
        return VCLayer(hidden_size, self.vclayer, generator=generator)

    def initial_router(self, hidden_size: int) -> MoERouter:
        """The router every agent of the workflow starts from (generator seeded ``seed``)."""
        if self.workflow is None:
            raise ValueError("the initial router needs a workflow (one expert per stage)")
        generator = torch.Generator().manual_seed(self.seed)
        return MoERouter(hidden_size, len(self.workflow.stages), self.router, generator=generator)
