"""`peerlm up --workflow`'s report: router agreement across agents, the per-stage rows, and
each agent's round read from its JSON log."""

from __future__ import annotations

import json
from pathlib import Path

from peerlm.app.devfed_workflow import LogRounds, router_agreement, stage_scores, workflow_rows


def report(name: str, stage: str, digests: list[str], **extra: object) -> dict[str, object]:
    fedwave = {
        "stage": stage,
        "rounds": len(digests),
        "router_sha256": digests,
        "parts_pulled": {"router": 4, "vclayer": 2, "adapter": 2},
        "parts_missing": {"late": 1},
        "parts_rejected": {},
        "heldout_before": 2.5,
        "heldout_after": 1.25,
        "bytes_sent": {"router": 3072, "vclayer": 2048},
        "bytes_received": {"router": 10240},
        "scores": {
            "expert_before": {"meteor": 1.0, "rougeL": 2.0},
            "expert_after": {"meteor": 10.25, "rougeL": 12.0},
            "pi_sft": {"meteor": 8.0, "rougeL": 9.0},
            "pi_sft_dpo": {"meteor": 7.5, "rougeL": 9.5},
        },
        "assembly": {"missing_stages": ["implement"], "dpo_informative": 5},
    }
    return {"name": name, "errors": [], "fedwave": {**fedwave, **extra}}


def test_agreement_counts_the_rounds_in_which_every_agent_had_the_same_router() -> None:
    same = [report("a", "specify", ["x", "y", "z"]), report("b", "test", ["x", "y", "z"])]
    assert router_agreement(same) == (3, 3)
    split = [report("a", "specify", ["x", "y", "z"]), report("b", "test", ["x", "q"])]
    assert router_agreement(split) == (1, 2)  # round 2 differs, round 3 not played by b
    assert router_agreement([]) == (0, 0)


def test_one_row_per_stage_with_pulls_and_losses() -> None:
    rows = workflow_rows({"agents": [report("a", "specify", ["x"]), report("b", "test", ["x"])]})
    assert [r["stage"] for r in rows] == ["specify", "test"]
    assert rows[0]["same router"] == "1/1 rounds"
    assert rows[0]["pulled r/vc/a"] == "4/2/2" and rows[0]["missing"] == "1"
    assert rows[0]["held-out loss"] == "2.500→1.250"
    assert rows[0]["KiB out/in"] == "5/10"
    assert rows[0]["METEOR expert"] == "1.0→10.2"
    assert (rows[0]["METEOR π_SFT"], rows[0]["METEOR +DPO"]) == ("8.0", "7.5")
    assert rows[0]["no expert"] == "implement"
    no_loss = workflow_rows(
        {"agents": [report("a", "s", [], heldout_after=None, scores={}, assembly={})]}
    )
    assert no_loss[0]["held-out loss"] == "2.500→-"
    assert no_loss[0]["METEOR π_SFT"] == "-" and no_loss[0]["no expert"] == "-"


def test_json_carries_every_models_scores_per_stage() -> None:
    stages = stage_scores([report("a", "specify", ["x"]), report("b", "test", ["x"], scores={})])
    assert stages["specify"]["pi_sft_dpo"] == {"meteor": 7.5, "rougeL": 9.5}
    assert stages["specify"]["missing_stages"] == ["implement"]
    assert stages["specify"]["dpo_pairs"] == 5
    assert stages["test"]["pi_sft"] is None


def test_log_rounds_reads_new_complete_lines_only(tmp_path: Path) -> None:
    rounds = LogRounds(tmp_path, "fedwave_round_done")
    assert rounds("a") == 0  # no log yet
    log = tmp_path / "a.log"
    log.write_text(
        json.dumps({"event": "fedwave_round_done", "round": 1}) + "\n" + "not json\n"
        + json.dumps({"event": "other", "round": 9}) + "\n"
    )  # fmt: skip
    assert rounds("a") == 1
    with log.open("a") as handle:
        handle.write(json.dumps({"event": "fedwave_round_done", "round": 2}))  # no newline yet
    assert rounds("a") == 1
    with log.open("a") as handle:
        handle.write("\n")
    assert rounds("a") == 2


def test_log_rounds_follows_several_events(tmp_path: Path) -> None:
    """`up --fedproxy` reads the owner's merged rounds and the members' trained ones."""
    rounds = LogRounds(tmp_path, ("fedproxy_round_merged", "fedproxy_update_ready"))
    (tmp_path / "owner.log").write_text(
        json.dumps({"event": "fedproxy_round_merged", "round": 2}) + "\n"
        + json.dumps({"event": "fedproxy_round_published", "round": 3}) + "\n"
    )  # fmt: skip
    (tmp_path / "m.log").write_text(
        json.dumps({"event": "fedproxy_update_ready", "round": 1}) + "\n"
    )
    assert (rounds("owner"), rounds("m")) == (2, 1)


def test_log_rounds_of_a_resumed_run_skip_the_last_runs_lines(tmp_path: Path) -> None:
    """`up --workflow --resume` appends to the last run's logs: its rounds are not this
    run's progress."""
    log = tmp_path / "a.log"
    log.write_text(json.dumps({"event": "fedwave_round_done", "round": 4}) + "\n")
    rounds = LogRounds(tmp_path, "fedwave_round_done", from_end=True)
    assert (rounds("a"), rounds("fresh")) == (0, 0)
    with log.open("a") as handle:
        handle.write(json.dumps({"event": "fedwave_round_done", "round": 3}) + "\n")
    assert rounds("a") == 3
    assert LogRounds(tmp_path / "none", "fedwave_round_done", from_end=True)("a") == 0
