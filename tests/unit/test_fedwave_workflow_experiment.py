"""``peerlm run-workflow-experiment``: FedWave vs FedAvg and the ablations on the code chain."""

from __future__ import annotations

import json

import pytest
from peerlm.agent import FEDWAVE_STRATEGIES, FedWaveSimulationConfig
from typer.testing import CliRunner

from peerlm.app.cli import app
from peerlm.app.workflow_experiment import comparison_pairs, run_workflow_experiment


@pytest.fixture(autouse=True)
def _offline(offline_hub: None) -> None:
    """Every load here is from the shipped tiny models (tests/conftest.py)."""


def test_the_comparisons_are_fedwave_vs_fedavg_and_each_ablation_vs_fedwave() -> None:
    assert comparison_pairs(FEDWAVE_STRATEGIES) == [
        ("fedwave", "fedavg"),
        ("wo_dpo", "fedwave"),
        ("wo_router", "fedwave"),
        ("wo_vclayer", "fedwave"),
        ("sft_only", "fedwave"),
        ("wo_router", "wo_dpo"),
    ]
    assert comparison_pairs(["fedavg", "sft_only"]) == []


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        FedWaveSimulationConfig(rounds=0)
    with pytest.raises(ValueError, match="no shipped tiny model"):
        FedWaveSimulationConfig(arch="no-such-arch")
    with pytest.raises(ValueError, match="unknown strategies"):
        run_workflow_experiment(FedWaveSimulationConfig(), [0], ["fedwave", "fedprox"])
    with pytest.raises(ValueError, match="distinct seeds"):
        run_workflow_experiment(FedWaveSimulationConfig(), [0, 0])
    runner = CliRunner()
    wrong = runner.invoke(app, ["run-workflow-experiment", "--workflow", "pharma", "--quick"])
    assert wrong.exit_code == 2 and "only 'code-chain' exists" in wrong.output


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
            "fedwave,fedavg,wo_dpo",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{") :])
    assert set(data["comparisons"]) == {"fedwave_vs_fedavg", "wo_dpo_vs_fedwave"}
    for comparison in data["comparisons"].values():
        for metric in ("meteor", "rougeL", "pass@1", "test_share"):
            low, high = comparison[metric]["ci95"]
            assert low <= comparison[metric]["mean"] <= high
    for strategy in ("fedwave", "fedavg", "wo_dpo"):
        for metric in ("meteor", "rougeL", "rouge1", "rouge2", "bleu4", "gleu", "specify/meteor"):
            assert 0 <= data["means"][strategy][metric]["mean"] <= 100
    runs = data["diagnostics"]
    # Compute-matched: the strategies without DPO make its steps as SFT steps instead.
    quick = FedWaveSimulationConfig(**data["config"])
    for run in runs["fedwave"]["runs"]:
        assert run["sft_steps_per_agent"] == quick.rounds * quick.local_steps
        assert 0.0 <= run["routing_accuracy"] <= 1.0
    for run in runs["fedavg"]["runs"] + runs["wo_dpo"]["runs"]:
        assert run["sft_steps_per_agent"] == quick.rounds * quick.local_steps + quick.dpo_steps
        assert run["dpo_steps"] == 0
