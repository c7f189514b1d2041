"""``peerlm run-workflow-experiment``: FedWave vs FedAvg and the ablations on the code chain."""

from __future__ import annotations

import json

import pytest
from peerlm.agent import (
    FEDWAVE_DEFAULT_STRATEGIES,
    FEDWAVE_STRATEGIES,
    FedWaveSimulationConfig,
)
from typer.testing import CliRunner

from peerlm.app.cli import app
from peerlm.app.workflow_experiment import comparison_pairs, run_workflow_experiment


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def test_the_comparisons_are_fedwave_vs_fedavg_and_each_ablation_vs_fedwave() -> None:
    assert comparison_pairs(FEDWAVE_DEFAULT_STRATEGIES) == [
        ("fedwave", "fedavg"),
        ("wo_dpo", "fedwave"),
        ("wo_router", "fedwave"),
        ("wo_vclayer", "fedwave"),
        ("sft_only", "fedwave"),
        ("wo_router", "wo_dpo"),
    ]
    assert comparison_pairs(["fedavg", "sft_only"]) == []


def test_the_baselines_are_compared_with_fedwave_and_with_fedavg() -> None:
    pairs = comparison_pairs(FEDWAVE_STRATEGIES)
    for baseline in ("fedprox", "fedavgm", "fedadam", "fedyogi", "scaffold"):
        assert ("fedwave", baseline) in pairs and (baseline, "fedavg") in pairs
    assert ("fedwave", "centralised") in pairs and ("centralised", "fedavg") not in pairs
    assert len(pairs) == len(set(pairs)) == 6 + 5 + 1 + 4 + 1
    assert comparison_pairs(["fedprox", "centralised"]) == []


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        FedWaveSimulationConfig(rounds=0)
    with pytest.raises(ValueError, match="no shipped tiny model"):
        FedWaveSimulationConfig(arch="no-such-arch")
    with pytest.raises(ValueError, match="unknown strategies"):
        run_workflow_experiment(FedWaveSimulationConfig(), [0], ["fedwave", "fedadagrad"])
    with pytest.raises(ValueError, match="prox_mu must be >= 0"):
        FedWaveSimulationConfig(prox_mu=-0.1)
    with pytest.raises(ValueError, match="distinct seeds"):
        run_workflow_experiment(FedWaveSimulationConfig(), [0, 0])
    runner = CliRunner()
    wrong = runner.invoke(app, ["run-workflow-experiment", "--workflow", "pharma", "--quick"])
    assert wrong.exit_code == 2 and "only 'code-chain' exists" in wrong.output
    for flag in ("--router-lr", "--dpo-lr"):
        bad = runner.invoke(app, ["run-workflow-experiment", "--quick", flag, "0"])
        assert bad.exit_code == 2 and "router_lr and dpo_lr must be > 0" in bad.output


STRATEGIES = (
    "fedwave",
    "fedavg",
    "wo_dpo",
    "fedprox",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "scaffold",
    "centralised",
)


@pytest.mark.slow
def test_quick_json_has_the_comparisons_with_intervals() -> None:
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "run-workflow-experiment",
            "--quick",
            "--seeds",
            "0,1",
            "--strategies",
            ",".join(STRATEGIES),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{") :])
    baselines = ("fedprox", "fedavgm", "fedadam", "fedyogi", "scaffold")
    assert set(data["comparisons"]) == {
        "fedwave_vs_fedavg",
        "wo_dpo_vs_fedwave",
        "fedwave_vs_centralised",
        *(f"fedwave_vs_{b}" for b in baselines),
        *(f"{b}_vs_fedavg" for b in baselines),
    }
    for comparison in data["comparisons"].values():
        for metric in ("meteor", "rougeL", "pass@1", "test_share"):
            low, high = comparison[metric]["ci95"]
            assert low <= comparison[metric]["mean"] <= high
    for strategy in STRATEGIES:
        for metric in ("meteor", "rougeL", "rouge1", "rouge2", "bleu4", "gleu", "specify/meteor"):
            assert 0 <= data["means"][strategy][metric]["mean"] <= 100
    runs = data["diagnostics"]
    # Compute-matched: the strategies without DPO make its steps as SFT steps instead.
    quick = FedWaveSimulationConfig(**data["config"])
    for run in runs["fedwave"]["runs"]:
        assert run["sft_steps_per_agent"] == quick.rounds * quick.local_steps
        assert 0.0 <= run["routing_accuracy"] <= 1.0
    per_agent = quick.rounds * quick.local_steps + quick.dpo_steps
    for strategy in ("fedavg", "wo_dpo", *baselines):
        for run in runs[strategy]["runs"]:
            assert run["sft_steps_per_agent"] == per_agent
            assert run["dpo_steps"] == 0
    # The centralised model alone makes the steps of all three agents together.
    for run in runs["centralised"]["runs"]:
        assert run["sft_steps_per_agent"] == 3 * per_agent
    no_dpo = ("fedavg", "wo_dpo", *baselines, "centralised")
    totals = {run["sft_steps_total"] for s in no_dpo for run in runs[s]["runs"]}
    assert totals == {3 * per_agent}
    # SCAFFOLD sends a control delta as large as its LoRA factors with them.
    for run in runs["scaffold"]["runs"]:
        assert run["control_bytes_per_agent_round"] == run["model_bytes_per_agent_round"] > 0
