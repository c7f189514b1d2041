"""The agent's ``fedwave:`` section: a workflow, this agent's stage, the exchange's bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.settings import AgentSettings

from peerlm.config import ConfigError, load_settings

WORKFLOW = {
    "stages": [
        {"name": "specify", "agents": ["a1", "a2"]},
        {"name": "implement", "agents": ["a3"]},
        {"name": "test", "agents": ["a4"]},
    ]
}
YAML = """\
insecure_dev: true
fedwave:
  workflow:
    stages:
      - {name: specify, agents: [a1, a2]}
      - {name: implement, agents: [a3]}
      - {name: test, agents: [a4]}
  stage: implement
  round_deadline_s: 12.5
  max_router_bytes: 65536
  peers: {a1: "10.0.0.1:7001", a4: "[::1]:7004"}
"""


def test_an_agent_configuration_holds_its_workflow(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(YAML)
    s = load_settings(AgentSettings, path)
    fw = s.fedwave
    assert fw.enabled and fw.workflow is not None
    assert fw.workflow.stage_names == ("specify", "implement", "test")
    assert (fw.stage, fw.round_deadline_s, fw.max_router_bytes) == ("implement", 12.5, 65536)
    assert fw.max_vclayer_bytes is None
    assert fw.peers == {"a1": "10.0.0.1:7001", "a4": "[::1]:7004"}
    assert fw.member_stage("a3") == 1
    assert not AgentSettings().fedwave.enabled


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stage": "implement"}, "no fedwave.workflow"),
        ({"workflow": WORKFLOW, "stage": "review"}, "not a stage of the workflow"),
        (
            {"workflow": {"stages": [{"name": "a", "agents": ["x"]}, {"name": "b", "agents": []}]}},
            "at least 1 item",
        ),
        (
            {
                "workflow": {
                    "stages": [{"name": "a", "agents": ["x"]}, {"name": "b", "agents": ["x"]}]
                }
            },
            "serves stages 'a' and 'b'",
        ),
        ({"workflow": {"stages": [{"name": "a", "agents": ["x"]}]}}, "at least 2 items"),
        ({"workflow": WORKFLOW, "round_deadline_s": 0}, "greater than 0"),
        ({"workflow": WORKFLOW, "max_vclayer_bytes": 10}, "greater than or equal to 1024"),
        ({"workflow": WORKFLOW, "router": {"top_k": 4}}, "exceeds the workflow"),
        ({"peers": {"a1": "127.0.0.1:5000"}}, "fedwave.peers is set but no fedwave.workflow"),
        ({"workflow": WORKFLOW, "peers": {"zz": "127.0.0.1:5000"}}, "names 'zz', not agents"),
        (
            {"workflow": WORKFLOW, "peers": {"a1": "127.0.0.1"}},
            r"peers\['a1'\]: expected HOST:PORT",
        ),
        ({"workflow": WORKFLOW, "peers": {"a1": "h:70000"}}, "out of range"),
        ({"workflow": WORKFLOW, "peers": {"a1": "h:x"}}, "not a number"),
        ({"workflow": WORKFLOW, "peers": {"a1": "h:0"}}, "port 0 in 'h:0' is not an endpoint"),
    ],
)
def test_a_bad_section_is_refused_with_the_reason(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(AgentSettings, overrides={"fedwave": section, "insecure_dev": True})


def test_the_agent_must_be_in_the_stage_it_claims() -> None:
    fw = FedWaveSettings.model_validate({"workflow": WORKFLOW, "stage": "specify"})
    assert fw.member_stage("a2") == 0
    with pytest.raises(ValueError, match=r"lists this agent \('a3'\) in stage 'implement'"):
        fw.member_stage("a3")
    with pytest.raises(ValueError, match="not listed in any stage"):
        fw.member_stage("stranger")
    with pytest.raises(ValueError, match="not configured"):
        FedWaveSettings().member_stage("a1")


def test_loading_the_agent_settings_loads_no_torch() -> None:
    # ``peerlm health`` (the container HEALTHCHECK) reads the agent's configuration.
    code = (
        "import sys; from peerlm.agent.settings import AgentSettings; "
        "AgentSettings.model_validate({'fedwave': {'workflow': " + repr(WORKFLOW) + "}}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
