"""`peerlm up --overlay`: model-hosting agents are overlay nodes and pull their neighbours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


#: The overlay's first build, seconds after ``up`` writes the configurations
#: (``--overlay-startup``; the command's default, 120, is sized for four tiny models beside
#: other work). Four micro gpt2 agents joined within 33 s in a loaded CI run when each
#: imported its libraries; forked from ``up``'s fork server they joined within 11 s on an
#: idle machine (2026-12-06), so 30 keeps a threefold margin. Every test below checks that
#: each agent was placed (``overlay_ready``) before its first round.
STARTUP_S = 30


def _up_overlay(state: Path, *flags: str) -> dict[str, Any]:
    """``peerlm up --overlay`` of four micro gpt2 agents for three rounds; its JSON report,
    after checking that it succeeded and the CPM ran every round."""
    out = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--json", "--state-dir", str(state),
         "--micro", "--overlay", "--overlay-startup", str(STARTUP_S), "--family", "gpt2",
         "-n", "4", "-r", "3", *flags],
        capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 3
    return result


# Three rounds of four micro agents after the overlay's genesis wait (STARTUP_S idle),
# more than the default 300 s timeout on a loaded machine. The federations run
# one after another on purpose: started together on two loaded cores, two of the three found
# no overlay candidates in any round (their agents' steps all ``no_candidates``).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("aggregation", ["pmix", "svd_hka"])
def test_up_overlay_agents_pull_same_family_adapters(tmp_path: Path, aggregation: str) -> None:
    """SemanticDFL's personalised mixing, and OnePeFT's SVD + HKA on the same pulls."""
    state = tmp_path / "fed"
    result = _up_overlay(state, "--aggregation", aggregation)
    agents = result["agents"]
    assert {Path(a["model"]).name for a in agents} == {"gpt2"}
    names = {a["name"] for a in agents}
    for a in agents:
        assert not a["errors"], a["errors"]
        assert sum(a["overlay_steps"].values()) == 3  # one overlay step per round
        assert a["name"] not in a["overlay_neighbours"]
        assert set(a["overlay_neighbours"]) <= names
    assert any(a["adapters_pulled"] >= 1 for a in agents)
    assert result["adapters_pulled"] == sum(a["adapters_pulled"] for a in agents)
    logs = [(state / "logs" / f"{name}.log").read_text() for name in sorted(names)]
    # Every agent waited for the overlay's first build before its first round.
    assert all('"overlay_ready"' in log for log in logs)
    assert all(not a["overlay_steps"].get("query_refused") for a in agents)
    assert any('"outcome": "applied"' in log or "overlay_aggregated" in log for log in logs)
    config = json.loads((state / "agents" / "agent-1.yaml").read_text())
    assert config["overlay"]["aggregation"] == aggregation
    public = (state / "data" / "public_pairs.jsonl").read_text().splitlines()
    assert public and config["public_file"].endswith("public_pairs.jsonl")
    assert config["overlay"]["aggregate_once"] is False
    assert all(a["one_shot_round"] is None for a in agents)


@pytest.mark.timeout(900)
def test_up_overlay_one_shot_agents_aggregate_once_then_only_publish(tmp_path: Path) -> None:
    """OnePeFT's one-shot mode (``--one-shot``, overlay.aggregate_once): an agent pulls and
    aggregates by SVD + HKA until one step has aggregated; after it, every step only
    publishes its signature (``published``), so it pulls from at most one step's k peers."""
    state = tmp_path / "fed"
    agents = _up_overlay(state, "--aggregation", "svd_hka", "--one-shot")["agents"]
    config = json.loads((state / "agents" / "agent-1.yaml").read_text())
    assert config["overlay"]["aggregate_once"] is True
    shot = [a for a in agents if a["one_shot_round"] is not None]
    assert shot, [a["overlay_steps"] for a in agents]
    for a in agents:
        assert not a["errors"], a["errors"]
        steps = a["overlay_steps"]
        assert sum(steps.values()) == 3
        assert steps.get("aggregated", 0) <= 1, steps
        if a["one_shot_round"] is None:
            assert not steps.get("published"), steps
            continue
        # After its shot an agent only publishes: one per remaining round.
        assert steps.get("published", 0) == 3 - a["one_shot_round"], steps
        assert steps["aggregated"] == 1
        assert a["adapters_pulled"] <= config["overlay"]["k"] * a["one_shot_round"]
