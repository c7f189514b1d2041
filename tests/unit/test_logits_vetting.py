"""Incoming logits packages are vetted through every text they teach with mass."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peerlm.agent.exchange.package import LogitsItem, LogitsPackage
from peerlm.agent.vetting.guardrail import Guardrail
from peerlm.agent.vetting.logits import mass_texts, vet_logits_package, vet_student_package
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from peerlm.metrics import new_registry
from tests.node_contexts import dev_context

HONEST = "return a + b\n"
PAYLOAD = "import socket\n"


@pytest.fixture(scope="module")
def tokenizer(micro_gpt2: Path) -> Any:
    return AutoTokenizer.from_pretrained(micro_gpt2)


def _decode(tokenizer: Any) -> Any:
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


def _item(tokenizer: Any, pid: str, *, hidden: str | None, swap: bool = False) -> LogitsItem:
    """Column 0 spells ``HONEST`` at probability 0.55; column 1 spells ``hidden`` at 0.45
    where it has tokens, a near-zero junk token elsewhere (and everywhere with None).
    ``swap``: the hidden text in column 0's place is what is most likely (0.55)."""
    first = tokenizer.encode(HONEST)
    second = tokenizer.encode(hidden) if hidden is not None else []
    n = max(len(first), len(second))
    first = first + [first[-1]] * (n - len(first))
    ids = np.zeros((n, 2), dtype=np.int32)
    lps = np.full((n, 2), math.log(1e-4), dtype=np.float32)
    ids[:, 0], lps[:, 0] = first, math.log(0.55)
    ids[:, 1] = tokenizer.encode(" x")[0]
    for i, tok in enumerate(second):
        ids[i, 1], lps[i, 1] = tok, math.log(0.45)
        if swap:
            lps[i] = (math.log(0.4), math.log(0.6))
    return LogitsItem(pid, "0" * 64, ids, lps)


def _package(items: list[LogitsItem]) -> LogitsPackage:
    return LogitsPackage("mallory", "d1", "0" * 64, "gpt2", tuple(items), 1.0, "ab" * 32, 1 << 16)


def test_a_payload_in_a_column_with_mass_is_refused_where_column_0_passes(
    tokenizer: Any,
) -> None:
    """Column 0 says ``return a + b``, column 1 at 0.45 (or, most likely, at 0.6) says
    ``import socket``: vetting column 0's text alone (what the student did) lets both
    through; vetting every text with mass refuses them, counted, and keeps the honest item."""
    registry = CollectorRegistry()
    guard = Guardrail([], registry=registry)
    decode = _decode(tokenizer)
    items = [
        _item(tokenizer, "p0", hidden=PAYLOAD),
        _item(tokenizer, "p1", hidden=PAYLOAD, swap=True),
        _item(tokenizer, "p2", hidden=None),
    ]
    column0 = [decode([int(i) for i in it.token_ids[:, 0]]) for it in items]
    assert guard.vet_incoming(column0) == [None, None, None]  # the old check: all pass
    out = vet_logits_package(_package(items), decode, guard.vet_incoming)
    assert [it.prompt_id for it in out.package.items] == ["p2"]
    assert [(pid, reason) for pid, reason in out.refused] == [
        ("p0", "import:socket"),
        ("p1", "import:socket"),
    ]
    assert out.hidden == 2


def test_tokens_below_the_mass_floor_are_not_vetted_as_taught(tokenizer: Any) -> None:
    """A payload at 0.5 % mass is not something the student learns to write: not vetted."""
    item = _item(tokenizer, "p0", hidden=PAYLOAD)
    lps = item.token_ids.astype(np.float32) * 0 + math.log(0.005)
    lps[:, 0] = math.log(0.99)
    texts = mass_texts(item.token_ids, lps, _decode(tokenizer))
    assert len(texts) == 1 and texts[0].startswith(HONEST) and "socket" not in texts[0]


def test_the_students_step_counts_what_column_0_missed(tokenizer: Any) -> None:
    registry = new_registry()
    ctx = dev_context("vetting", "student", registry=registry)
    guard = Guardrail([], registry=registry)
    package = _package(
        [_item(tokenizer, "p0", hidden=PAYLOAD), _item(tokenizer, "p1", hidden=None)]
    )
    kept = vet_student_package(package, tokenizer, guard, ctx)
    assert isinstance(kept, LogitsPackage)
    assert [it.prompt_id for it in kept.items] == ["p1"]
    name = "peerlm_agent_logits_items_refused_total"
    assert registry.get_sample_value(name, {"column": "other"}) == 1
    assert vet_student_package(package, tokenizer, None, ctx) is package
