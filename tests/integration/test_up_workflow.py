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
    routers and its neighbours' VCLayers, nothing missing or refused."""
    state = tmp_path / "fed"
    out = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--workflow", "--micro", "-r", "2", "--json",
         "--state-dir", str(state)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 2
    assert result["fedwave"] == {"rounds_same_router": 2, "rounds_played": 2}
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
    # The middle stage pulls both neighbours' VCLayers, the ends one each (3 pulls each).
    assert agents["implement-0"]["fedwave"]["parts_pulled"]["vclayer"] == 6
    assert agents["specify-0"]["fedwave"]["parts_pulled"]["vclayer"] == 3
    assert agents["test-0"]["fedwave"]["parts_pulled"]["vclayer"] == 3
    digests = {tuple(a["fedwave"]["router_sha256"]) for a in agents.values()}
    assert len(digests) == 1
    config = json.loads((state / "agents" / "implement-0.yaml").read_text())
    assert sorted(config["fedwave"]["peers"]) == sorted(agents)
    assert config["fedwave"]["stage"] == "implement"
