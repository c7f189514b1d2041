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
    "DEFAULT_DPO_BATCH",
    "DEFAULT_DPO_LR",
    "DEFAULT_DPO_STEPS",
    "DEFAULT_MAX_NEW_TOKENS",
    "AssemblySettings",
    "CollabLossSettings",
    "DPOSettings",
    "RouterSettings",
    "VCLayerSettings",
]

#: The paper's β (Section 4.4, Figure 3d).
DEFAULT_BETA = 0.1
#: The DPO phase's steps, batch of pairs and AdamW lr, and the new tokens a stage output
#: may have: the workflow experiment's defaults (``SimulationConfig``), which the agent
#: daemon's assembly (``fedwave.assembly``) shares. 1e-4: an lr of 1e-3 (the earlier default)
#: raised the held-out NLL of the references at every stage (docs/fedwave.md,
#: section 6, "Measured after the router diagnosis").
DEFAULT_DPO_STEPS = 8
DEFAULT_DPO_BATCH = 4
DEFAULT_DPO_LR = 1e-4
DEFAULT_MAX_NEW_TOKENS = 64


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
    # The router's own AdamW learning rate, apart from the expert's (measured: at the
    # experts' rate the aggregated router stays near uniform; docs/fedwave.md section 6).
    # 1e-2 as the workflow experiment chose it on routing accuracy; None: the agent's
    # learning_rate. The part admission's max_router_update_rms lets such routers in.
    learning_rate: float | None = Field(default=1e-2, gt=0, le=10)


class DPOSettings(BaseModel):
    """DPO's preference strength β."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    beta: float = Field(default=DEFAULT_BETA, gt=0)


class AssemblySettings(BaseModel):
    """π_SFT's assembly and the DPO phase in the agent daemon, after the last round
    (docs/fedwave.md, section 5, "Assembly and DPO in the daemon").

    ``enabled``: the agent publishes its LoRA adapter with its last round's parts and, after
    its last round, pulls the other stages' experts (adapter and VCLayer), assembles π_SFT
    behind the aggregated router, runs the DPO phase on the public prompts and scores each
    model on its held-out examples. ``deadline_s``: how long the experts' pulls may take
    (unset: ``fedwave.round_deadline_s``); a stage whose expert is not there by then is
    assembled without. The DPO knobs are the workflow experiment's defaults; ``dpo_steps``
    0 assembles and scores π_SFT without DPO.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    deadline_s: float | None = Field(default=None, gt=0, le=3600)
    dpo_steps: int = Field(default=DEFAULT_DPO_STEPS, ge=0, le=100_000)
    dpo_batch: int = Field(default=DEFAULT_DPO_BATCH, ge=1, le=4096)
    dpo_lr: float = Field(default=DEFAULT_DPO_LR, gt=0, le=1)
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=4096)
    # A pulled adapter's L2 norm at most this x our own (null: no bound): the overlay
    # pull's rule and default (agent/merging/pull_aggregate.py); finite-but-huge is refused `norm`.
    max_adapter_norm_ratio: float | None = Field(default=10.0, gt=0, le=1e6)
