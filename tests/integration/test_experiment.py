"""``peerlm run-experiment`` with micro models: every strategy, slices, intervals, determinism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from peerlm.app.devfed import AGENT_ENV
from tests.proc_table import alive, children, cmdline

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_quick_run_reports_every_strategy_per_slice_with_intervals(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "peerlm", "run-experiment", "--quick", "--micro", "--json",
        "-n", "4", "--local-steps", "1", "--transfer-limit", "3", "--test-limit", "12",
        "--max-new-tokens", "8",
        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
        "--out", str(out), "--jobs", "1",
    ]  # fmt: skip
    # One process: worker processes (the tests below run them) would each import the model
    # libraries again, ~35 CPU s of a suite that is CPU-bound.
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=900, env={**os.environ, **AGENT_ENV}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A pipe gets one line per step, never bars.
    assert "local seed 0 round 1: test NLL per slice: own " in proc.stderr
    view = json.loads(proc.stdout)
    assert view["plan"]["seeds"] == [0, 1] and view["plan"]["rounds"] == 2
    strategies = view["strategies"]
    assert list(strategies) == [
        "local", "local_plus", "random", "heuristic", "central_kd", "cpm", "oracle",
        "semantic_dfl",
    ]  # fmt: skip
    for name, r in strategies.items():
        for slice_name in ("own", "lacked"):
            for metric in ("pass@1", "struct", "nll"):
                est = r["metrics"][slice_name][metric]
                low, high = est["ci95"]
                assert low <= est["mean"] <= high, (name, slice_name, metric)
            assert r["metrics"][slice_name]["nll"]["mean"] > 0
    assert strategies["local"]["exchanges"] == 0 and strategies["local_plus"]["kilobytes"] == 0
    # 4 clients, 2 rounds. Every client a student of two teachers each round (the default
    # pairing, per_student, and teachers_per_student 2) under Random-P2P, the CPM and the
    # Oracle; of the one consensus under Central-KD; 2 disjoint pairs a round under
    # Heuristic-P2P (Algorithm 4).
    assert view["plan"]["teachers_per_student"] == 2
    for name in ("random", "cpm", "oracle"):
        assert strategies[name]["exchanges"] == 16, name
    assert strategies["central_kd"]["exchanges"] == 8
    assert strategies["heuristic"]["exchanges"] == 4
    # Four architectures: no two clients share a family, so SemanticDFL has no neighbour.
    assert strategies["semantic_dfl"]["exchanges"] == 0
    comparisons = view["comparisons"]
    assert {"cpm_vs_random", "cpm_vs_local_plus", "best_vs_local_plus"} <= set(comparisons)
    for c in comparisons.values():
        assert c["slice"] == "lacked"
        for metric in ("pass@1", "nll"):
            low, high = c[metric]["ci95"]
            assert low <= c[metric]["delta"] <= high
    learning = view["cpm_learning"]
    assert [r["round"] for r in learning["per_round"]] == [1, 2, 1, 2]
    for r in learning["per_round"]:
        # The oracle keeps each student's two best teachers by gain; the CPM's pairs are
        # scored on the oracle run's matrix.
        assert len(r["oracle_pairs"]) == 8 and len(r["cpm_pairs"]) == 8
        assert 0 <= r["agreement"] <= 1
        assert all(math.isfinite(r[k]) for k in ("cpm_gain", "oracle_gain", "random_gain"))

    result = json.loads((out / "results.json").read_text())
    # Every strategy of a seed starts from the same round 0 and round-1 local update.
    for seed in ("0", "1"):
        first = {
            json.dumps(runs[seed]["rounds"][0]["train_loss"], sort_keys=True)
            for runs in result["runs"].values()
        }
        assert len(first) == 1
    # The probe reward: L_pre/L_post of each P2P exchange, minus the KB penalty.
    for x in result["runs"]["cpm"]["0"]["rounds"][0]["exchanges"]:
        expected = x["loss_pre"] - x["loss_post"] - 0.001 * x["kilobytes"]
        assert x["reward"] == pytest.approx(expected, abs=1e-4)
        assert x["normalised_reward"] is not None
    table = (out / "table.md").read_text()
    for label in ("LocalOnly+", "Random-P2P", "Oracle pairing", "KNEXA-FL", "SemanticDFL"):
        assert label in table
    assert "KNEXA-FL (CPM) - Random-P2P" in table
    assert (out / "nll_by_round.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_strategy_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "peerlm", "run-experiment", "--micro", "--strategies", "gossip"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "unknown strategies" in proc.stderr


@pytest.mark.timeout(900)
def test_parallel_strategies_give_the_same_results(tmp_path: Path) -> None:
    """Each strategy is seeded on its own: worker processes change the wall time only."""
    from peerlm.app.experiment import ExperimentPlan, run_experiment

    plan = ExperimentPlan(
        agents=2, rounds=1, strategies=("local", "random"), seeds=(0,), size="micro",
        local_steps=1, transfer_limit=2, val_limit=2, test_limit=3, samples=2,
        max_new_tokens=8, probe_per_category=1, warmup_steps=0, akd_steps=None,
    )  # fmt: skip
    runs = [
        run_experiment(plan, models=tmp_path / "models", work=tmp_path / f"w{jobs}", jobs=jobs)
        for jobs in (1, 2)
    ]
    for run in runs:
        cpu = [seeded["cpu_seconds"] for r in run["runs"].values() for seeded in r.values()]
        # The CPU time of each run (measured in its own process) and the whole command's,
        # which counts the workers' runs too.
        assert all(c > 0 for c in cpu) and run["cpu_seconds"] >= sum(cpu)
        for r in run["runs"].values():
            for seeded in r.values():
                seeded.pop("seconds")
                seeded.pop("cpu_seconds")
    assert runs[0]["runs"] == runs[1]["runs"]
    assert runs[0]["summary"] == runs[1]["summary"]


@pytest.mark.timeout(900)
def test_adapter_merge_strategies_on_one_family(tmp_path: Path) -> None:
    """FedAvg-LoRA merges every round, the OnePeFT variants once in the last round; all
    within the family (one backbone here), with the pulled bytes counted."""
    from peerlm.app.experiment import ExperimentPlan, render_table, run_experiment

    plan = ExperimentPlan(
        agents=3, rounds=2, seeds=(0,), size="micro", family="gpt2",
        strategies=("local_plus", "fedavg_lora", "ffa_lora", "onepeft", "onepeft_svd",
                    "onepeft_hka", "onepeft_fedavg", "onepeft_multi", "onepeft_multi_ce",
                    "fedavg_lora_plus",
                    "fedproxy_hties", "fedproxy_hties_nopcr", "fedproxy_fedavg", "fedproxy_ties",
                    "fedproxy_centsft", "fedproxy_proxytuning"),
        local_steps=1, transfer_limit=2, val_limit=2, test_limit=6, samples=1,
        max_new_tokens=8, probe_per_category=1, warmup_steps=0, akd_steps=None,
    )  # fmt: skip
    result = run_experiment(plan, models=tmp_path / "models", work=tmp_path / "w", jobs=1)
    assert {c["arch"] for c in result["clients"]} == {"gpt2"}
    runs = {s: r["0"] for s, r in result["runs"].items()}
    # 3 clients, each pulling the 2 others' adapters: every round, or once.
    assert runs["fedavg_lora"]["exchanges"] == 6
    for name in ("onepeft", "onepeft_svd", "onepeft_hka", "onepeft_fedavg"):
        assert runs[name]["exchanges"] == 3, name
        assert [len(r["exchanges"]) for r in runs[name]["rounds"]] == [0, 3]
        assert runs[name]["kilobytes"] == pytest.approx(runs["fedavg_lora"]["kilobytes"] / 2)
    # Multi-round OnePeFT and the compute-matched FedAvg-LoRA pull what FedAvg-LoRA pulls.
    for name in ("ffa_lora", "onepeft_multi", "onepeft_multi_ce", "fedavg_lora_plus"):
        assert runs[name]["exchanges"] == 6, name
        assert [len(r["exchanges"]) for r in runs[name]["rounds"]] == [3, 3], name
        assert runs[name]["kilobytes"] == pytest.approx(runs["fedavg_lora"]["kilobytes"])
    # Each client's own steps after the average (or HKA after SVD) personalise its adapter.
    for name in ("onepeft_multi", "fedavg_lora_plus"):
        assert len({tuple(c["nll"]) for c in runs[name]["clients"].values()}) > 1, name
    for a, b in (("onepeft_multi", "fedavg_lora_plus"), ("onepeft_multi", "onepeft")):
        assert f"{a}_vs_{b}" in result["summary"]["comparisons"]
    # HKA at alpha 1 drops the teachers' KL: another adapter than the paper's alpha 0.5.
    assert runs["onepeft_multi_ce"]["clients"]["agent-0"]["nll"] != pytest.approx(
        runs["onepeft_multi"]["clients"]["agent-0"]["nll"]
    )
    # FedAvg-LoRA and FFA-LoRA leave every client with the same adapter: the same test NLL.
    for name in ("fedavg_lora", "ffa_lora"):
        nll = [c["nll"] for c in runs[name]["clients"].values()]
        assert nll[0] == pytest.approx(nll[1]) and nll[1] == pytest.approx(nll[2]), name
    for other in ("fedavg_lora", "ffa_lora"):
        assert f"onepeft_vs_{other}" in result["summary"]["comparisons"]
    assert "OnePeFT (SVD+HKA) - FedAvg-LoRA" in render_table(result)
    assert "OnePeFT (SVD+HKA) - FFA-LoRA" in render_table(result)
    # No warm-up: ffa_lora's round 0 is the base model too (B = 0), as everyone's.
    assert result["initial_nll_ffa_lora"] == pytest.approx(result["initial_nll"])
    _check_fedproxy_rows(result, runs)
    _check_centsft(result, runs["fedproxy_centsft"])
    _check_proxytuning(result, runs)


def _check_proxytuning(result: dict[str, Any], runs: dict[str, Any]) -> None:
    """ProxyTuning: the H-TIES + PCR cohort round for round (same proxies: same proxy NLL,
    same bytes), only the plug-in differs; round 0 is M. The micro model has one block, so
    κ = 0.5 keeps it and the proxy is M itself: then s_M + s_φT − s_φ0 = s_φT, the fused
    model's logits, and the two plug-ins must score every problem alike (a check of the
    arithmetic end to end; tests/unit/test_proxy_tuning.py covers a proxy unlike M)."""
    tuned, fused = runs["fedproxy_proxytuning"], runs["fedproxy_hties"]
    assert tuned["kilobytes"] == fused["kilobytes"]
    for a, b in zip(tuned["rounds"], fused["rounds"], strict=True):
        assert a["proxy_nll"] == pytest.approx(b["proxy_nll"])
    assert tuned["curve_nll"]["public"][0] == pytest.approx(result["initial_nll"]["public"])
    for name, client in tuned["clients"].items():
        assert client["nll"] == pytest.approx(fused["clients"][name]["nll"], abs=1e-4)
    assert "fedproxy_proxytuning_vs_fedproxy_hties" in result["summary"]["comparisons"]


def _check_centsft(result: dict[str, Any], run: dict[str, Any]) -> None:
    """CentSFT: no exchange and no byte, the cohort's steps (3 members x 1 step) on the full
    model each round, one model for every client, starting from the base (round 0)."""
    assert run["exchanges"] == 0 and run["kilobytes"] == 0
    assert [r["steps"] for r in run["rounds"]] == [3, 3]
    nll = [c["nll"] for c in run["clients"].values()]
    assert nll[0] == pytest.approx(nll[1]) and nll[1] == pytest.approx(nll[2])
    assert run["curve_nll"]["public"][0] == pytest.approx(result["initial_nll"]["public"])
    # Training on the pooled texts moved the model.
    assert run["curve_nll"]["own"][-1] != pytest.approx(run["curve_nll"]["own"][0])
    assert "fedproxy_centsft_vs_fedproxy_hties" in result["summary"]["comparisons"]


def _check_fedproxy_rows(result: dict[str, Any], runs: dict[str, Any]) -> None:
    """The FedProxy strategies: each member pulls the proxy and sends its update every round
    (bytes of the encoded payloads, the conflict scores only after an H-TIES round), the
    fused model is the one every client is evaluated on, and without a warm-up round 0 is
    the base model, as for the adapter strategies (B = 0)."""
    from peerlm.app.experiment import render_table

    proxied = ("fedproxy_hties", "fedproxy_hties_nopcr", "fedproxy_fedavg", "fedproxy_ties")
    for name in proxied:
        run = runs[name]
        assert run["exchanges"] == 6, name
        assert run["compress"]["kept_blocks"], name
        for r in run["rounds"]:
            for x in r["exchanges"]:
                assert x["kilobytes"] == round((x["down_bytes"] + x["up_bytes"]) / 1024, 2)
                assert x["steps"] == 1
        nll = [c["nll"] for c in run["clients"].values()]
        assert nll[0] == pytest.approx(nll[1]) and nll[1] == pytest.approx(nll[2]), name
        assert run["curve_nll"]["public"][0] == pytest.approx(result["initial_nll"]["public"])
    down = {n: [r["exchanges"][0]["down_bytes"] for r in runs[n]["rounds"]] for n in proxied}
    # H-TIES publishes C_d with round 2's proxy, FedAvg and TIES publish none.
    assert down["fedproxy_hties"][1] > down["fedproxy_hties"][0]
    assert down["fedproxy_fedavg"][1] == down["fedproxy_fedavg"][0]
    assert down["fedproxy_ties"][1] == down["fedproxy_ties"][0]
    # The merges differ, so the fused models do.
    hties = runs["fedproxy_hties_nopcr"]["clients"]["agent-0"]["nll"]
    assert hties != runs["fedproxy_fedavg"]["clients"]["agent-0"]["nll"]
    comparisons = result["summary"]["comparisons"]
    assert {"fedproxy_hties_vs_fedproxy_fedavg", "fedproxy_fedavg_vs_fedavg_lora"} <= set(
        comparisons
    )
    assert "FedProxy (H-TIES+PCR) - FedAvg of proxies" in render_table(result)


def test_fedproxy_strategies_need_one_family() -> None:
    from peerlm.app.experiment import ExperimentPlan

    with pytest.raises(ValueError, match="--family"):
        ExperimentPlan(strategies=("fedproxy_hties",))
    with pytest.raises(ValueError, match="proxy_ratio"):
        ExperimentPlan(strategies=("fedproxy_fedavg",), family="gpt2", proxy_ratio=1.0)


@pytest.mark.timeout(900)
def test_the_cpm_over_the_menu_chooses_a_protocol_per_pair_quick(tmp_path: Path) -> None:
    """``cpm_menu`` under ``--quick`` on one family: every directive names a protocol of the
    menu, the round records count them, and each was executed and rewarded; ``cpm_pmix``
    (one protocol forced for everyone) names pmix only. ``overlay_topk``: every client
    takes an overlay step each round (its 2 nearest peers pulled and aggregated);
    ``cpm_menu_overlay``: the same after each directive, and from round 2 on a merge comes
    only from a sender on the list of the student's last overlay step."""
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "peerlm", "run-experiment", "--quick", "--micro", "--json",
        "-n", "4", "--family", "gpt2",
        "--strategies", "local_plus,cpm_menu,cpm_pmix,cpm_menu_overlay,overlay_topk",
        "--local-steps", "1", "--transfer-limit", "3", "--test-limit", "8",
        "--max-new-tokens", "8", "--seeds", "0",
        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
        "--out", str(out), "--jobs", "1",
    ]  # fmt: skip
    # One process: worker processes (the tests below run them) would each import the model
    # libraries again, ~35 CPU s of a suite that is CPU-bound.
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=900, env={**os.environ, **AGENT_ENV}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    view = json.loads(proc.stdout)
    assert view["strategies"]["cpm_menu"]["label"] == "KNEXA-FL (CPM, full menu)"
    assert {"cpm_menu_vs_local_plus", "cpm_menu_vs_cpm_pmix"} <= set(view["comparisons"])
    result = json.loads((out / "results.json").read_text())
    run = result["runs"]["cpm_menu"]["0"]
    menu = {"akd", "akd_logits", "pmix", "svd_hka"}
    assert run["exchanges"] >= 1
    for r in run["rounds"]:
        assert sum(r["protocols"].values()) == len(r["exchanges"])
        assert set(r["protocols"]) <= menu
        for x in r["exchanges"]:
            assert x["protocol"] in menu and math.isfinite(x["reward"])
            assert x["normalised_reward"] is not None
    forced = result["runs"]["cpm_pmix"]["0"]
    assert forced["exchanges"] >= 1
    assert all(set(r["protocols"]) == {"pmix"} for r in forced["rounds"] if r["exchanges"])
    assert {"cpm_menu_overlay_vs_cpm_menu", "cpm_menu_overlay_vs_overlay_topk"} <= set(
        view["comparisons"]
    )
    names = {f"agent-{i}" for i in range(4)}
    for strategy in ("overlay_topk", "cpm_menu_overlay"):
        run = result["runs"][strategy]["0"]
        last: dict[str, list[str]] = {}
        for r in run["rounds"]:
            steps = [x for x in r["exchanges"] if x["protocol"] == "overlay"]
            assert sorted(x["student"] for x in steps) == sorted(names), r
            for x in steps:
                assert len(x["neighbours"]) == 2 and x["student"] not in x["neighbours"], x
                assert set(x["neighbours"]) <= names and x["kilobytes"] > 0, x
                assert x["outcome"] in ("aggregated", "identity", "rolled_back"), x
            if strategy == "cpm_menu_overlay":
                for x in r["exchanges"]:
                    if x["protocol"] == "overlay":
                        continue
                    # What the student reported: its list of the round before (none in 1).
                    assert x["overlay_listed"] == last.get(x["student"], []), (x, last)
                    if x["protocol"] in ("pmix", "svd_hka") and x["overlay_listed"]:
                        assert x["teacher"] in x["overlay_listed"], x
            last = {x["student"]: x["neighbours"] for x in steps}


@pytest.mark.timeout(900)
def test_ffa_lora_keeps_one_frozen_a_and_averages_b_by_data(tmp_path: Path) -> None:
    """FFA-LoRA: its warm-up and local steps leave the family's shared A bit-identical (the
    world seed's initial A), B trains; after a round every client holds that A and the
    data-weighted mean of the clients' B."""
    import torch
    from peerlm.agent import LoraSettings, ModelHost

    from peerlm.app.experiment import ExperimentPlan
    from peerlm.app.experiment_merge import merge_exchange
    from peerlm.app.experiment_run import local_phase
    from peerlm.app.experiment_world import build_clients, prepare_world, warm_up

    plan = ExperimentPlan(
        agents=3, rounds=2, seeds=(0,), size="micro", family="gpt2", strategies=("ffa_lora",),
        local_steps=2, warmup_steps=2, grad_accumulation=1, val_limit=2, max_new_tokens=8,
        probe_per_category=1, transfer_limit=2, test_limit=6,
    )  # fmt: skip
    world = prepare_world(plan, tmp_path / "models", tmp_path / "data", lambda _k, _d: None)
    world.ffa_warm = warm_up(world, lambda _k, _d: None, ffa=True)
    fresh = ModelHost.load(
        tmp_path / "models" / "gpt2", LoraSettings(r=plan.lora_rank), device="cpu",
        seed=plan.world_seed,
    )  # fmt: skip
    shared_a = {k: v for k, v in fresh.adapter_state().items() if ".lora_A." in k}
    clients = build_clients(world, 5, ffa=True)
    assert all(c.host.frozen_lora_a for c in clients)
    for i, c in enumerate(clients):
        local_phase(world, c, 5, i, 1)
    states = [c.host.adapter_state() for c in clients]
    for state in states:
        assert all(torch.equal(state[k], a) for k, a in shared_a.items())
        # Warm-up and local steps trained B (it starts at zero).
        assert any(v.abs().sum() > 0 for k, v in state.items() if ".lora_B." in k)
    records = merge_exchange(world, "ffa_lora", clients, 5, 1)
    assert len(records) == 3 and all(r["kilobytes"] > 0 for r in records)
    sizes = [len(c.train) for c in clients]
    assert len(set(sizes)) > 1  # the weights are not all equal: the test sees them
    for c in clients:
        merged = c.host.adapter_state()
        for k, v in merged.items():
            if ".lora_A." in k:
                assert torch.equal(v, shared_a[k])
            else:
                mean = sum(n * s[k].double() for n, s in zip(sizes, states, strict=True))
                torch.testing.assert_close(v.double(), mean / sum(sizes), rtol=1e-5, atol=1e-7)
    # The common path is unchanged: its clients train A, each from its own seed.
    plain = build_clients(world, 5)
    assert not plain[0].host.frozen_lora_a
    a0, a1 = (
        {k: v for k, v in c.host.adapter_state().items() if ".lora_A." in k} for c in plain[:2]
    )
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)


@pytest.mark.parametrize("strategy", ["onepeft", "ffa_lora"])
def test_merge_strategies_refuse_an_unknown_family(strategy: str) -> None:
    from peerlm.app.experiment import ExperimentPlan

    with pytest.raises(ValueError, match="unknown family"):
        ExperimentPlan(family="llama9", strategies=(strategy,))


@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan"), float("inf"), 2.0])
def test_a_learning_rate_outside_0_1_is_refused(lr: float) -> None:
    from peerlm.app.experiment import ExperimentPlan

    with pytest.raises(ValueError, match="learning_rate"):
        ExperimentPlan(learning_rate=lr)
    assert ExperimentPlan(learning_rate=5e-3).learning_rate == 5e-3


def test_a_negative_warmup_is_refused() -> None:
    from peerlm.app.experiment import ExperimentPlan

    with pytest.raises(ValueError, match="warmup_steps"):
        ExperimentPlan(warmup_steps=-1)


@pytest.mark.timeout(900)
def test_the_warm_up_gives_every_strategy_and_seed_the_same_trained_start(tmp_path: Path) -> None:
    """The clients arrive with adapters tuned on their own data: round 0 is measured on
    them (not on the base models), and every run seed starts from them."""
    from dataclasses import replace

    from peerlm.app.experiment import ExperimentPlan, run_experiment

    plan = ExperimentPlan(
        agents=2, rounds=1, strategies=("local",), seeds=(0, 1), size="micro",
        local_steps=1, transfer_limit=2, val_limit=2, test_limit=24, samples=1,
        max_new_tokens=8, probe_per_category=1, learning_rate=5e-2, warmup_steps=0,
        akd_steps=None,
    )  # fmt: skip
    models = tmp_path / "models"
    cold = run_experiment(plan, models=models, work=tmp_path / "cold")
    warm = run_experiment(replace(plan, warmup_steps=3), models=models, work=tmp_path / "warm")
    assert warm["plan"]["warmup_steps"] == 3
    # The warm-up trained on the clients' own data: their own slice's round-0 NLL fell.
    assert warm["initial_nll"]["own"] < cold["initial_nll"]["own"]
    # Both seeds start from the same warmed-up adapters (their round-0 curves agree).
    curves = [warm["runs"]["local"][s]["curve_nll"] for s in ("0", "1")]
    assert curves[0]["own"][0] == curves[1]["own"][0] == warm["initial_nll"]["own"]


@pytest.mark.timeout(900)
def test_runs_replaying_local_plus_take_its_own_evaluations_and_give_the_same_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The own adapter's evaluations (final samples and their sandbox outcomes, test and
    probe NLL, the curve) come from LocalOnly+'s run of the seed: the records are those of
    computing them again."""
    from peerlm.app.experiment import ExperimentPlan, run_experiment
    from peerlm.app.experiment_world import OwnMemo

    plan = ExperimentPlan(
        agents=3, rounds=2, strategies=("local_plus", "random"), seeds=(0,), size="micro",
        local_steps=1, transfer_limit=4, val_limit=2, test_limit=48, samples=2,
        max_new_tokens=8, probe_per_category=1, learning_rate=5e-2, warmup_steps=2,
        akd_steps=2, curve_every=1, teach_scope="all",
    )  # fmt: skip
    # teach_scope "all": micro teachers are competent in nothing, and an empty package
    # leaves the peer slot empty (nothing routed to it, nothing to merge below).
    models = tmp_path / "models"
    memo = run_experiment(plan, models=models, work=tmp_path / "memo")
    monkeypatch.setattr(OwnMemo, "replay", lambda self: None)
    fresh = run_experiment(plan, models=models, work=tmp_path / "fresh")

    def records(run: dict[str, Any], strategy: str) -> dict[str, Any]:
        seeded = dict(run["runs"][strategy]["0"])
        seeded.pop("seconds"), seeded.pop("cpu_seconds")
        clients = {k: dict(v) for k, v in seeded.pop("clients").items()}
        reused = {k: v.pop("own_reused") for k, v in clients.items()}
        return {"run": seeded, "clients": clients, "reused": reused}

    replayed, computed = records(memo, "random"), records(fresh, "random")
    # Each client's final samples, test NLL and probe NLL, and 2 curve points, reused.
    assert set(replayed["reused"].values()) == {5}
    assert set(computed["reused"].values()) == {0}
    # LocalOnly+'s final test NLL is its last curve point (the same adapter): taken too.
    assert set(records(memo, "local_plus")["reused"].values()) == {1}
    # The peer slot answered some test problems: the merge of reused and computed ran.
    assert sum(sum(c["peer_routed"]) for c in replayed["clients"].values()) > 0
    assert replayed["run"] == computed["run"]
    assert replayed["clients"] == computed["clients"]
    assert memo["summary"] == fresh["summary"]
    # The answer check (own_first, the default): its pass@1 is the record's; every policy
    # agrees where nothing was routed; and where the bank's example is a test, a routed
    # problem never scores below the same own adapter alone (LocalOnly+, same draws).
    alone = memo["runs"]["local_plus"]["0"]["clients"]
    for name, client in replayed["clients"].items():
        checks = client["answer_checks"]
        assert set(checks) == {"off", "own_first", "peer_first"}
        assert checks["own_first"] == client["pass@1"]
        for j, routed in enumerate(client["peer_routed"]):
            if not routed:
                assert {checks[k][j] for k in checks} == {client["pass@1"][j]}
            assert checks["own_first"][j] >= alone[name]["pass@1"][j]
        assert client["answers_from_own"] >= 0


def test_akd_steps_default_to_the_local_steps_and_must_be_positive() -> None:
    from peerlm.app.experiment import ExperimentPlan

    assert ExperimentPlan(local_steps=5, akd_steps=None).integration_steps == 5
    assert ExperimentPlan(local_steps=5, akd_steps=20).integration_steps == 20
    with pytest.raises(ValueError, match="akd_steps"):
        ExperimentPlan(akd_steps=0)


@pytest.mark.timeout(900)
def test_stored_runs_stand_in_for_the_same_plan_and_cpm_settings_rerun_the_cpm(
    tmp_path: Path,
) -> None:
    """``--reuse``: a run of the same plan, world and models is taken as it was stored; a
    CPM run under other CPM settings (here fewer context columns and less exploration) is
    run again, and what the CPM saw each round is recorded."""
    import json

    from peerlm.app.experiment import ExperimentPlan, run_experiment

    small = dict(
        agents=4, rounds=2, seeds=(0,), size="micro", local_steps=1, transfer_limit=2,
        val_limit=2, test_limit=3, samples=1, max_new_tokens=8, probe_per_category=1,
        warmup_steps=0, akd_steps=None,
    )  # fmt: skip
    first = run_experiment(
        ExperimentPlan(strategies=("local_plus", "cpm"), **small),  # type: ignore[arg-type]
        models=tmp_path / "models",
        work=tmp_path / "w",
    )
    stored = json.loads(json.dumps(first))  # as read back from results.json
    plan = ExperimentPlan(
        strategies=("local_plus", "cpm"),
        cpm_context_columns=(8, 9),
        cpm_beta=0.25,
        **small,  # type: ignore[arg-type]
    )
    second = run_experiment(plan, models=tmp_path / "models", work=tmp_path / "w", reuse=[stored])
    assert second["reused"] == ["local_plus:0"]
    assert second["runs"]["local_plus"] == stored["runs"]["local_plus"]
    cpm_rounds = second["runs"]["cpm"]["0"]["rounds"]
    assert all(len(p) == 32 for r in cpm_rounds for p in r["profiles"].values())
    assert second["plan"]["cpm_context_columns"] == (8, 9)


@pytest.mark.timeout(900)
def test_a_killed_command_ends_its_workers_and_keeps_its_finished_runs(tmp_path: Path) -> None:
    """A SIGKILL to ``run-experiment --jobs 2`` (nothing it can catch) ends its spawned
    workers and the events' manager within seconds, instead of leaving them to run their
    strategies on every core; the runs it had finished are in the work directory's
    ``runs-so-far.json``, which the next command takes with ``--reuse``."""
    import signal
    import time

    work = tmp_path / "work"
    common = [
        sys.executable, "-m", "peerlm", "run-experiment", "--quick", "--micro", "--json",
        "-n", "2", "--strategies", "local_plus,random", "--seeds", "0,1", "--rounds", "2",
        "--models-dir", str(tmp_path / "models"), "--work-dir", str(work),
    ]  # fmt: skip
    env = {**os.environ, **AGENT_ENV}
    progress = work / "runs-so-far.json"
    proc = subprocess.Popen(
        [*common, "--out", str(tmp_path / "first"), "--jobs", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 600
        helpers: set[int] = set()
        # The manager and two workers: wait for them, then for the first finished run.
        while time.monotonic() < deadline and proc.poll() is None:
            helpers |= {c for c in children(proc.pid) if "spawn_main" in " ".join(cmdline(c))}
            if len(helpers) >= 3 and progress.exists():
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before a run finished"
        assert len(helpers) >= 3, helpers
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        until = time.monotonic() + 30
        while time.monotonic() < until and any(alive(c) for c in helpers):
            time.sleep(0.2)
        assert not [c for c in helpers if alive(c)], "workers outlived the command"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    saved = json.loads(progress.read_text())
    assert saved["partial"] is True
    kept = sorted(f"{s}:{seed}" for s, runs in saved["runs"].items() for seed in runs)
    assert 1 <= len(kept) < 4, kept
    again = subprocess.run(
        [*common, "--out", str(tmp_path / "second"), "--jobs", "1", "--reuse", str(progress)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads((tmp_path / "second" / "results.json").read_text())
    assert result["reused"] == kept
    assert all(str(seed) in result["runs"][s] for s in ("local_plus", "random") for seed in (0, 1))
    # The second command's own progress file now holds all four.
    assert sum(len(r) for r in json.loads(progress.read_text())["runs"].values()) == 4
