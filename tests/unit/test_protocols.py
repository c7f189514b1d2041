"""The kernel's protocol catalogue (peerlm.protocols): entries, look-ups, and that no
product module spells a protocol name outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from peerlm.protocols import (
    CATALOGUE,
    DEFAULT_OVERLAY_AGGREGATION,
    DEFAULT_PROTOCOL,
    UnknownProtocolError,
    check_names,
    lookup,
    names,
)

ROOT = Path(__file__).resolve().parents[2]
#: The product's source folders (tests, docs and generated wire code aside).
PRODUCT = ("agent", "services", "peerlm", "overlay", "bench")


def test_entries_are_unique_frozen_and_consistent() -> None:
    assert len({e.name for e in CATALOGUE}) == len(CATALOGUE)
    for entry in CATALOGUE:
        assert lookup(entry.name) is entry
        # Only a merge moves an adapter and may name co-senders or aggregate overlay pulls.
        assert entry.is_merge == (entry.payload == "adapter")
        assert not entry.co_senders or entry.is_merge
        assert not entry.overlay_aggregation or entry.is_merge
        # A merge needs one parameter space: the student loads the sender's tensors.
        assert not entry.is_merge or entry.same_space
        assert entry.paper and entry.summary
    with pytest.raises(AttributeError):
        CATALOGUE[0].name = "other"  # type: ignore[misc]


def test_defaults_are_entries() -> None:
    assert lookup(DEFAULT_PROTOCOL).admissibility == "any_pair"
    assert lookup(DEFAULT_OVERLAY_AGGREGATION).overlay_aggregation


def test_names_filter_by_attribute_in_menu_order() -> None:
    assert names() == tuple(e.name for e in CATALOGUE)
    merges = names(kind="merge")
    assert merges and all(lookup(n).is_merge for n in merges)
    assert set(merges) | set(names(kind="distillation")) == set(names())
    assert names(kind="merge", needs_public_pairs=True) == tuple(
        e.name for e in CATALOGUE if e.is_merge and e.needs_public_pairs
    )


def test_the_defaults_offer_what_is_on_by_default() -> None:
    """An agent that names no protocols executes those on by default (those needing
    public pairs only with them); the experiment's full menu is the same set."""
    from peerlm.agent import AgentSettings

    from peerlm.app.experiment import CPM_PROTOCOLS

    on = names(on_by_default=True)
    assert DEFAULT_PROTOCOL in on
    assert CPM_PROTOCOLS["cpm_menu"] == on
    assert AgentSettings().executed_protocols() == names(
        on_by_default=True, needs_public_pairs=False
    )
    assert AgentSettings(public_file=Path("p.jsonl")).executed_protocols() == on


def test_unknown_names_raise_a_clear_error() -> None:
    with pytest.raises(UnknownProtocolError, match=r"unknown protocol 'nope'.*holds"):
        lookup("nope")
    with pytest.raises(ValueError, match="unknown protocol"):
        check_names([DEFAULT_PROTOCOL, "nope"])
    with pytest.raises(ValueError, match="must not repeat"):
        check_names([DEFAULT_PROTOCOL, DEFAULT_PROTOCOL])
    assert check_names(names()) == names()


def _string_constants(path: Path) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_product_module_spells_a_protocol_name() -> None:
    """A string constant equal to a protocol name exists only in the catalogue: everything
    else reads entries (docstrings and comments may still name protocols for the reader)."""
    spelled = set(names())
    catalogue = ROOT / "peerlm" / "protocols.py"
    offending = []
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            if path == catalogue or "wire" in path.relative_to(ROOT).parts:
                continue
            for line, value in _string_constants(path):
                if value in spelled:
                    offending.append(f"{path.relative_to(ROOT)}:{line} {value!r}")
    assert not offending, offending
