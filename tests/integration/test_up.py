"""`peerlm up`: a dev CA, a CPM and agents as separate processes, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _up(state: Path, *flags: str, timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--json", "--state-dir", str(state), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_up_with_simulated_agents(tmp_path: Path) -> None:
    state = tmp_path / "fed"
    result = _up(state, "--simulated", "-n", "4", "-r", "3")
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 3
    assert len(result["agents"]) == 4 and all(not a["errors"] for a in result["agents"])
    # Four agents, K_p = 2 pairs per round, 3 rounds: every student reported its reward (on
    # a loaded machine a round may be matched before every agent submitted: 2 at least).
    assert result["rewards_observed"] == result["rewards_reported"] >= 2
    assert (state / "pki" / "ca.crt").exists() and (state / "cpm.db").exists()
    logs = (state / "logs" / "cpm.log").read_text()
    assert '"security_mode"' in logs and "mtls" in logs


def test_up_per_student_makes_every_agent_a_student_each_round(tmp_path: Path) -> None:
    """``--pairing per_student``: the CPM gives each agent a teacher every round, so the
    rewards exceed what disjoint pairs allow (N/2 a round); each agent acts on all of a
    round's directives (as teacher and as student) and reports every one it learnt from."""
    result = _up(tmp_path / "fed", "--simulated", "-n", "4", "-r", "3", "--pairing", "per_student")
    assert result["rounds_completed"] == 3
    agents = result["agents"]
    assert all(not a["errors"] for a in agents), [a["errors"] for a in agents]
    assert result["rewards_observed"] == result["rewards_reported"] > 2 * 3
    assert sum(a["as_student"] for a in agents) == result["rewards_reported"]
    assert sum(a["as_teacher"] for a in agents) == result["rewards_reported"]


def test_up_gives_every_student_two_teachers_a_round(tmp_path: Path) -> None:
    """``--teachers-per-student 2``: the CPM gives each of four agents two teachers a round
    (eight directives), and each agent learns from both and reports both rewards."""
    result = _up(
        tmp_path / "fed", "--simulated", "-n", "4", "-r", "3", "--pairing", "per_student",
        "--teachers-per-student", "2",
    )  # fmt: skip
    assert result["rounds_completed"] == 3
    agents = result["agents"]
    assert all(not a["errors"] for a in agents), [a["errors"] for a in agents]
    assert result["rewards_observed"] == result["rewards_reported"]
    assert sum(a["as_student"] for a in agents) == result["rewards_reported"]
    # More lessons than rounds for someone: two teachers in a round (a loaded machine may
    # match a round before every agent submitted, so not every round has them).
    assert max(a["as_student"] for a in agents) > 3


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--pairing", "all"], "--pairing"),
        (["--teachers-per-student", "2"], "--teachers-per-student"),
        (["--pairing", "per_student", "--teachers-per-student", "17"], "--teachers-per-student"),
    ],
)
def test_up_refuses_an_unknown_pairing(tmp_path: Path, args: list[str], named: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "peerlm", "up", "--simulated", "--state-dir", str(tmp_path),
         *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and named in out.stderr
    assert not (tmp_path / "cpm.db").exists()  # refused before anything was touched


def test_up_with_model_hosting_agents(tmp_path: Path) -> None:
    """Micro models of four architectures, Dirichlet data, AKD over mTLS, rewards to the CPM."""
    state = tmp_path / "fed"
    result = _up(state, "--micro", "-n", "4", "-r", "2")
    assert result["cpm_exit_code"] == 0
    assert result["rounds_completed"] == 2
    agents = result["agents"]
    assert [a["name"] for a in agents] == [f"agent-{i}" for i in range(4)]
    assert {Path(a["model"]).name for a in agents} == {"gpt2", "gpt_neox", "bloom", "qwen2"}
    for a in agents:
        for key in ("pass_at_1_before", "pass_at_1_after", "exchanges", "bytes_sent",
                    "bytes_received", "loss_before", "loss_after"):  # fmt: skip
            assert key in a, key
        assert not a["errors"], a["errors"]
        # Held-out test problems of the skills it holds and of those it lacks (the world:
        # four private categories, one expert each), before the first and after the last round.
        for when in ("slices_before", "slices_after"):
            assert set(a[when]) >= {"own", "lacked"}, a[when]
            for figures in a[when].values():
                assert 0 <= figures["pass1"] <= 1 and 0 <= figures["struct"] <= 1
                assert figures["nll"] > 0 and figures["n"] >= 1
                # integration: separate: the share the router sent to the peer slot.
                assert 0 <= figures["peer_share"] <= 1
                # answer_check own_first: a routed answer may be the own adapter's.
                routed = round(figures["peer_share"] * figures["n"])
                assert 0 <= figures["own_answers"] <= routed
        assert a["peer_slot_integrations"] >= a["exchanges"]
    assert result["rewards_reported"] >= 2
    assert result["rewards_observed"] == result["rewards_reported"]
    assert sum(a["bytes_sent"] for a in agents) > 0
    assert sum(a["bytes_received"] for a in agents) == sum(a["bytes_sent"] for a in agents)
    # Every agent checkpointed every round.
    for a in agents:
        assert (state / "agents" / a["name"] / "checkpoints").exists()
        # Its rewards were measured on the public probe (`--reward probe`, the default).
        config = json.loads((state / "agents" / f"{a['name']}.yaml").read_text())
        assert len(Path(config["reward_file"]).read_text().splitlines()) == 24


def test_up_with_a_merge_menu_on_one_family(tmp_path: Path) -> None:
    """``--protocols pmix --family gpt2``: every exchange is a merge directive executed by
    the agents, each reward committed by the CPM; adapter bytes pulled equal those served."""
    state = tmp_path / "fed"
    result = _up(state, "--micro", "-n", "2", "-r", "2", "--family", "gpt2", "--protocols", "pmix")
    assert result["cpm_exit_code"] == 0 and result["rounds_completed"] == 2
    agents = result["agents"]
    assert all(not a["errors"] for a in agents), [a["errors"] for a in agents]
    merges = sum(a["merges_by_protocol"].get("pmix", 0) for a in agents)
    assert merges >= 1 and merges == sum(a["exchanges"] for a in agents)
    assert result["rewards_observed"] == result["rewards_reported"] == merges
    assert sum(a["bytes_sent"] for a in agents) == 0  # no knowledge package at all
    received = sum(a["overlay_bytes_received"] for a in agents)
    assert received > 0 and received == sum(a["overlay_bytes_sent"] for a in agents)
