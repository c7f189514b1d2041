"""The reward normaliser reaches the CPM from every way of starting one: the service's
settings (env), ``peerlm run-experiment --reward-normaliser`` (recorded in results.json's
plan, part of the reuse key of CPM runs only) and ``peerlm up --reward-normaliser``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from peerlm.services.cpm import CpmSettings

from peerlm.app.experiment import ExperimentPlan, reusable_runs
from peerlm.app.experiment_exchange import pairing_policy
from peerlm.app.experiment_reuse import COLLABORATION_HARNESS
from tests.cli import assert_run_experiment_refuses

NLL = {"own": 0.28, "lacked": 2.61, "public": 0.18}


def test_the_env_selects_the_normaliser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLM_CPM_REWARD_NORMALISER", "robust")
    monkeypatch.setenv("PEERLM_CPM_REWARD_WINDOW", "128")
    s = CpmSettings()
    assert (s.reward_normaliser, s.reward_window) == ("robust", 128)


def test_the_experiment_plan_carries_the_normaliser_to_its_cpm() -> None:
    plan = ExperimentPlan(cpm_reward_normaliser="robust")
    assert plan.cpm_settings().reward_normaliser == "robust"
    config = pairing_policy("cpm", plan, 0).config()
    assert (config["reward_normaliser"], config["reward_window"]) == ("robust", 256)
    assert pairing_policy("cpm", ExperimentPlan(), 0).config()["reward_normaliser"] == "robust"
    # A plan asking for the paper's z-score gets it, though it is no longer the default.
    zscore = ExperimentPlan(cpm_reward_normaliser="zscore")
    assert zscore.cpm_settings().reward_normaliser == "zscore"
    assert pairing_policy("cpm", zscore, 0).config()["reward_normaliser"] == "zscore"


def _stored(plan: ExperimentPlan) -> dict[str, Any]:
    # What run_experiment writes to results.json (its "plan" is asdict(plan)).
    return {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "initial_nll": dict(NLL),
        "runs": {
            s: {str(k): {"strategy": s, "seed": k} for k in plan.seeds} for s in plan.strategies
        },
        "collaboration_harness": COLLABORATION_HARNESS,
    }


def test_results_record_the_normaliser_and_reuse_only_matching_cpm_runs() -> None:
    robust = ExperimentPlan(
        strategies=("local_plus", "cpm"), seeds=(0,), cpm_reward_normaliser="robust"
    )
    stored = _stored(robust)
    assert stored["plan"]["cpm_reward_normaliser"] == "robust"
    zscore = ExperimentPlan(
        strategies=("local_plus", "cpm"), seeds=(0,), cpm_reward_normaliser="zscore"
    )
    assert sorted(reusable_runs(zscore, [stored], NLL)) == [("local_plus", 0)]
    assert sorted(reusable_runs(robust, [stored], NLL)) == [("cpm", 0), ("local_plus", 0)]
    # The default is "robust" now, and a default plan reuses the robust runs.
    default = ExperimentPlan(strategies=("local_plus", "cpm"), seeds=(0,))
    assert sorted(reusable_runs(default, [stored], NLL)) == [("cpm", 0), ("local_plus", 0)]
    # A results.json from before the setting ran the z-score (the default of its day), so
    # its CPM runs stand in for a z-score plan only, never for today's default.
    old = _stored(zscore)
    del old["plan"]["cpm_reward_normaliser"]
    assert sorted(reusable_runs(zscore, [old], NLL)) == [("cpm", 0), ("local_plus", 0)]
    assert sorted(reusable_runs(robust, [old], NLL)) == [("local_plus", 0)]
    assert sorted(reusable_runs(default, [old], NLL)) == [("local_plus", 0)]


def test_run_experiment_refuses_an_unknown_normaliser(tmp_path: Path) -> None:
    """Refused before anything runs (exit 2, nothing written)."""
    assert_run_experiment_refuses(
        tmp_path / "out", ["--reward-normaliser", "median"], "reward-normaliser"
    )


def test_the_synthetic_bench_runs_the_robust_normaliser() -> None:
    """``linucb-robust`` in bench/cpm.py: the same LinUCB with the robust normaliser, for
    comparisons on the synthetic federation (run_one only, not in the report's tables)."""
    from peerlm.bench.cpm import METHODS, RunSpec, make_policy, run_one
    from peerlm.bench.synthetic import SyntheticFederation

    policy, _ = make_policy("linucb-robust", 0, SyntheticFederation(8, "high", 0))
    assert policy.config()["reward_normaliser"] == "robust"  # type: ignore[attr-defined]
    assert "linucb-robust" not in METHODS
    run = run_one(RunSpec(8, "high", 0, "linucb-robust", 4))
    assert len(run.regret_curve) == 4 and run.observe_calls > 0
