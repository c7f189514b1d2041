"""FedWave's settings models, without torch: what a configuration file holds.

The agent's settings (``AgentSettings.fedwave``) and ``peerlm health`` load configuration
without loading torch; the maths modules (:mod:`~peerlm.agent.fedwave.vclayer`,
:mod:`~peerlm.agent.fedwave.collab_loss`, :mod:`~peerlm.agent.fedwave.router`,
:mod:`~peerlm.agent.fedwave.dpo`) re-export the model of their component from here, so each
knob, its default and its bounds are still defined once, beside the paper's number.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_BETA",
    "CollabLossSettings",
    "DPOSettings",
    "RouterSettings",
    "VCLayerSettings",
]

#: The paper's β (Section 4.4, Figure 3d).
DEFAULT_BETA = 0.1


class VCLayerSettings(BaseModel):
    """The VCLayer's size: ``d_vc`` (split over ``heads``) and the initial weight scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    d_vc: int = Field(default=64, ge=1, le=65536)
    heads: int = Field(default=4, ge=1, le=1024)
    init_std: float = Field(default=0.02, gt=0, le=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> VCLayerSettings:
        if self.d_vc % self.heads:
            raise ValueError(f"d_vc ({self.d_vc}) must be a multiple of heads ({self.heads})")
        return self


class CollabLossSettings(BaseModel):
    """γ, the λ weights and the cosine targets of Eq. 2-6."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gamma: float = Field(default=0.5, ge=0)
    lambda_pos: float = Field(default=0.1, ge=0)
    lambda_cont: float = Field(default=0.1, ge=0)
    lambda_cons: float = Field(default=0.1, ge=0)
    t_pos: float = Field(default=0.5, ge=-1, le=1)
    t_cont: float = Field(default=0.9, ge=-1, le=1)
    t_cons: float = Field(default=0.8, ge=-1, le=1)


class RouterSettings(BaseModel):
    """The router's width, inference top-k, regulariser weights and local objective."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: int = Field(default=64, ge=1, le=65536)
    top_k: int = Field(default=2, ge=1)
    delta_balance: float = Field(default=0.01, ge=0)
    delta_entropy: float = Field(default=0.01, ge=0)
    objective: Literal["stage_label", "paper"] = "stage_label"
    init_std: float = Field(default=0.02, gt=0, le=1)
    # The router's own AdamW learning rate, apart from the expert's (issue 10: at the
    # experts' rate the aggregated router stays near uniform; docs/fedwave.md section 6).
    # 1e-2 as the workflow experiment chose it on routing accuracy; None: the agent's
    # learning_rate. The part admission's max_router_update_rms lets such routers in.
    learning_rate: float | None = Field(default=1e-2, gt=0, le=10)


class DPOSettings(BaseModel):
    """DPO's preference strength β."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    beta: float = Field(default=DEFAULT_BETA, gt=0)
