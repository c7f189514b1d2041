"""One FedWave expert round, without I/O: the local training and the round's conclusion.

A round ``t`` of expert agent i (docs/fedwave.md, "The expert round loop"):

1. **train** (:class:`ExpertTrainer`): ``local_steps`` AdamW steps of :func:`expert_loss`
   (Eq. 8, or Eq. 2 with the router ablated) on batches of the stage's private examples,
   over the LoRA factors, the VCLayer and this agent's copy of the router, against the
   adjacent stages' VCLayers of the previous round;
2. **publish** the trained router (with ``n_i``) and VCLayer as round ``t`` (the driver);
3. **pull** every other agent's round-``t`` router and the adjacent stages' round-``t``
   VCLayers under the round's deadline (the driver, :func:`pull_round`);
4. **conclude** (:func:`conclude_round`, pure): Eq. 9 over this agent's trained router and
   those that arrived (weighted by ``n_i``, summed in float64 over the agents sorted by
   name), the neighbours' VCLayers for the next round, and what is missing or rejected.

Every agent that concludes a round over the same set of routers ends with the same bits
(:func:`router_digest` says which); an agent missing from the set is left out and counted.

Choices: a fresh AdamW each round (the router is replaced by the aggregate between rounds,
so moments carried over would belong to parameters no longer there); a stage with several
agents is seen by its neighbours as the element-wise mean of its agents' VCLayers that
arrived (the same role; sorted by name, so every neighbour gets the same bits); when none
arrived the previous round's is kept.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from peerlm.agent.adapter_codec import state_digest
from peerlm.agent.fedwave.code_chain import StageExample
from peerlm.agent.fedwave.collab_loss import CollabLossSettings
from peerlm.agent.fedwave.exchange import RoundParts, aggregate_routers, router_weights
from peerlm.agent.fedwave.expert_step import encode_stage_examples, expert_loss, router_features
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.sequence_losses import per_sample_sft_loss
from peerlm.agent.fedwave.settings import DEFAULT_MAX_ROUTER_WEIGHT_RATIO, RouterRule
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.fedwave.workflow import Workflow

__all__ = [
    "ExpertTrainer",
    "RoundConclusion",
    "adjacent_vclayers",
    "conclude_round",
    "expert_optimiser",
    "mean_vclayer",
    "router_digest",
]


def router_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over a router's float32 tensors (names sorted, name and shape included):
    equal for two agents exactly when their routers hold the same bits."""
    return state_digest(state)


def mean_vclayer(layers: Sequence[VCLayer]) -> VCLayer:
    """The element-wise mean of same-shaped VCLayers (a copy; ``ValueError`` if none)."""
    if not layers:
        raise ValueError("no VCLayer to average")
    first = layers[0]
    out = VCLayer(first.hidden_size, first.settings)
    states = [layer.state_dict() for layer in layers]
    with torch.no_grad():
        merged = {
            name: torch.stack([s[name].to(torch.float64) for s in states]).mean(0).float()
            for name in states[0]
        }
    out.load_state_dict(merged)
    out.requires_grad_(False)
    return out


@dataclass(frozen=True)
class RoundConclusion:
    """What round ``round`` ends with at one agent."""

    round: int
    router: dict[str, torch.Tensor]  # the aggregate (Eq. 9): the next round's router
    members: tuple[str, ...]  # agents averaged, sorted (this one included)
    complete: bool  # every agent of the workflow is in ``members``
    digest: str  # router_digest(router)
    predecessor: VCLayer | None  # the previous stage's VCLayer for the next round
    successor: VCLayer | None
    missing: dict[str, str] = field(default_factory=dict)  # "agent/kind" -> reason
    rejected: dict[str, str] = field(default_factory=dict)
    #: agents whose claimed n_i was over the cap (fedwave.max_router_weight_ratio)
    capped: tuple[str, ...] = ()


def conclude_round(
    workflow: Workflow,
    me: str,
    own_router: Mapping[str, torch.Tensor],
    own_samples: int,
    parts: RoundParts,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    predecessor: VCLayer | None = None,
    successor: VCLayer | None = None,
    max_weight_ratio: float | None = DEFAULT_MAX_ROUTER_WEIGHT_RATIO,
    rule: RouterRule = "median",
) -> RoundConclusion:
    """The round's end at agent ``me``: the router aggregate over its router and
    ``parts.routers`` (``rule``: the coordinate-wise median, or Eq. 9), and the
    adjacent stages' VCLayers from ``parts.vclayers`` (``predecessor``/``successor``: the
    previous round's, kept where none of the stage's agents' arrived). Pure: the same
    arguments give the same bits. ``FedWaveError`` from the aggregate (a router that does
    not fit: the transport has already refused those)."""
    merged, members = aggregate_routers(
        me,
        own_router,
        own_samples,
        parts.routers,
        shapes,
        max_weight_ratio=max_weight_ratio,
        rule=rule,
        stages={a: workflow.stage_of(a).name for a in [me, *parts.routers]},
    )
    claims = {name: router.n_samples for name, router in parts.routers.items()}
    # The median weighs every member alike: no claim is capped because none buys weight.
    weights = (
        router_weights({**claims, me: own_samples}, max_weight_ratio)
        if rule == "fedavg"
        else claims
    )
    before, after = adjacent_vclayers(workflow, me, parts.vclayers, predecessor, successor)
    return RoundConclusion(
        round=parts.round,
        router=merged,
        members=members,
        complete=set(members) == set(workflow.agents),
        digest=router_digest(merged),
        predecessor=before,
        successor=after,
        missing={f"{t.agent}/{t.kind}": r for t, r in sorted(parts.missing.items())},
        rejected={f"{t.agent}/{t.kind}": r for t, r in sorted(parts.rejected.items())},
        capped=tuple(sorted(a for a, n in claims.items() if weights[a] < n)),
    )


def adjacent_vclayers(
    workflow: Workflow,
    me: str,
    arrived: Mapping[str, VCLayer],
    predecessor: VCLayer | None = None,
    successor: VCLayer | None = None,
) -> tuple[VCLayer | None, VCLayer | None]:
    """The previous and next stages' VCLayers for agent ``me``'s collaborative loss: the
    mean of each stage's agents' layers in ``arrived``; where none arrived, the one kept
    from before (``predecessor`` / ``successor``); None for a stage that does not exist."""
    before, after = workflow.adjacent(me)

    def stage_layer(stage: Any, kept: VCLayer | None) -> VCLayer | None:
        if stage is None:
            return None
        layers = [arrived[a] for a in sorted(stage.agents) if a in arrived]
        return mean_vclayer(layers) if layers else kept

    return stage_layer(before, predecessor), stage_layer(after, successor)


def expert_optimiser(
    expert_params: Iterable[torch.nn.Parameter],
    router: MoERouter | None,
    *,
    lr: float,
    router_lr: float,
) -> torch.optim.AdamW:
    """One agent's AdamW: the expert's trainable parameters (LoRA, VCLayer) at ``lr``, the
    router's (when there is one) in a group of their own at ``router_lr``.

    Why a group of its own: the router reads frozen base features and, at agent
    i, learns only "stage i" (every private example is stage i); FedAvg over the agents
    (Eq. 9) is what teaches it the other stages. At the experts' lr of 2e-3 the aggregated
    router is still near uniform after 12-24 steps (mean α of the right expert 0.38-0.48
    on held-out prompts), so top-2 mixes two experts almost equally (docs/fedwave.md,
    section 6, "Measured after the router diagnosis").
    """
    groups: list[dict[str, Any]] = [{"params": list(expert_params), "lr": lr}]
    if router is not None:
        groups.append({"params": list(router.parameters()), "lr": router_lr})
    return torch.optim.AdamW(groups, lr=lr)


class ExpertTrainer:
    """Agent i's expert (its LM with LoRA, wrapped with its VCLayer) and its router copy,
    trained on its stage's private examples. Blocking: the daemon runs it on its model
    thread."""

    def __init__(
        self,
        lm: Any,
        tokenizer: Any,
        vclayer: VCLayer,
        router: MoERouter | None,
        *,
        stage_index: int,
        examples: Sequence[StageExample],
        collab: CollabLossSettings | None = None,
        learning_rate: float = 1e-3,
        router_lr: float = 1e-2,
        batch_size: int = 8,
        max_length: int = 256,
        seed: int = 0,
        interrupt: threading.Event | None = None,
    ) -> None:
        if not examples:
            raise ValueError("a FedWave expert needs private training examples")
        self.model = VCCausalLM(lm, vclayer)
        self.tokenizer = tokenizer
        self.router = router
        self.stage_index = stage_index
        self.examples = list(examples)
        self.collab = collab or CollabLossSettings()
        self.learning_rate = learning_rate
        self.router_lr = router_lr
        self.batch_size = batch_size
        self.max_length = max_length
        self._rng = random.Random(f"peerlm-fedwave-expert/{seed}")
        # Set when the agent must stop now: training ends after the step in progress.
        self._interrupt = interrupt

    @property
    def rng(self) -> random.Random:
        """The batch sampler's generator (its state is checkpointed between rounds)."""
        return self._rng

    @property
    def vclayer(self) -> VCLayer:
        """This stage's VCLayer (trained in place)."""
        return self.model.vclayer

    def _parameters(self) -> list[torch.nn.Parameter]:
        """The expert's trainable parameters (LoRA, VCLayer); the router's are apart."""
        params = [p for p in self.model.lm.parameters() if p.requires_grad]
        return params + list(self.vclayer.parameters())

    def train(
        self, steps: int, *, predecessor: VCLayer | None, successor: VCLayer | None
    ) -> list[float]:
        """``steps`` AdamW steps of Eq. 8 (Eq. 2 without a router); the step losses (fewer
        when the interrupt was set)."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        # The round's torch seed (LoRA dropout) comes from the checkpointed sampler RNG: an
        # expert killed after publishing round t but before saving it replays t from its
        # checkpoint of t−1 and must publish the same bits, which the others may already
        # have averaged (docs/fedwave.md, section 5).
        seed = self._rng.getrandbits(63)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return self._train(steps, predecessor=predecessor, successor=successor)

    def _train(
        self, steps: int, *, predecessor: VCLayer | None, successor: VCLayer | None
    ) -> list[float]:
        self.model.train()
        optimizer = expert_optimiser(
            self._parameters(), self.router, lr=self.learning_rate, router_lr=self.router_lr
        )
        losses: list[float] = []
        for _ in range(steps):
            if self._interrupt is not None and self._interrupt.is_set():
                break
            batch_examples = self._rng.sample(
                self.examples, min(self.batch_size, len(self.examples))
            )
            batch = encode_stage_examples(self.tokenizer, batch_examples, self.max_length)
            loss = expert_loss(
                self.model,
                batch,
                stage_index=self.stage_index,
                predecessor=predecessor,
                successor=successor,
                router=self.router,
                collab=self.collab,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.total.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(float(loss.total.detach()))
        self.model.eval()
        return losses

    def heldout_loss(self, examples: Sequence[StageExample]) -> float | None:
        """Mean per-sample SFT loss (nats per target token) of the expert on ``examples``
        (through its VCLayer; None when there is none)."""
        if not examples:
            return None
        self.model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(examples), self.batch_size):
                batch = encode_stage_examples(
                    self.tokenizer, examples[start : start + self.batch_size], self.max_length
                )
                out = self.model(batch.input_ids, batch.attention_mask)
                losses = per_sample_sft_loss(out.logits, batch.input_ids, batch.target_mask)
                total += float(losses.sum())
                count += int(losses.numel())
        return total / count

    def own_features(self, limit: int) -> torch.Tensor:
        """Eq. 7's pooled base features ``(B, d)`` of the first ``limit`` private examples:
        what the routing check (:mod:`~peerlm.agent.fedwave.routing_check`) routes. The
        base LM is frozen and runs with its adapter disabled, so they are computed once."""
        cached = getattr(self, "_own_features", None)
        if cached is not None and cached[0] == limit:
            return cached[1]  # type: ignore[no-any-return]
        chosen = self.examples[:limit]
        pooled = []
        for start in range(0, len(chosen), self.batch_size):
            batch = encode_stage_examples(
                self.tokenizer, chosen[start : start + self.batch_size], self.max_length
            )
            pooled.append(router_features(self.model, batch.input_ids, batch.prompt_mask))
        features = torch.cat(pooled)
        self._own_features = (limit, features)
        return features

    def load_router(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt the round's aggregate as this agent's router."""
        if self.router is not None:
            self.router.load_state_dict(dict(state))
