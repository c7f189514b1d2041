"""FedWave's knobs in one section: the workflow, this agent's place in it, the exchange's
bounds and each component's settings.

``AgentSettings.fedwave`` holds :class:`FedWaveSettings` (``fedwave:`` in an agent's
configuration, docs/configuration.md). Each component keeps its own model
(:mod:`~peerlm.agent.fedwave.params`: one definition of every knob, its default and its
bounds); this section puts them together and checks what spans two of them. Loading it
loads no torch (``peerlm health`` reads the agent's configuration); the two methods that
build modules import torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from peerlm.agent.fedwave.params import (
    AssemblySettings,
    CollabLossSettings,
    DPOSettings,
    RouterSettings,
    VCLayerSettings,
)
from peerlm.agent.fedwave.workflow import Workflow
from pydantic import Field, model_validator

from peerlm.config import MiB, Section, parse_host_port

#: Default of ``FedWaveSettings.max_router_update_abs``: the largest per-entry change of an
#: honest round measured 0.152 (tiny gpt2 chain, router lr 1e-2, 24 or 48 steps; AdamW moves
#: an entry by at most about lr x steps), so 1 is 6.5 times that (docs/fedwave.md, section 5).
DEFAULT_MAX_ROUTER_UPDATE_ABS = 1.0
#: Default of ``FedWaveSettings.max_router_weight_ratio`` (the ``fedavg`` rule only): each
#: claimed n_i clipped to the members' lower median claim, so nobody buys more than the
#: median member's weight with a claim nobody can check (a ratio of 4, before the
#: hostile-member audit, gave a claim of 1e9 4/7 of the mean beside three honest members).
DEFAULT_MAX_ROUTER_WEIGHT_RATIO = 1.0
#: How an expert aggregates the workflow's routers: ``median`` (coordinate-wise, robust to a
#: hostile minority; the default) or ``fedavg`` (the paper's Eq. 9, n_i-weighted).
RouterRule = Literal["median", "fedavg"]

if TYPE_CHECKING:
    from peerlm.agent.fedwave.router import MoERouter
    from peerlm.agent.fedwave.vclayer import VCLayer

__all__ = ["FedWaveSettings", "RouterRule"]


class FedWaveSettings(Section):
    """The workflow, this agent's stage, the exchange's deadline and size bounds, and the
    VCLayer, collaborative loss, router and DPO settings.

    ``workflow`` unset: FedWave is off for this agent (nothing else here is read).
    """

    workflow: Workflow | None = None
    # This agent's stage. Its certificate name must be listed there (checked where the
    # identity is known, at start: the settings do not know the name). Unset: the stage
    # whose agents list the certificate name.
    stage: str | None = None
    # How long one round's pulls (adjacent VCLayers, every other agent's router) may take
    # together; what has not arrived by then is counted missing and the round goes on.
    round_deadline_s: float = Field(default=30.0, gt=0, le=3600)
    # Largest router / VCLayer blob accepted from a workflow agent (and served). Unset: the
    # largest blob of this agent's shapes (float32 tensors plus the format's header bound),
    # which no honest peer of the same workflow exceeds.
    max_router_bytes: int | None = Field(default=None, ge=1024, le=1024 * MiB)
    max_vclayer_bytes: int | None = Field(default=None, ge=1024, le=1024 * MiB)
    # Where the workflow's other agents serve FedWaveExchange: agent name -> HOST:PORT (their
    # peer port). Written by whoever deploys the workflow (``peerlm up --workflow`` writes
    # it); an agent without an entry is never dialled and its parts count missing
    # (``no_endpoint``). This agent's own entry, if listed, is ignored.
    peers: dict[str, str] = Field(default_factory=dict, max_length=4096)
    # Norm bounds on the parts that arrived (agent/fedwave/part_admission.py; null: none): a
    # router's change against this agent's own router of the round's start at most this
    # times the norm of the workflow's common initial router (from ``seed``: no member can
    # inflate it, as it could the aggregate's); a neighbour's VCLayer's norm at most this
    # times this agent's own VCLayer's.
    max_router_update_ratio: float | None = Field(default=1.0, gt=0, le=1e6)
    # ...or, if larger, this root-mean-square change per router entry times the root of
    # the router's entry count: AdamW moves an entry by about its lr a step whatever the
    # entry's size, so a small-initialised router outgrows any ratio of its own norm.
    max_router_update_rms: float = Field(default=0.25, ge=0, le=1e6)
    # ...and, with the ratio set, no router entry moved by more than this: the same AdamW
    # bound per entry (at most about lr x steps), so a hostile member cannot spend the
    # whole L2 budget on one output bias and turn every agent's routing to its expert.
    max_router_update_abs: float | None = Field(default=DEFAULT_MAX_ROUTER_UPDATE_ABS, gt=0, le=1e6)
    # How the workflow's routers are aggregated each round: ``median``, the coordinate-wise
    # median (every member an equal share; while fewer than half are hostile each entry
    # stays between two honest values), or ``fedavg``, the paper's n_i-weighted Eq. 9, for
    # a workflow whose members trust each other (docs/fedwave.md, section 5).
    router_aggregation: RouterRule = "median"
    # With ``fedavg``: Eq. 9's n_i is the sender's own claim; each is capped at this times
    # the members' lower median claim (1: clipped to the median), so one member claiming
    # 1e9 samples cannot buy more than a median member's weight (agent/fedwave/exchange.py
    # router_weights); null: the claims as they are.
    max_router_weight_ratio: float | None = Field(
        default=DEFAULT_MAX_ROUTER_WEIGHT_RATIO, ge=1, le=1e6
    )
    # Before adopting a round's aggregate, an expert routes a sample of its own stage's
    # private examples (``routing_check_examples``) with it and with the router it held
    # before the round: if the aggregate's mean weight on the agent's own expert falls by
    # more than this (absolute), or below 1/N less this, the round's aggregate is refused
    # and the previous router kept (agent/fedwave/routing_check.py); null: no check.
    routing_check_margin: float | None = Field(default=0.1, gt=0, le=1)
    routing_check_examples: int = Field(default=32, ge=1, le=4096)
    max_vclayer_norm_ratio: float | None = Field(default=10.0, gt=0, le=1e6)
    vclayer: VCLayerSettings = VCLayerSettings()
    collab: CollabLossSettings = CollabLossSettings()
    router: RouterSettings = RouterSettings()
    dpo: DPOSettings = DPOSettings()
    # π_SFT's assembly and DPO after the last round (off by default; on in
    # `peerlm up --workflow`).
    assembly: AssemblySettings = AssemblySettings()
    # Seeds every agent's initial router (all start equal) and each stage's VCLayer
    # (stage i from seed + 1 + i, so adjacent stages do not start identical).
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _fits_workflow(self) -> FedWaveSettings:
        if self.workflow is None:
            if self.peers:
                raise ValueError("fedwave.peers is set but no fedwave.workflow")
            if self.stage is not None:
                raise ValueError(f"fedwave.stage {self.stage!r} is set but no fedwave.workflow")
            return self
        if self.stage is not None and self.stage not in self.workflow.stage_names:
            raise ValueError(
                f"fedwave.stage {self.stage!r} is not a stage of the workflow "
                f"(stages: {', '.join(self.workflow.stage_names)})"
            )
        unknown = sorted(set(self.peers) - set(self.workflow.agents))
        if unknown:
            raise ValueError(
                f"fedwave.peers names {', '.join(map(repr, unknown))}, not agents of the "
                f"workflow (agents: {', '.join(self.workflow.agents)})"
            )
        for agent, endpoint in sorted(self.peers.items()):
            try:
                _, port = parse_host_port(endpoint)
            except ValueError as err:
                raise ValueError(f"fedwave.peers[{agent!r}]: {err}") from None
            if port == 0:
                raise ValueError(
                    f"fedwave.peers[{agent!r}]: port 0 in {endpoint!r} is not an endpoint "
                    "(1..65535: the agent's peer port)"
                )
        if self.router.top_k > len(self.workflow.stages):
            raise ValueError(
                f"router.top_k ({self.router.top_k}) exceeds the workflow's "
                f"{len(self.workflow.stages)} stages (experts)"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether a workflow is configured (FedWave is on for this agent)."""
        return self.workflow is not None

    def member_stage(self, agent: str) -> int:
        """The index of the stage ``agent`` (this process's certificate name) serves.

        ``ValueError`` with the fix when FedWave is off, when ``agent`` is not in the
        workflow, or when it is listed in another stage than ``stage`` says.
        """
        if self.workflow is None:
            raise ValueError("fedwave.workflow is not configured")
        try:
            index = self.workflow.stage_index(agent)
        except KeyError:
            raise ValueError(
                f"this agent ({agent!r}) is not listed in any stage of fedwave.workflow "
                f"(agents: {', '.join(self.workflow.agents)})"
            ) from None
        listed = self.workflow.stages[index].name
        if self.stage is not None and self.stage != listed:
            raise ValueError(
                f"fedwave.stage is {self.stage!r} but the workflow lists this agent "
                f"({agent!r}) in stage {listed!r}"
            )
        return index

    def initial_vclayer(self, hidden_size: int, stage_index: int) -> VCLayer:
        """Stage ``stage_index``'s initial VCLayer (generator seeded ``seed + 1 + i``)."""
        import torch
        from peerlm.agent.fedwave.vclayer import VCLayer

        if stage_index < 0:
            raise ValueError(f"stage index must not be negative, got {stage_index}")
        generator = torch.Generator().manual_seed(self.seed + 1 + stage_index)
        return VCLayer(hidden_size, self.vclayer, generator=generator)

    def initial_router(self, hidden_size: int) -> MoERouter:
        """The router every agent of the workflow starts from (generator seeded ``seed``)."""
        import torch
        from peerlm.agent.fedwave.router import MoERouter

        if self.workflow is None:
            raise ValueError("the initial router needs a workflow (one expert per stage)")
        generator = torch.Generator().manual_seed(self.seed)
        return MoERouter(hidden_size, len(self.workflow.stages), self.router, generator=generator)
