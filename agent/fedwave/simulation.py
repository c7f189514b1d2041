"""One value-chain workflow simulated in process: FedWave, FedAvg and the ablations.

The agents of a three-stage code chain (docs/fedwave.md, section 1; one agent per stage,
each holding only its stage's private examples) are simulated in one process, each with its
own copy of the shipped tiny model, and trained by one *strategy*:

| strategy | per-stage expert | VCLayer + L_VC | router (Eq. 7-9) | DPO | evaluated with |
|---|---|---|---|---|---|
| ``fedwave`` | yes | yes | FedAvg'ed each round | yes | π (assembly, top-2) |
| ``fedavg`` | no: one LoRA FedAvg'ed each round | no | no | no | the global model |
| ``wo_dpo`` | yes | yes | yes | no | π_SFT |
| ``wo_router`` | yes | yes | no (Eq. 2) | no | each stage's own expert |
| ``wo_vclayer`` | yes | no | yes | yes | π (assembly) |
| ``sft_only`` | yes, trained alone | no | no | no | each stage's own expert |

**Compute matching.** Every agent makes ``rounds × local_steps`` SFT optimiser steps of
``batch`` examples. The strategies with DPO then make ``dpo_steps`` DPO steps on the
assembled model; the others make ``dpo_steps`` more SFT steps per agent in their last round
instead, so every strategy takes the same number of optimiser steps after the last
aggregation. ``wo_router`` has no router to rank the experts, hence no preference pairs and
no DPO: it is compared with ``wo_dpo`` too, which isolates the router.

**What is held fixed across strategies** for one run seed: the data split (``world_seed``),
the initial LoRA factors of each agent (torch seeded per seed and stage), the initial
VCLayers and router (the workflow's seeds, as :class:`~peerlm.agent.fedwave.settings.
FedWaveSettings` derives them) and the order of the batches. A strategy without a VCLayer
keeps one with a zero output projection, frozen: its branch is zero, so the model is
exactly the LoRA-tuned LM.

**Evaluation** (per stage, on the held-out chains with *reference* inputs, as Table 1
scores each stage's output): the greedy output of the evaluated model per test problem,
scored by :func:`~peerlm.agent.fedwave.text_metrics.sentence_scores` and, for
``implement`` and ``test``, the sandbox checks of :mod:`~peerlm.agent.fedwave.chain_tasks`.
For the assembled model the router (not the stage) chooses the experts; the share of test
prompts whose top expert is the stage's own is reported as ``routing_accuracy``.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from peerlm.agent.fedwave.assembly import AssembledModel, assembled_generate
from peerlm.agent.fedwave.chain_tasks import score_chain_tasks
from peerlm.agent.fedwave.code_chain import CODE_CHAIN_STAGES, ChainItem, build_code_chain
from peerlm.agent.fedwave.dpo_phase import build_preference_pairs, run_dpo_phase
from peerlm.agent.fedwave.expert_step import encode_stage_examples, expert_loss
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.router import MoERouter, fedavg_routers
from peerlm.agent.fedwave.text_metrics import METRIC_NAMES, sentence_scores
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import SHIPPED_DIR
from peft import get_peft_model_state_dict, set_peft_model_state_dict

__all__ = [
    "STRATEGIES",
    "SimulationConfig",
    "StrategyResult",
    "chain_workflow",
    "score_strategy",
    "simulate_strategy",
    "test_chains",
]

STRATEGIES: tuple[str, ...] = ("fedwave", "fedavg", "wo_dpo", "wo_router", "wo_vclayer", "sft_only")

# Which FedWave components each strategy keeps (see the module docstring's table).
_VCLAYER = {"fedwave", "wo_dpo", "wo_router"}
_ROUTER = {"fedwave", "wo_dpo", "wo_vclayer"}
_DPO = {"fedwave", "wo_vclayer"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SimulationConfig:
    """The experiment's sizes; the defaults fit ~20-30 min for 6 strategies × 3 seeds on
    the 2-core machine (docs/fedwave.md, section 5)."""

    arch: str = "gpt2"
    rounds: int = 3
    local_steps: int = 8
    dpo_steps: int = 8
    batch: int = 8
    lr: float = 2e-3
    dpo_lr: float = 1e-3
    dpo_batch: int = 4
    per_stage: int = 64
    n_test: int = 8
    n_public: int = 6
    max_new_tokens: int = 64
    world_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rounds", "local_steps", "batch", "per_stage", "n_test", "n_public"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dpo_steps < 0 or self.max_new_tokens < 1:
            raise ValueError("dpo_steps must be >= 0 and max_new_tokens >= 1")
        if not (SHIPPED_DIR / "tiny" / self.arch).is_dir():
            raise ValueError(f"no shipped tiny model {self.arch!r}")


@dataclass(frozen=True)
class StrategyResult:
    """One strategy at one seed: the outputs per stage and test problem, and diagnostics."""

    strategy: str
    seed: int
    outputs: Mapping[str, tuple[str, ...]]  # stage -> output per test problem
    top_expert: Mapping[str, tuple[int, ...]]  # stage -> the router's top expert (or -1)
    sft_steps_per_agent: int
    dpo_steps: int
    dpo_pairs: int
    dpo_losses: tuple[float, ...]
    seconds: float
    extra: Mapping[str, float] = field(default_factory=dict)


def chain_workflow() -> Workflow:
    """The three-stage code chain with one agent per stage (named after its stage)."""
    return Workflow.model_validate(
        {"stages": [{"name": n, "agents": [n]} for n in CODE_CHAIN_STAGES]}
    )


def _zero_vclayer(model: VCCausalLM) -> None:
    with torch.no_grad():
        model.vclayer.w_o.zero_()
    for p in model.vclayer.parameters():
        p.requires_grad_(False)


def _expert(config: SimulationConfig, seed: int, index: int, use_vclayer: bool) -> VCCausalLM:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1000 * seed + index)
    base = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "tiny" / config.arch)
    lm = apply_lora(base, LoraSettings(dropout=0.0))
    layer = VCLayer(
        int(base.config.hidden_size), generator=torch.Generator().manual_seed(seed + 1 + index)
    )
    model = VCCausalLM(lm, layer)
    if not use_vclayer:
        _zero_vclayer(model)
    return model


def simulate_strategy(
    strategy: str,
    config: SimulationConfig,
    seed: int,
    *,
    progress: Progress | None = None,
) -> StrategyResult:
    """Train the workflow's agents by ``strategy`` and generate its test outputs."""
    from transformers import AutoTokenizer

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    workflow = chain_workflow()
    split = build_code_chain(
        workflow,
        per_stage=config.per_stage,
        n_test=config.n_test,
        n_public=config.n_public,
        seed=config.world_seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_DIR / "tiny" / config.arch)
    n = len(CODE_CHAIN_STAGES)
    use_vc, use_router, use_dpo = strategy in _VCLAYER, strategy in _ROUTER, strategy in _DPO
    experts = [_expert(config, seed, i, use_vc) for i in range(n)]
    width = experts[0].vclayer.hidden_size
    routers = [
        MoERouter(width, n, generator=torch.Generator().manual_seed(seed)) if use_router else None
        for _ in range(n)
    ]
    data = [list(split.private[stage][stage]) for stage in CODE_CHAIN_STAGES]
    rngs = [random.Random(f"fedwave-sim/{seed}/{i}") for i in range(n)]
    optimisers = []
    for i in range(n):
        params = [p for p in experts[i].parameters() if p.requires_grad]
        router = routers[i]
        if router is not None:
            params += list(router.parameters())
        optimisers.append(torch.optim.AdamW(params, lr=config.lr))
    if strategy == "fedavg":  # one global LoRA: every agent starts each round from it
        global_lora = get_peft_model_state_dict(experts[0].lm)
    sft_steps = config.rounds * config.local_steps + (0 if use_dpo else config.dpo_steps)
    for r in range(config.rounds):
        steps = config.local_steps + (
            config.dpo_steps if not use_dpo and r == config.rounds - 1 else 0
        )
        # Neighbours' VCLayers as pulled at the round's start (fixed during the round).
        snapshot = [copy.deepcopy(e.vclayer) for e in experts] if use_vc else None
        for i in range(n):
            if strategy == "fedavg":
                set_peft_model_state_dict(experts[i].lm, global_lora)
            experts[i].train()
            for _ in range(steps):
                batch = encode_stage_examples(tokenizer, rngs[i].sample(data[i], config.batch), 256)
                loss = expert_loss(
                    experts[i],
                    batch,
                    stage_index=i,
                    predecessor=snapshot[i - 1] if snapshot is not None and i > 0 else None,
                    successor=snapshot[i + 1] if snapshot is not None and i < n - 1 else None,
                    router=routers[i],
                )
                optimisers[i].zero_grad()
                loss.total.backward()  # type: ignore[no-untyped-call]
                optimisers[i].step()
            say(
                f"{strategy} seed {seed}: round {r + 1}, {CODE_CHAIN_STAGES[i]}: "
                f"SFT loss {float(loss.sft):.3f}"
            )
        if strategy == "fedavg":
            global_lora = fedavg_routers(
                {
                    CODE_CHAIN_STAGES[i]: (get_peft_model_state_dict(experts[i].lm), len(data[i]))
                    for i in range(n)
                }
            )
        if use_router:
            merged = fedavg_routers(
                {CODE_CHAIN_STAGES[i]: (routers[i].state_dict(), len(data[i])) for i in range(n)}  # type: ignore[union-attr]
            )
            for router in routers:
                router.load_state_dict(merged)  # type: ignore[union-attr]
    if strategy == "fedavg":
        set_peft_model_state_dict(experts[0].lm, global_lora)
    assembled = AssembledModel(experts, routers[0]) if routers[0] is not None else None
    pairs_used = 0
    dpo_losses: tuple[float, ...] = ()
    if use_dpo and assembled is not None and config.dpo_steps > 0:
        pairs = _chained_pairs(assembled, tokenizer, split.public, config.max_new_tokens)
        informative = [p for p in pairs if p.informative]
        say(
            f"{strategy} seed {seed}: {len(informative)} of {len(pairs)} preference pairs "
            "informative"
        )
        if informative:
            report = run_dpo_phase(
                assembled,
                tokenizer,
                informative,
                steps=config.dpo_steps,
                batch_size=config.dpo_batch,
                lr=config.dpo_lr,
                seed=seed,
            )
            pairs_used, dpo_losses = report.pairs, report.losses
    outputs: dict[str, tuple[str, ...]] = {}
    top: dict[str, tuple[int, ...]] = {}
    for i, stage in enumerate(CODE_CHAIN_STAGES):
        sources = [item.example(i).source for item in split.test]
        if assembled is not None:
            texts, routings = assembled_generate(
                assembled, tokenizer, sources, max_new_tokens=config.max_new_tokens
            )
            top[stage] = tuple(int(rt.experts[0, 0]) for rt in routings)
        else:
            model = experts[0] if strategy == "fedavg" else experts[i]
            texts = greedy_generate(model, tokenizer, sources, max_new_tokens=config.max_new_tokens)
            top[stage] = tuple(-1 for _ in sources)
        outputs[stage] = tuple(texts)
        say(f"{strategy} seed {seed}: evaluated {stage}")
    return StrategyResult(
        strategy=strategy,
        seed=seed,
        outputs=outputs,
        top_expert=top,
        sft_steps_per_agent=sft_steps,
        dpo_steps=config.dpo_steps if pairs_used else 0,
        dpo_pairs=pairs_used,
        dpo_losses=tuple(dpo_losses),
        seconds=time.perf_counter() - started,
    )


def _chained_pairs(
    model: AssembledModel, tokenizer: Any, requirements: Sequence[str], max_new_tokens: int
) -> list[Any]:
    """Preference pairs on the public requirements and on the chain they start: stage 1's
    prompt is the chosen answer to the requirement, stage 2's that signature followed by
    the chosen body (no reference answer is used anywhere)."""
    stage0 = build_preference_pairs(model, tokenizer, requirements, max_new_tokens=max_new_tokens)
    signatures = [p.chosen + "\n" for p in stage0]
    stage1 = build_preference_pairs(model, tokenizer, signatures, max_new_tokens=max_new_tokens)
    functions = [s + p.chosen + "\n" for s, p in zip(signatures, stage1, strict=True)]
    stage2 = build_preference_pairs(model, tokenizer, functions, max_new_tokens=max_new_tokens)
    return [*stage0, *stage1, *stage2]


def test_chains(config: SimulationConfig) -> tuple[ChainItem, ...]:
    """The held-out test chains of ``config``'s data split (the same for every run seed)."""
    split = build_code_chain(
        chain_workflow(),
        per_stage=config.per_stage,
        n_test=config.n_test,
        n_public=config.n_public,
        seed=config.world_seed,
    )
    return split.test


def score_strategy(
    result: StrategyResult, config: SimulationConfig
) -> dict[str, dict[str, list[float]]]:
    """Per stage, per metric, one score per test problem (0-100) of ``config``'s test chains.

    Lexical metrics for every stage; ``pass@1`` (0 or 100) for ``implement`` under the
    reference signature; ``test_share`` (share of generated asserts passing on the
    reference, 0 when none) for ``test``.
    """
    test = test_chains(config)
    scores: dict[str, dict[str, list[float]]] = {}
    for i, stage in enumerate(CODE_CHAIN_STAGES):
        outputs = result.outputs[stage]
        refs = [item.example(i).target for item in test]
        rows = [sentence_scores(h, r).as_dict() for h, r in zip(outputs, refs, strict=True)]
        scores[stage] = {m: [row[m] for row in rows] for m in METRIC_NAMES}
    bodies = result.outputs[CODE_CHAIN_STAGES[1]]
    generated = result.outputs[CODE_CHAIN_STAGES[2]]
    tasks = score_chain_tasks(test, bodies, [""] * len(test))
    scores[CODE_CHAIN_STAGES[1]]["pass@1"] = [100.0 * p for p in tasks.implementation_passed]
    references = [item.artefacts[2] for item in test]
    checks = score_chain_tasks(test, references, generated)
    scores[CODE_CHAIN_STAGES[2]]["test_share"] = [
        100.0 * p / t if t else 0.0
        for p, t in zip(checks.tests_passed, checks.tests_total, strict=True)
    ]
    return scores
