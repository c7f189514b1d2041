"""The agent's exchange protocols: one per catalogue entry, dispatched by name, each step
given one context (peerlm.agent.exchange.protocol)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from peerlm.agent.exchange.protocol import ExchangeProtocol, ProtocolRegistry
from peerlm.agent.exchange.registry import agent_registry

from peerlm.protocols import CATALOGUE, UnknownProtocolError, lookup
from peerlm.wire.v1 import cpm_pb2


def test_every_catalogue_entry_has_exactly_one_implementation() -> None:
    registry = agent_registry()
    assert list(registry) == [e.name for e in CATALOGUE]
    for entry in CATALOGUE:
        assert registry.get_protocol(entry.name).entry is entry


def test_unknown_and_unimplemented_names_are_refused() -> None:
    registry = agent_registry()
    with pytest.raises(UnknownProtocolError):
        registry.get_protocol("nope")
    partial = ProtocolRegistry(registry[e.name] for e in CATALOGUE[:1])
    with pytest.raises(KeyError, match="no implementation"):
        partial.get_protocol(CATALOGUE[-1].name)


def test_a_protocol_registers_once_and_with_its_catalogue_entry() -> None:
    registry = agent_registry()
    first = registry[CATALOGUE[0].name]
    with pytest.raises(ValueError, match="twice"):
        ProtocolRegistry([first, first])
    impostor = type(first)(SimpleNamespace(**{**vars(first.entry)}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="another entry"):
        ProtocolRegistry([impostor])


class _Teacher:
    """A context that records the teacher steps' calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def prebuild_predictions(self, d: cpm_pb2.Directive) -> None:
        self.calls.append(("prebuild", d.directive_id))

    def expect_adapter_pull(self, student: str) -> None:
        self.calls.append(("pull", student))


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
def test_the_teacher_step_follows_the_payload(entry: Any) -> None:
    """A package protocol prebuilds the predictions; an adapter protocol only waits for
    the student's pull."""
    protocol: ExchangeProtocol = agent_registry()[entry.name]
    ctx = _Teacher()
    d = cpm_pb2.Directive(directive_id="d" * 32, protocol=entry.name, student="s")
    protocol.teacher(ctx, d, 1)  # type: ignore[arg-type]
    expected = ("pull", "s") if lookup(entry.name).payload == "adapter" else ("prebuild", "d" * 32)
    assert ctx.calls == [expected]
