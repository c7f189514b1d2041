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
| ``fedprox`` | no: one LoRA, + (μ/2)‖w − w_global‖² locally | no | no | no | the global model |
| ``fedavgm``, ``fedadam``, ``fedyogi`` | no: one LoRA, server optimiser | no | no | no | x_T |
| ``scaffold`` | no: one LoRA, option II control variates | no | no | no | the global model |
| ``centralised`` | no: one LoRA on the pooled data of all stages | no | no | no | that model |

The federated baselines (``fedavg`` and the next four rows) start every agent's round from
the global LoRA ``x_t`` and end it with the ``n_i``-weighted average of the agents' LoRA
factors; ``fedprox`` adds its proximal term to the local loss, ``scaffold`` corrects each
gradient by ``c − c_i`` (:mod:`~peerlm.agent.fedwave.client_drift`), and the server
optimisers take the average as the pseudo-gradient of Reddi et al.'s Algorithm 2, each agent
applying it to its own replica (:mod:`~peerlm.agent.fedwave.server_optimiser`; the replicas
are checked bit-identical every round). ``centralised`` is Table 2's reference, not a
federated strategy: one model makes as many optimiser steps as all agents of a federated
strategy together.

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
from peerlm.agent.fedwave.client_drift import (
    DEFAULT_PROX_MU,
    GradientMean,
    corrected_gradients,
    proximal_term,
    scaffold_server_controls,
    state_bytes,
)
from peerlm.agent.fedwave.code_chain import CODE_CHAIN_STAGES, ChainItem, build_code_chain
from peerlm.agent.fedwave.dpo_phase import dpo_on_public_prompts
from peerlm.agent.fedwave.expert_round import expert_optimiser
from peerlm.agent.fedwave.expert_step import encode_stage_examples, expert_loss
from peerlm.agent.fedwave.generation import greedy_generate
from peerlm.agent.fedwave.params import (
    DEFAULT_DPO_BATCH,
    DEFAULT_DPO_LR,
    DEFAULT_DPO_STEPS,
    DEFAULT_MAX_NEW_TOKENS,
)
from peerlm.agent.fedwave.router import MoERouter, fedavg_routers
from peerlm.agent.fedwave.server_optimiser import (
    SERVER_OPTIMISERS,
    ServerOptimiser,
    ServerOptSettings,
)
from peerlm.agent.fedwave.text_metrics import sentence_score_columns
from peerlm.agent.fedwave.vclayer import VCCausalLM, VCLayer
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.lora import LoraSettings, apply_lora
from peerlm.agent.models.tiny import SHIPPED_DIR
from peft import get_peft_model_state_dict, set_peft_model_state_dict

__all__ = [
    "BASELINES",
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "SimulationConfig",
    "StrategyResult",
    "chain_workflow",
    "score_strategy",
    "simulate_strategy",
    "test_chains",
]

#: FedWave, FedAvg and Table 3's ablations: the experiment's default list.
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "fedwave",
    "fedavg",
    "wo_dpo",
    "wo_router",
    "wo_vclayer",
    "sft_only",
)
#: The federated baselines beyond FedAvg, and Table 2's centralised reference.
BASELINES: tuple[str, ...] = ("fedprox", "fedavgm", "fedadam", "fedyogi", "scaffold", "centralised")
STRATEGIES: tuple[str, ...] = DEFAULT_STRATEGIES + BASELINES

# Which FedWave components each strategy keeps (see the module docstring's table).
_VCLAYER = {"fedwave", "wo_dpo", "wo_router"}
_ROUTER = {"fedwave", "wo_dpo", "wo_vclayer"}
_DPO = {"fedwave", "wo_vclayer"}
# The strategies that federate one global LoRA (evaluated as that one model).
_GLOBAL_LORA = {"fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "scaffold"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SimulationConfig:
    """The experiment's sizes; the defaults fit ~20-30 min for 6 strategies × 3 seeds on
    the 2-core machine (docs/fedwave.md, section 5)."""

    arch: str = "gpt2"
    rounds: int = 3
    local_steps: int = 8
    dpo_steps: int = DEFAULT_DPO_STEPS
    batch: int = 8
    lr: float = 2e-3
    # The router's own AdamW learning rate (its parameter group): chosen on the
    # routing accuracy of held-out *training* prompts, never on the test chains
    # (docs/fedwave.md, section 6, "Measured after the router diagnosis").
    router_lr: float = 1e-2
    # 1e-3 was the earlier default: it raised the held-out NLL of the references at every stage
    # (docs/fedwave.md, section 6, "Measured after the router diagnosis", point 6).
    dpo_lr: float = DEFAULT_DPO_LR
    dpo_batch: int = DEFAULT_DPO_BATCH
    per_stage: int = 64
    # 32 since 2026-12-02 (8 before): 8 test chains x 3 seeds could not resolve a
    # difference of 10 METEOR points; the evaluation is a few minutes of a run's ~28.
    n_test: int = 32
    n_public: int = 6
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    world_seed: int = 0
    prox_mu: float = DEFAULT_PROX_MU
    server_lr: float | None = None  # None: the kind's default (ServerOptSettings)

    def __post_init__(self) -> None:
        for name in ("rounds", "local_steps", "batch", "per_stage", "n_test", "n_public"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dpo_steps < 0 or self.max_new_tokens < 1:
            raise ValueError("dpo_steps must be >= 0 and max_new_tokens >= 1")
        if self.prox_mu < 0 or (self.server_lr is not None and not self.server_lr > 0):
            raise ValueError("prox_mu must be >= 0 and server_lr > 0")
        if not (self.router_lr > 0 and self.dpo_lr > 0):
            raise ValueError(
                f"router_lr and dpo_lr must be > 0, got {self.router_lr} and {self.dpo_lr}"
            )
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


def _train_centralised(
    model: VCCausalLM,
    optimiser: torch.optim.Optimizer,
    tokenizer: Any,
    data: Sequence[Sequence[Any]],
    config: SimulationConfig,
    seed: int,
    steps: int,
) -> None:
    """Table 2's reference: one model, ``steps`` SFT steps on batches drawn from the pooled
    examples of every stage (Eq. 2 without a VCLayer branch: the plain LM loss)."""
    pooled = [example for stage_data in data for example in stage_data]
    rng = random.Random(f"fedwave-sim/{seed}/centralised")
    model.train()
    for _ in range(steps):
        batch = encode_stage_examples(tokenizer, rng.sample(pooled, config.batch), 256)
        loss = expert_loss(
            model, batch, stage_index=0, predecessor=None, successor=None, router=None
        )
        optimiser.zero_grad()
        loss.total.backward()  # type: ignore[no-untyped-call]
        optimiser.step()


class _FederatedLora:
    """The federated baselines' shared state in the simulation: the global LoRA ``x_t``,
    FedProx's anchor, SCAFFOLD's control variates, and one server-optimiser replica per
    agent (they are compared bit for bit after every round)."""

    def __init__(self, strategy: str, experts: Sequence[VCCausalLM], config: SimulationConfig):
        self.strategy = strategy
        self.experts = experts
        self.config = config
        self.global_lora = get_peft_model_state_dict(experts[0].lm)
        self.trainable = [
            {k: p for k, p in e.named_parameters() if p.requires_grad} for e in experts
        ]
        self.replicas = (
            [
                ServerOptimiser(ServerOptSettings(strategy, lr=config.server_lr), self.global_lora)
                for _ in experts
            ]
            if strategy in SERVER_OPTIMISERS
            else []
        )
        zeros = {k: torch.zeros_like(p) for k, p in self.trainable[0].items()}
        self.c_server = dict(zeros) if strategy == "scaffold" else {}
        self.c_client = [dict(zeros) for _ in experts] if strategy == "scaffold" else []
        self.anchor: dict[str, torch.Tensor] = {}
        self.grads: list[GradientMean] = []

    def start_round(self, i: int) -> None:
        """Agent ``i`` starts its round from ``x_t``."""
        set_peft_model_state_dict(self.experts[i].lm, self.global_lora)
        if self.strategy == "fedprox":
            self.anchor = {k: p.detach().clone() for k, p in self.trainable[i].items()}
        if self.strategy == "scaffold":
            shapes = {k: tuple(p.shape) for k, p in self.trainable[i].items()}
            self.grads = [*self.grads[:i], GradientMean(shapes)]

    def local_penalty(self, i: int) -> torch.Tensor:
        """FedProx's proximal term (zero for the others)."""
        if self.strategy != "fedprox":
            return torch.zeros(())
        return proximal_term(self.trainable[i], self.anchor, self.config.prox_mu)

    def correct_gradients(self, i: int) -> None:
        """SCAFFOLD: record the raw gradients, then ``grad ← grad − c_i + c``."""
        if self.strategy == "scaffold":
            named = list(self.trainable[i].items())
            self.grads[i].add(named)
            corrected_gradients(named, self.c_client[i], self.c_server)

    def aggregate(self, sizes: Sequence[int]) -> None:
        """The round's end: average the agents' LoRA factors, then the strategy's update."""
        average = fedavg_routers(
            {
                CODE_CHAIN_STAGES[i]: (get_peft_model_state_dict(e.lm), sizes[i])
                for i, e in enumerate(self.experts)
            }
        )
        if self.replicas:
            models = [replica.step(average) for replica in self.replicas]
            for other in models[1:]:
                if any(not torch.equal(other[k], models[0][k]) for k in models[0]):
                    raise RuntimeError("server-optimiser replicas diverged")
            self.global_lora = models[0]
        else:
            self.global_lora = average
        if self.strategy == "scaffold":
            # Option II, in its optimiser-independent form (client_drift module docstring).
            fresh = [g.mean() for g in self.grads]
            deltas = {
                CODE_CHAIN_STAGES[i]: {k: fresh[i][k] - self.c_client[i][k] for k in fresh[i]}
                for i in range(len(self.experts))
            }
            self.c_server = scaffold_server_controls(
                self.c_server, deltas, total_clients=len(self.experts)
            )
            self.c_client = fresh

    def finish(self) -> None:
        """Load ``x_T`` into the evaluated model (agent 0's copy)."""
        set_peft_model_state_dict(self.experts[0].lm, self.global_lora)

    def bytes_per_round(self) -> dict[str, float]:
        """What one agent sends a round: its LoRA factors, and SCAFFOLD's control delta."""
        out = {"model_bytes_per_agent_round": float(state_bytes(self.global_lora))}
        if self.strategy == "scaffold":
            out["control_bytes_per_agent_round"] = float(state_bytes(self.c_server))
        return out


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
    optimisers = [
        expert_optimiser(
            (p for p in experts[i].parameters() if p.requires_grad),
            routers[i],
            lr=config.lr,
            router_lr=config.router_lr,
        )
        for i in range(n)
    ]
    sft_steps = config.rounds * config.local_steps + (0 if use_dpo else config.dpo_steps)
    # SFT steps of all agents together (the centralised model alone makes as many).
    extra: dict[str, float] = {"sft_steps_total": float(n * sft_steps)}
    if strategy == "centralised":
        _train_centralised(experts[0], optimisers[0], tokenizer, data, config, seed, n * sft_steps)
        say(f"centralised seed {seed}: {n * sft_steps} steps on the pooled data")
        sft_steps *= n
    fed = _FederatedLora(strategy, experts, config) if strategy in _GLOBAL_LORA else None
    for r in range(config.rounds if strategy != "centralised" else 0):
        steps = config.local_steps + (
            config.dpo_steps if not use_dpo and r == config.rounds - 1 else 0
        )
        # Neighbours' VCLayers as pulled at the round's start (fixed during the round).
        snapshot = [copy.deepcopy(e.vclayer) for e in experts] if use_vc else None
        for i in range(n):
            if fed is not None:
                fed.start_round(i)
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
                total = loss.total if fed is None else loss.total + fed.local_penalty(i)
                optimisers[i].zero_grad()
                total.backward()  # type: ignore[no-untyped-call]
                if fed is not None:
                    fed.correct_gradients(i)
                optimisers[i].step()
            say(
                f"{strategy} seed {seed}: round {r + 1}, {CODE_CHAIN_STAGES[i]}: "
                f"SFT loss {float(loss.sft):.3f}"
            )
        if fed is not None:
            fed.aggregate([len(d) for d in data])
        if use_router:
            merged = fedavg_routers(
                {CODE_CHAIN_STAGES[i]: (routers[i].state_dict(), len(data[i])) for i in range(n)}  # type: ignore[union-attr]
            )
            for router in routers:
                router.load_state_dict(merged)  # type: ignore[union-attr]
    if fed is not None:
        fed.finish()
        extra |= fed.bytes_per_round()
    assembled = AssembledModel(experts, routers[0]) if routers[0] is not None else None
    pairs_used = 0
    dpo_losses: tuple[float, ...] = ()
    if use_dpo and assembled is not None and config.dpo_steps > 0:
        dpo = dpo_on_public_prompts(
            assembled,
            tokenizer,
            split.public,
            steps=config.dpo_steps,
            batch_size=config.dpo_batch,
            lr=config.dpo_lr,
            seed=seed,
            max_new_tokens=config.max_new_tokens,
        )
        say(
            f"{strategy} seed {seed}: {dpo.informative} of {len(dpo.pairs)} preference pairs "
            "informative"
        )
        if dpo.report is not None:
            pairs_used, dpo_losses = dpo.report.pairs, dpo.report.losses
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
            one_model = strategy in _GLOBAL_LORA or strategy == "centralised"
            model = experts[0] if one_model else experts[i]
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
        extra=extra,
    )


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
        scores[stage] = sentence_score_columns(outputs, refs)
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
