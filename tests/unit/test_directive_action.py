"""What the agent's round loop does with a directive: the protocol menu, from its side."""

from __future__ import annotations

import pytest
from peerlm.agent.cpm.directives import directive_action, refusal_failure, space_mismatches
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


@pytest.mark.parametrize(
    ("reason", "failure"),
    [
        ("unsupported_protocol", cpm_pb2.EXCHANGE_FAILURE_UNSUPPORTED_PROTOCOL),
        ("tokenizer_mismatch", cpm_pb2.EXCHANGE_FAILURE_PARAMETER_SPACE),
        ("shape", cpm_pb2.EXCHANGE_FAILURE_PARAMETER_SPACE),
        ("lora_config", cpm_pb2.EXCHANGE_FAILURE_PARAMETER_SPACE),
        ("unavailable", cpm_pb2.EXCHANGE_FAILURE_PULL_FAILED),
        ("timeout", cpm_pb2.EXCHANGE_FAILURE_PULL_FAILED),
        ("unverified_sender", cpm_pb2.EXCHANGE_FAILURE_SENDER_PROOF),
        ("corrupt", cpm_pb2.EXCHANGE_FAILURE_INVALID_PAYLOAD),
        ("norm", cpm_pb2.EXCHANGE_FAILURE_INVALID_PAYLOAD),
        ("package", cpm_pb2.EXCHANGE_FAILURE_INVALID_PAYLOAD),
        # The agent's own trouble says nothing about the tuple: not reported.
        ("error", cpm_pb2.EXCHANGE_FAILURE_UNSPECIFIED),
        ("not_integrated", cpm_pb2.EXCHANGE_FAILURE_UNSPECIFIED),
    ],
)
def test_a_refused_directive_is_reported_by_its_reason(
    reason: str, failure: cpm_pb2.ExchangeFailure.ValueType
) -> None:
    assert refusal_failure(reason) == failure


def test_every_reported_failure_is_one_the_cpm_accepts() -> None:
    from peerlm.agent.cpm import directives
    from peerlm.services.cpm.refusals import FAILURE_REASONS

    assert set(directives._REFUSALS.values()) == set(FAILURE_REASONS)


def test_only_senders_whose_adapter_is_of_another_space_are_named_to_the_cpm() -> None:
    """A sender refused for its adapter's spec (backbone, tokenizer, LoRA scaling, tensor
    names or shapes) disproved the fingerprint it declared and is named, once, in order;
    an unreachable, unverified, corrupt, non-finite or over-norm sender proved nothing
    about its space and is not."""
    refusals = [
        ("gone", "unavailable"),
        ("alien", "model_type"),
        ("late", "timeout"),
        ("narrow", "shape"),
        ("nan", "non_finite"),
        ("huge", "norm"),
        ("forged", "unverified_sender"),
        ("scaled", "lora_config"),
        ("alien", "keys"),
        ("other_tok", "tokenizer"),
        ("renamed", "keys"),
        ("logits", "tokenizer_mismatch"),
        ("over", "over_limit"),
    ]
    assert space_mismatches(refusals) == (
        "alien",
        "narrow",
        "scaled",
        "other_tok",
        "renamed",
        "logits",
    )
    assert space_mismatches([("gone", "unavailable"), ("late", "timeout")]) == ()
    assert space_mismatches([]) == ()
