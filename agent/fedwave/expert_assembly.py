"""π_SFT in the agent daemon, without I/O: the stage experts that arrived, assembled behind
the aggregated router, aligned by the DPO phase and scored on the agent's held-out data.

After its last round an expert agent has pulled (:func:`~peerlm.agent.fedwave.exchange.
plan_expert_pulls`, the driver in :mod:`~peerlm.agent.fedwave.expert_loop`) the other
stages' experts: each agent's LoRA adapter and VCLayer, checked by the codecs and the part
admission on arrival. This module does the rest on the model thread (blocking torch):

1. :func:`choose_stage_experts`: one expert per stage, this agent's own for its stage, for
   another stage the first of its agents (by name) whose adapter *and* VCLayer arrived; a
   stage with none is *missing* and π_SFT is assembled without it
   (:class:`~peerlm.agent.fedwave.assembly.AssembledModel` routes over the experts present);
2. :func:`assemble_and_align`: copies of the experts (this agent's own adapter, VCLayer and
   model stay as the rounds left them: DPO trains the copies), :class:`AssembledModel` with
   a copy of the aggregated router, π_SFT scored, the DPO phase
   (:func:`~peerlm.agent.fedwave.dpo_phase.dpo_on_public_prompts`, the workflow
   experiment's own), π_SFT after DPO scored.

The scores are the workflow experiment's: the mean sentence ROUGE-1/2/L, BLEU-4, GLEU and
METEOR of the greedy outputs against the references (:func:`~peerlm.agent.fedwave.
text_metrics.mean_sentence_scores`), with the share of the held-out prompts the router
sends first to this agent's own stage (the experiment's ``routing_accuracy``).

Choice: a stage with several agents is represented by one of them (the first by name whose
expert arrived), not by a mean of their adapters: averaging LoRA factors A and B apart is
not averaging their product, and FedWave's experts are per stage, not per agent.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from peerlm.agent.fedwave.assembly import AssembledModel, assembled_generate
from peerlm.agent.fedwave.code_chain import StageExample
from peerlm.agent.fedwave.dpo_phase import dpo_on_public_prompts
from peerlm.agent.fedwave.exchange import RoundParts
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.params import AssemblySettings, DPOSettings
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.text_metrics import mean_sentence_scores
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.fedwave.workflow import Workflow
from peft import set_peft_model_state_dict

__all__ = [
    "AssemblyOutcome",
    "StageChoice",
    "assemble_and_align",
    "choose_stage_experts",
    "expert_copy",
    "score_expert",
]


@dataclass(frozen=True)
class StageChoice:
    """Which agent's expert stands for each stage (by stage index), and the stages with
    none (by name, in workflow order)."""

    experts: dict[int, str]
    missing: tuple[str, ...]


def choose_stage_experts(workflow: Workflow, me: str, parts: RoundParts) -> StageChoice:
    """One expert per stage (module docstring): ``me`` for its own stage, else the first
    agent of the stage (sorted by name) whose adapter and VCLayer are both in ``parts``."""
    own = workflow.stage_index(me)
    chosen: dict[int, str] = {}
    missing: list[str] = []
    for index, stage in enumerate(workflow.stages):
        if index == own:
            chosen[index] = me
            continue
        ready = [a for a in sorted(stage.agents) if a in parts.adapters and a in parts.vclayers]
        if ready:
            chosen[index] = ready[0]
        else:
            missing.append(stage.name)
    return StageChoice(chosen, tuple(missing))


def expert_copy(
    template: VCCausalLM,
    adapter: Mapping[str, torch.Tensor] | None = None,
    vclayer: VCLayer | None = None,
) -> VCCausalLM:
    """A trainable copy of ``template`` (its base model and LoRA configuration) holding
    ``adapter`` (a checked LoRA state: the codec's :func:`decode_adapter` output) and
    ``vclayer`` (default: the template's own)."""
    lm = copy.deepcopy(template.lm)
    if adapter is not None:
        set_peft_model_state_dict(lm, dict(adapter))
    layer = copy.deepcopy(vclayer if vclayer is not None else template.vclayer)
    layer.requires_grad_(True)
    return VCCausalLM(lm, layer)


def score_expert(
    model: VCCausalLM, tokenizer: Any, examples: Sequence[StageExample], max_new_tokens: int
) -> dict[str, float]:
    """One expert alone on ``examples``: its greedy outputs' mean sentence scores."""
    texts = greedy_generate(
        model, tokenizer, [e.source for e in examples], max_new_tokens=max_new_tokens
    )
    return mean_sentence_scores(texts, [e.target for e in examples])


def _score_assembled(
    model: AssembledModel,
    tokenizer: Any,
    examples: Sequence[StageExample],
    own: int,
    max_new_tokens: int,
) -> tuple[dict[str, float], float]:
    texts, routings = assembled_generate(
        model, tokenizer, [e.source for e in examples], max_new_tokens=max_new_tokens
    )
    routed_own = sum(1 for r in routings if int(r.experts[0, 0]) == own) / len(routings)
    return mean_sentence_scores(texts, [e.target for e in examples]), routed_own


@dataclass
class AssemblyOutcome:
    """What the assembly and DPO phase gave at one agent (its report's ``assembly``)."""

    experts: dict[str, str]  # stage name -> the agent whose expert stands for it
    missing_stages: list[str]
    pi_sft: dict[str, float]  # metric -> mean over the held-out examples
    pi_sft_dpo: dict[str, float] | None  # None: no DPO step (no informative pair, or 0 steps)
    routed_own: float  # share of held-out prompts routed first to this agent's stage
    dpo_pairs: int = 0
    dpo_informative: int = 0
    dpo_losses: list[float] = field(default_factory=list)
    assemble_s: float = 0.0
    dpo_s: float = 0.0


def assemble_and_align(
    workflow: Workflow,
    me: str,
    own: VCCausalLM,
    router: MoERouter,
    parts: RoundParts,
    tokenizer: Any,
    held_out: Sequence[StageExample],
    public: Sequence[str],
    *,
    settings: AssemblySettings,
    dpo: DPOSettings,
    top_k: int,
    seed: int = 0,
) -> AssemblyOutcome:
    """Assemble π_SFT from this agent's expert ``own``, the experts in ``parts`` and the
    aggregated ``router``; score it on ``held_out``, run the DPO phase on ``public`` and
    score again (module docstring). Nothing given is changed: DPO trains copies.

    ``FedWaveError`` from :class:`AssembledModel` if an expert does not fit (the transport's
    checks refuse those first)."""
    started = time.perf_counter()
    choice = choose_stage_experts(workflow, me, parts)
    experts: list[VCCausalLM | None] = []
    for index in range(len(workflow.stages)):
        agent = choice.experts.get(index)
        if agent is None:
            experts.append(None)
        elif agent == me:
            experts.append(expert_copy(own))
        else:
            experts.append(expert_copy(own, parts.adapters[agent], parts.vclayers[agent]))
    aggregated = copy.deepcopy(router)
    model = AssembledModel(experts, aggregated, top_k=min(top_k, len(experts)))
    assemble_s = time.perf_counter() - started
    own_index = workflow.stage_index(me)
    pi_sft, routed_own = _score_assembled(
        model, tokenizer, held_out, own_index, settings.max_new_tokens
    )
    started = time.perf_counter()
    outcome = dpo_on_public_prompts(
        model,
        tokenizer,
        public,
        steps=settings.dpo_steps,
        batch_size=settings.dpo_batch,
        lr=settings.dpo_lr,
        beta=dpo.beta,
        seed=seed,
        max_new_tokens=settings.max_new_tokens,
    )
    dpo_s = time.perf_counter() - started
    after = None
    if outcome.report is not None:
        after, _ = _score_assembled(model, tokenizer, held_out, own_index, settings.max_new_tokens)
    return AssemblyOutcome(
        experts={workflow.stages[i].name: a for i, a in sorted(choice.experts.items())},
        missing_stages=list(choice.missing),
        pi_sft=pi_sft,
        pi_sft_dpo=after,
        routed_own=routed_own,
        dpo_pairs=len(outcome.pairs),
        dpo_informative=outcome.informative,
        dpo_losses=[round(x, 5) for x in outcome.report.losses] if outcome.report else [],
        assemble_s=round(assemble_s, 3),
        dpo_s=round(dpo_s, 3),
    )
