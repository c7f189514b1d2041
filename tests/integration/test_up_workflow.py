"""`peerlm up --workflow`: a FedWave value chain of real agent processes, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_workflow_runs_the_code_chain_with_one_router(tmp_path: Path) -> None:
    """Three micro-model experts (specify → implement → test) play two FedWave rounds over
    mTLS: every agent ends each round with the same router bits, each pulled the others'
    routers and its neighbours' VCLayers, nothing missing or refused. Then each pulls the
    other two stages' experts (adapter and VCLayer), assembles π_SFT, runs the DPO phase
    and scores the expert before and after the rounds, π_SFT and π_SFT after DPO."""
    state = tmp_path / "fed"
    out = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--workflow", "--micro", "-r", "2", "--json",
         "--state-dir", str(state)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 2
    fedwave = result["fedwave"]
    assert (fedwave["rounds_same_router"], fedwave["rounds_played"]) == (2, 2)
    agents = {a["name"]: a for a in result["agents"]}
    assert sorted(agents) == ["implement-0", "specify-0", "test-0"]
    for name, a in agents.items():
        fw = a["fedwave"]
        assert not a["errors"], a["errors"]
        assert fw["stage"] == name.removesuffix("-0")
        assert fw["rounds"] == 2 and fw["members"] == [3, 3]
        assert fw["parts_missing"] == {} and fw["parts_rejected"] == {}
        # Rounds 0, 1 and 2: the two other agents' routers each time.
        assert fw["parts_pulled"]["router"] == 6
        assert fw["heldout_before"] > 0 and fw["heldout_after"] > 0
        # π_SFT: the two other stages' adapters arrived and every stage has its expert.
        assert fw["parts_pulled"]["adapter"] == 2
        assembly = fw["assembly"]
        assert assembly["outcome"] == "complete" and assembly["missing_stages"] == []
        assert assembly["experts"] == {a["fedwave"]["stage"]: n for n, a in agents.items()}
        # 4 public requirements, each starting a chain of 3 prompts: 12 router-made pairs.
        assert assembly["dpo_pairs"] == 12
        models = {"expert_before", "expert_after", "pi_sft"}
        if assembly["dpo_informative"]:
            models.add("pi_sft_dpo")
            assert len(assembly["dpo_losses"]) == 8  # the experiment's default DPO steps
        assert set(fw["scores"]) == models
        assert fedwave["stages"][fw["stage"]]["pi_sft"] == fw["scores"]["pi_sft"]
    # The middle stage pulls both neighbours' VCLayers, the ends one each (3 pulls each);
    # then every agent the two other stages' VCLayers for π_SFT.
    assert agents["implement-0"]["fedwave"]["parts_pulled"]["vclayer"] == 6 + 2
    assert agents["specify-0"]["fedwave"]["parts_pulled"]["vclayer"] == 3 + 2
    assert agents["test-0"]["fedwave"]["parts_pulled"]["vclayer"] == 3 + 2
    digests = {tuple(a["fedwave"]["router_sha256"]) for a in agents.values()}
    assert len(digests) == 1
    config = json.loads((state / "agents" / "implement-0.yaml").read_text())
    assert sorted(config["fedwave"]["peers"]) == sorted(agents)
    assert config["fedwave"]["stage"] == "implement"

    # `--resume` with one more round: every expert restores its round-2 checkpoint, the
    # three agree on round 3 (restarted together), play it with all three routers, and
    # assemble π_SFT again; the reports go on from the checkpoints.
    again = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--workflow", "--micro", "-r", "3", "--resume",
         "--json", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = {a["name"]: a for a in json.loads(again.stdout)["agents"]}
    for name, a in resumed.items():
        fw = a["fedwave"]
        assert not a["errors"], a["errors"]
        assert (fw["rounds"], fw["resumed_from"], fw["rounds_skipped"]) == (3, 2, 0), fw
        assert fw["rolled_back_from"] is None and fw["members"] == [3, 3, 3], fw
        assert fw["router_sha256"][:2] == agents[name]["fedwave"]["router_sha256"]
        assert fw["assembly"]["outcome"] == "complete"
        log = (state / "logs" / f"{name}.log").read_text().splitlines()
        rejoined = [json.loads(line) for line in log if '"fedwave_rejoined"' in line]
        # Restarted together; on a loaded machine an agent that starts last may find the
        # others already playing round 3 and join it running: the same round either way.
        assert [e["next_round"] for e in rejoined] == [3], rejoined
        assert rejoined[0]["mode"] in ("together", "running"), rejoined
    assert len({tuple(a["fedwave"]["router_sha256"]) for a in resumed.values()}) == 1
