"""``peerlm run-workflow-experiment``: FedWave against FedAvg and its ablations on the code chain.

Every strategy of :data:`peerlm.agent.FEDWAVE_STRATEGIES` trains the three-stage code
chain's agents in process (``peerlm.agent.fedwave.simulation``: compute-matched, the same
data, initial weights and batch order per seed) and is scored per stage on the held-out
chains. A metric is a matrix ``[seeds, units]`` per strategy: the units are the (stage, test
problem) cells for the lexical metrics over the whole chain (``all``), the test problems of
one stage for a stage's slice and for ``pass@1`` (implement) and ``test_share`` (test).
Means and differences get 95% intervals from the paired two-level bootstrap of the issue-12
experiment (:func:`peerlm.app.experiment_stats.paired_bootstrap`: seeds and problems
resampled, the same draws for every strategy).

Comparisons: ``fedwave_vs_fedavg`` (the paper's claim), FedWave against every other
baseline present (``fedwave_vs_<baseline>``: FedProx, FedAvgM, FedAdam, FedYogi, SCAFFOLD
and the centralised reference), every federated baseline beyond FedAvg against FedAvg
(``<baseline>_vs_fedavg``), every ablation against FedWave (``<ablation>_vs_fedwave``:
negative means the ablated component helped) and ``wo_router_vs_wo_dpo`` (the router alone:
neither has DPO).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from peerlm.agent import (
    CODE_CHAIN_STAGES,
    FEDWAVE_BASELINES,
    FEDWAVE_DEFAULT_STRATEGIES,
    FEDWAVE_STRATEGIES,
    FedWaveSimulationConfig,
    score_fedwave_strategy,
    simulate_fedwave_strategy,
)
from peerlm.app.experiment_stats import Estimate, paired_bootstrap

__all__ = [
    "COMPARED_METRICS",
    "QUICK",
    "comparison_pairs",
    "render_table",
    "run_workflow_experiment",
]

#: The lexical metrics over the whole chain, and the two task metrics with their stage.
LEXICAL = ("rouge1", "rouge2", "rougeL", "bleu4", "gleu", "meteor")
TASKS = (("implement", "pass@1"), ("test", "test_share"))
#: The metrics every comparison reports (METEOR and ROUGE-L are the paper's headline).
COMPARED_METRICS = ("meteor", "rougeL", "bleu4", "pass@1", "test_share")

#: The ``--quick`` setting: seconds per strategy, for tests and smoke runs.
QUICK = FedWaveSimulationConfig(
    rounds=1,
    local_steps=2,
    dpo_steps=2,
    batch=4,
    dpo_batch=2,
    per_stage=16,
    n_test=3,
    n_public=2,
    max_new_tokens=16,
)

Progress = Callable[[str], None]


def comparison_pairs(strategies: Sequence[str]) -> list[tuple[str, str]]:
    """The (a, b) pairs compared as a − b, among those present (module docstring)."""
    have = set(strategies)
    baselines = [s for s in strategies if s == "fedavg" or s in FEDWAVE_BASELINES]
    pairs = [("fedwave", b) for b in baselines] if "fedwave" in have else []
    if "fedavg" in have:
        pairs += [(b, "fedavg") for b in baselines if b not in ("fedavg", "centralised")]
    if "fedwave" in have:
        pairs += [(s, "fedwave") for s in strategies if s not in ("fedwave", *baselines)]
    if {"wo_router", "wo_dpo"} <= have:
        pairs.append(("wo_router", "wo_dpo"))
    return pairs


def _matrices(
    scores: dict[str, list[dict[str, dict[str, list[float]]]]],
) -> dict[tuple[str, str], dict[str, np.ndarray[Any, np.dtype[np.float64]]]]:
    """(slice, metric) -> strategy -> [seeds, units]."""
    out: dict[tuple[str, str], dict[str, np.ndarray[Any, np.dtype[np.float64]]]] = {}
    for strategy, per_seed in scores.items():
        for metric in LEXICAL:
            whole = [[v for stage in CODE_CHAIN_STAGES for v in s[stage][metric]] for s in per_seed]
            out.setdefault(("all", metric), {})[strategy] = np.array(whole, dtype=np.float64)
            for stage in CODE_CHAIN_STAGES:
                rows = [s[stage][metric] for s in per_seed]
                out.setdefault((stage, metric), {})[strategy] = np.array(rows, dtype=np.float64)
        for stage, metric in TASKS:
            rows = [s[stage][metric] for s in per_seed]
            out.setdefault((stage, metric), {})[strategy] = np.array(rows, dtype=np.float64)
    return out


def run_workflow_experiment(
    config: FedWaveSimulationConfig,
    seeds: Sequence[int],
    strategies: Sequence[str] = FEDWAVE_DEFAULT_STRATEGIES,
    *,
    progress: Progress | None = None,
    replicates: int = 2000,
) -> dict[str, Any]:
    """Run every strategy at every seed; return the JSON-able result (means, comparisons)."""
    unknown = [s for s in strategies if s not in FEDWAVE_STRATEGIES]
    if unknown or not strategies:
        raise ValueError(
            f"unknown strategies {unknown}; choose from {', '.join(FEDWAVE_STRATEGIES)}"
        )
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"need distinct seeds, got {list(seeds)}")
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    scores: dict[str, list[dict[str, dict[str, list[float]]]]] = {s: [] for s in strategies}
    diagnostics: dict[str, dict[str, Any]] = {s: {"runs": []} for s in strategies}
    for seed in seeds:
        for strategy in strategies:
            result = simulate_fedwave_strategy(strategy, config, seed, progress=say)
            scores[strategy].append(score_fedwave_strategy(result, config))
            routed = [
                int(top == i)
                for i, stage in enumerate(CODE_CHAIN_STAGES)
                for top in result.top_expert[stage]
                if top >= 0
            ]
            diagnostics[strategy]["runs"].append(
                {
                    "seed": seed,
                    "seconds": round(result.seconds, 1),
                    "sft_steps_per_agent": result.sft_steps_per_agent,
                    "dpo_steps": result.dpo_steps,
                    "dpo_pairs": result.dpo_pairs,
                    "dpo_loss_first_last": (
                        [result.dpo_losses[0], result.dpo_losses[-1]] if result.dpo_losses else None
                    ),
                    "routing_accuracy": sum(routed) / len(routed) if routed else None,
                    **dict(result.extra),
                }
            )
            say(f"done {strategy} seed {seed} in {result.seconds:.0f} s")
    pairs = comparison_pairs(strategies)
    means: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in strategies}
    comparisons: dict[str, dict[str, Any]] = {f"{a}_vs_{b}": {} for a, b in pairs}
    for (slice_, metric), values in _matrices(scores).items():
        key = metric if slice_ == "all" or (slice_, metric) in TASKS else f"{slice_}/{metric}"
        per, diffs = paired_bootstrap(values, pairs, replicates=replicates)
        for strategy, estimate in per.items():
            means[strategy][key] = _rounded(estimate)
        if key in COMPARED_METRICS:
            for (a, b), estimate in diffs.items():
                comparisons[f"{a}_vs_{b}"][key] = _rounded(estimate)
    return {
        "config": asdict(config),
        "seeds": list(seeds),
        "strategies": list(strategies),
        "units": {
            "all": f"{len(CODE_CHAIN_STAGES)} stages x {config.n_test} test problems",
            "stage": f"{config.n_test} test problems",
        },
        "means": means,
        "comparisons": comparisons,
        "diagnostics": diagnostics,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _rounded(estimate: Estimate) -> dict[str, Any]:
    return {
        "mean": round(estimate.mean, 2),
        "ci95": [round(estimate.low, 2), round(estimate.high, 2)],
    }


def render_table(result: dict[str, Any]) -> str:
    """Markdown: the means per strategy, then the comparisons, with 95% intervals."""

    def cell(e: dict[str, Any]) -> str:
        return f"{e['mean']:.2f} [{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}]"

    lines = ["| strategy | " + " | ".join(COMPARED_METRICS) + " | ROUGE-1 | ROUGE-2 | GLEU |"]
    lines.append("|---" * (len(COMPARED_METRICS) + 4) + "|")
    for strategy, row in result["means"].items():
        extra = [cell(row[m]) for m in ("rouge1", "rouge2", "gleu")]
        lines.append(
            f"| {strategy} | " + " | ".join([cell(row[m]) for m in COMPARED_METRICS] + extra) + " |"
        )
    lines += ["", "| comparison (a − b) | " + " | ".join(COMPARED_METRICS) + " |"]
    lines.append("|---" * (len(COMPARED_METRICS) + 1) + "|")
    for name, row in result["comparisons"].items():
        lines.append(f"| {name} | " + " | ".join(cell(row[m]) for m in COMPARED_METRICS) + " |")
    return "\n".join(lines)
