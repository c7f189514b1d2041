"""What the agent's round loop does with a directive: the protocol menu, from its side."""

from __future__ import annotations

import pytest
from peerlm.agent.directives import directive_action
from peerlm.agent.settings import AgentSettings
from peerlm.services.cpm.menu import MENU, MERGE_PROTOCOLS

from peerlm.wire.v1 import cpm_pb2

STUDENT, TEACHER = cpm_pb2.EXCHANGE_ROLE_STUDENT, cpm_pb2.EXCHANGE_ROLE_TEACHER


@pytest.mark.parametrize(
    ("protocol", "role", "action"),
    [
        ("akd", STUDENT, "learn"),
        ("akd_logits", STUDENT, "learn"),
        ("pmix", STUDENT, "merge"),
        ("svd_hka", STUDENT, "merge"),
        ("akd", TEACHER, "teach"),
        ("akd_logits", TEACHER, "teach"),
        ("pmix", TEACHER, "serve_adapter"),
        ("svd_hka", TEACHER, "serve_adapter"),
    ],
)
def test_each_protocol_of_the_menu_is_executed(
    protocol: str, role: cpm_pb2.ExchangeRole.ValueType, action: str
) -> None:
    assert directive_action(protocol, role, MENU, MERGE_PROTOCOLS) == action


@pytest.mark.parametrize("role", [STUDENT, TEACHER])
@pytest.mark.parametrize("protocol", ["svd_hka", "h_ties", "", "x" * 500])
def test_a_protocol_the_agent_does_not_execute_is_refused(
    protocol: str, role: cpm_pb2.ExchangeRole.ValueType
) -> None:
    # An agent without public pairs does not execute svd_hka (AgentSettings resolves it).
    executed = AgentSettings().executed_protocols()
    assert "svd_hka" not in executed
    assert directive_action(protocol, role, executed, MERGE_PROTOCOLS) == "refuse"


def test_a_role_that_is_not_a_pairing_is_refused() -> None:
    for role in (cpm_pb2.EXCHANGE_ROLE_UNSPECIFIED, cpm_pb2.EXCHANGE_ROLE_UNMATCHED, 99):
        assert directive_action("akd", role, MENU, MERGE_PROTOCOLS) == "refuse"  # type: ignore[arg-type]
