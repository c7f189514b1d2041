"""``run-experiment --reuse``: which stored (strategy, seed) runs may stand in for new ones."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from peerlm.app.experiment import ExperimentPlan, reusable_runs
from peerlm.app.experiment_reuse import ADAPTER_KILOBYTES, COLLABORATION_HARNESS
from tests.cli import assert_run_experiment_refuses

NLL = {"own": 0.28, "lacked": 2.61, "public": 0.18}


def _stored(plan: ExperimentPlan, nll: dict[str, float] = NLL) -> dict[str, Any]:
    return {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "initial_nll": dict(nll),
        "runs": {
            s: {str(k): {"strategy": s, "seed": k} for k in plan.seeds} for s in plan.strategies
        },
        "adapter_kilobytes": ADAPTER_KILOBYTES,
        "collaboration_harness": COLLABORATION_HARNESS,
    }


def test_runs_of_the_same_plan_are_reused_per_strategy_and_seed() -> None:
    old = _stored(ExperimentPlan(strategies=("oracle", "local_plus"), seeds=(0, 1)))
    plan = ExperimentPlan(strategies=("local_plus", "random", "oracle"), seeds=(1, 2))
    got = reusable_runs(plan, [old], NLL)
    assert sorted(got) == [("local_plus", 1), ("oracle", 1)]
    assert got[("oracle", 1)] == {"strategy": "oracle", "seed": 1}


def test_a_run_two_files_hold_is_taken_from_the_first_and_neither_file_is_refused() -> None:
    # A command's runs-so-far.json holds the runs it reused as well as its own: passing the
    # file it reused too is redundant, not wrong.
    progress = _stored(ExperimentPlan(strategies=("local_plus", "oracle"), seeds=(0, 1)))
    original = _stored(ExperimentPlan(strategies=("local_plus",), seeds=(0, 1)))
    original["runs"]["local_plus"]["0"]["from"] = "original"
    plan = ExperimentPlan(strategies=("local_plus", "oracle"), seeds=(0, 1))
    got = reusable_runs(plan, [progress, original], NLL)
    assert sorted(got) == [("local_plus", 0), ("local_plus", 1), ("oracle", 0), ("oracle", 1)]
    assert "from" not in got[("local_plus", 0)]


def test_runs_that_moved_adapters_need_their_kilobytes_counted_as_today() -> None:
    """A result written before transfers counted the encoded bytes (no marker): its merge,
    menu and overlay runs are run again, the others still stand in."""
    plan = ExperimentPlan(
        strategies=("local_plus", "cpm", "cpm_menu", "cpm_svd_hka", "overlay_topk"),
        seeds=(0,),
        family="gpt2",
    )
    old = _stored(plan)
    assert len(reusable_runs(plan, [old], NLL)) == 5
    del old["adapter_kilobytes"]
    assert sorted(reusable_runs(plan, [old], NLL)) == [("cpm", 0), ("local_plus", 0)]


def test_collaborative_runs_need_todays_harness_and_runs_alone_do_not() -> None:
    """A result written before the 2026-12-07 harness (no marker: a package with nothing
    to learn still trained the slot, no answer check was recorded): its collaborative runs
    are run again, LocalOnly+ still stands in."""
    plan = ExperimentPlan(strategies=("local_plus", "random", "cpm"), seeds=(0,))
    old = _stored(plan)
    assert len(reusable_runs(plan, [old], NLL)) == 3
    old["collaboration_harness"] = "2026-12-05"
    assert sorted(reusable_runs(plan, [old], NLL)) == [("local_plus", 0)]
    del old["collaboration_harness"]
    assert sorted(reusable_runs(plan, [old], NLL)) == [("local_plus", 0)]


def test_cpm_settings_matter_only_to_cpm_runs() -> None:
    old = _stored(ExperimentPlan(strategies=("local_plus", "cpm"), seeds=(0,)))
    plan = ExperimentPlan(strategies=("local_plus", "cpm"), seeds=(0,), cpm_beta=0.25)
    assert sorted(reusable_runs(plan, [old], NLL)) == [("local_plus", 0)]
    same = ExperimentPlan(strategies=("cpm",), seeds=(0,))
    assert sorted(reusable_runs(same, [old], NLL)) == [("cpm", 0)]


def test_an_older_plan_without_a_new_field_reads_as_its_default() -> None:
    old = _stored(ExperimentPlan(strategies=("cpm",), seeds=(0,)))
    del old["plan"]["cpm_context_columns"], old["plan"]["cpm_beta"]
    assert sorted(reusable_runs(ExperimentPlan(strategies=("cpm",), seeds=(0,)), [old], NLL)) == [
        ("cpm", 0)
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nll": {**NLL, "lacked": 2.6100001}}, "another world or other models"),
        ({"plan": {"rounds": 7}}, "no run of this plan"),
        ({"plan": {"world_seed": 1}}, "no run of this plan"),
        ({"broken": True}, "not a run-experiment results.json"),
    ],
)
def test_a_stored_result_of_another_world_or_plan_is_refused(
    change: dict[str, Any], message: str
) -> None:
    base = ExperimentPlan(strategies=("local_plus",), seeds=(0,))
    old = _stored(
        ExperimentPlan(**{**asdict(base), **change.get("plan", {})}), change.get("nll", NLL)
    )
    if change.get("broken"):
        del old["runs"]
    with pytest.raises(ValueError, match=message):
        reusable_runs(base, [old], NLL)


def test_the_probe_scope_matters_only_to_cpm_runs() -> None:
    old = _stored(ExperimentPlan(strategies=("local_plus", "oracle", "cpm"), seeds=(0,)))
    plan = ExperimentPlan(
        strategies=("local_plus", "oracle", "cpm"), seeds=(0,), probe_scope="lacked"
    )
    assert sorted(reusable_runs(plan, [old], NLL)) == [("local_plus", 0), ("oracle", 0)]


def test_the_proxy_tuning_beta_matters_only_to_proxy_tuned_runs() -> None:
    family = {"family": "gpt2"}
    strategies = ("fedproxy_hties", "fedproxy_proxytuning")
    old = _stored(ExperimentPlan(strategies=strategies, seeds=(0,), **family))
    del old["plan"]["proxy_tuning_beta"]  # a results.json from before the field: β = 1
    half = ExperimentPlan(strategies=strategies, seeds=(0,), proxy_tuning_beta=0.5, **family)
    assert sorted(reusable_runs(half, [old], NLL)) == [("fedproxy_hties", 0)]
    one = ExperimentPlan(strategies=strategies, seeds=(0,), **family)
    assert sorted(reusable_runs(one, [old], NLL)) == sorted((s, 0) for s in strategies)


@pytest.mark.parametrize("beta", [-0.1, float("nan"), float("inf"), True])
def test_a_proxy_tuning_beta_that_is_not_finite_and_non_negative_is_refused(beta: float) -> None:
    with pytest.raises(ValueError, match="proxy_tuning_beta"):
        ExperimentPlan(proxy_tuning_beta=beta)


def test_an_integer_proxy_tuning_beta_is_the_same_plan_as_its_float() -> None:
    family = {"family": "gpt2", "strategies": ("fedproxy_proxytuning",), "seeds": (0,)}
    old = _stored(ExperimentPlan(**family))
    plan = ExperimentPlan(proxy_tuning_beta=1, **family)  # type: ignore[arg-type]
    assert plan.proxy_tuning_beta == 1.0 and isinstance(plan.proxy_tuning_beta, float)
    assert sorted(reusable_runs(plan, [old], NLL)) == [("fedproxy_proxytuning", 0)]


def test_run_experiment_refuses_a_negative_proxy_tuning_beta(tmp_path: Path) -> None:
    """Refused before anything runs (exit 2, nothing written)."""
    assert_run_experiment_refuses(
        tmp_path / "out", ["--proxy-tuning-beta", "-1"], "proxy_tuning_beta"
    )


def test_a_proxy_tuning_beta_without_the_proxy_tuned_strategy_is_refused() -> None:
    """Nothing would read it: refused rather than silently ignored."""
    with pytest.raises(ValueError, match="fedproxy_proxytuning only"):
        ExperimentPlan(family="gpt2", strategies=("fedproxy_hties",), proxy_tuning_beta=0.5)
    ExperimentPlan(family="gpt2", strategies=("fedproxy_hties",), proxy_tuning_beta=1.0)


@pytest.mark.parametrize(
    "change",
    [
        {"integration": "shared"},
        {"peer_alpha": None},
        {"own_steps_every_round": False},
        {"teach_limit": 8},
        {"teach_self_check": True},
        {"slot_rehearsal": 2},
        {"slot_banks": "one"},
        {"slot_learning_rate": 1e-2},
    ],
)
def test_an_ablation_of_the_collaboration_reuses_only_the_runs_that_train_alone(
    change: dict[str, Any],
) -> None:
    """LocalOnly and LocalOnly+ never read where or how peers' knowledge is integrated, so
    an ablation's command takes their stored runs and runs only the collaborating ones."""
    strategies = ("local", "local_plus", "cpm")
    old = _stored(ExperimentPlan(strategies=strategies, seeds=(0,)))
    plan = ExperimentPlan(strategies=strategies, seeds=(0,), **change)
    assert sorted(reusable_runs(plan, [old], NLL)) == [("local", 0), ("local_plus", 0)]


def test_a_plan_of_another_number_of_teachers_reuses_no_run() -> None:
    """``teachers_per_student`` sets LocalOnly+'s extra own-data steps (one lesson's steps
    per teacher) and KNEXA-FL's lessons, so a plan of another number reuses neither; a
    stored plan that predates the field ran one teacher."""
    strategies = ("local_plus", "cpm")
    one = ExperimentPlan(strategies=strategies, seeds=(0,), teachers_per_student=1)
    two = ExperimentPlan(strategies=strategies, seeds=(0,), teachers_per_student=2)
    with pytest.raises(ValueError, match="no run of this plan"):
        reusable_runs(two, [_stored(one)], NLL)
    # LocalOnly spends no lesson's steps: its runs stand in whatever the number.
    alone = ("local", "local_plus", "cpm")
    one_alone = ExperimentPlan(strategies=alone, seeds=(0,), teachers_per_student=1)
    two_alone = ExperimentPlan(strategies=alone, seeds=(0,), teachers_per_student=2)
    assert list(reusable_runs(two_alone, [_stored(one_alone)], NLL)) == [("local", 0)]
    assert sorted(reusable_runs(two, [_stored(two)], NLL)) == [("cpm", 0), ("local_plus", 0)]
    before = _stored(one)
    del before["plan"]["teachers_per_student"]
    assert sorted(reusable_runs(one, [before], NLL)) == [("cpm", 0), ("local_plus", 0)]
    with pytest.raises(ValueError, match="no run of this plan"):
        reusable_runs(two, [before], NLL)


def test_a_plan_from_before_slot_banks_ran_one_adapter() -> None:
    """A stored collaborative run without ``slot_banks`` had one peer slot adapter: it
    stands in for ``slot_banks: one``, not for today's default, ``category``."""
    strategies = ("local_plus", "cpm")
    one = ExperimentPlan(strategies=strategies, seeds=(0,), slot_banks="one")
    before = _stored(one)
    del before["plan"]["slot_banks"]
    assert sorted(reusable_runs(one, [before], NLL)) == [("cpm", 0), ("local_plus", 0)]
    today = ExperimentPlan(strategies=strategies, seeds=(0,))
    assert today.slot_banks == "category"
    assert list(reusable_runs(today, [before], NLL)) == [("local_plus", 0)]


def test_run_experiment_refuses_several_teachers_without_a_student_every_round(
    tmp_path: Path,
) -> None:
    """Refused before anything runs (exit 2, nothing written)."""
    assert_run_experiment_refuses(
        tmp_path / "out",
        ["--pairing", "disjoint", "--teachers-per-student", "2"],
        "teachers_per_student",
    )
