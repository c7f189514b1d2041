"""FedWave's knobs in one section: the workflow and each component's settings.

A settings model (``AgentSettings``, ``peerlm up``) can hold :class:`FedWaveSettings` as
``fedwave:``; nothing reads it there yet. Each component keeps its own model beside its
maths (one definition of every knob, its default and its bounds); this section only puts
them together and checks what spans two of them.
"""

from __future__ import annotations

from peerlm.agent.fedwave.collab_loss import CollabLossSettings
from peerlm.agent.fedwave.dpo import DPOSettings
from peerlm.agent.fedwave.router import RouterSettings
from peerlm.agent.fedwave.vclayer import VCLayerSettings
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
