"""FedSA-LoRA as a merge protocol (peerlm.agent.merging.fedsa): only the LoRA A factors are
averaged, B stays the student's own; end to end through the agent's adapter aggregation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peerlm.agent.merging.fedsa import fedsa_update
from peerlm.agent.merging.pull_aggregate import PullSettings, integrate_adapters
from peerlm.agent.modelhost import LoraSettings, ModelHost
from peerlm.overlay import AggregationError

from peerlm.protocols import FEDSA, lookup

A, B = "m.lora_A.weight", "m.lora_B.weight"


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {A: torch.randn(4, 6, generator=g), B: torch.randn(6, 4, generator=g)}


def test_the_entry_is_an_off_by_default_merge() -> None:
    entry = lookup(FEDSA.name)
    assert entry.is_merge and entry.payload == "adapter" and not entry.on_by_default


def test_a_is_the_mean_of_all_participants_and_b_stays_own() -> None:
    own, n1, n2 = _adapter(0), _adapter(1), _adapter(2)
    before = {k: v.clone() for k, v in own.items()}
    updated, report = fedsa_update(own, {"n1": n1, "n2": n2}, "me")
    torch.testing.assert_close(updated[A], (own[A] + n1[A] + n2[A]) / 3)
    assert torch.equal(updated[B], own[B])
    assert all(torch.equal(own[k], before[k]) for k in own)  # the input is not modified
    assert report.accepted == ("n1", "n2")
    assert report.weights == pytest.approx({"me": 1 / 3, "n1": 1 / 3, "n2": 1 / 3})
    expected = float(torch.linalg.vector_norm((updated[A] - own[A]).double()))
    assert report.delta_norm == pytest.approx(expected)


def test_an_unusable_sender_is_refused_and_the_others_merged() -> None:
    own, good = _adapter(0), _adapter(1)
    wrong_shape = {A: torch.zeros(3, 6), B: torch.zeros(6, 3)}
    non_finite = {A: torch.full((4, 6), float("nan")), B: torch.zeros(6, 4)}
    updated, report = fedsa_update(own, {"g": good, "s": wrong_shape, "x": non_finite}, "me")
    assert report.accepted == ("g",)
    assert {r.peer: r.reason for r in report.refused} == {"s": "shape", "x": "non_finite"}
    torch.testing.assert_close(updated[A], (own[A] + good[A]) / 2)


def test_no_usable_sender_leaves_the_adapter_unchanged() -> None:
    own = _adapter(0)
    updated, report = fedsa_update(own, {"me": _adapter(1)}, "me")
    assert report.identity and not report.accepted
    assert all(torch.equal(updated[k], own[k]) for k in own)
    with pytest.raises(AggregationError, match="no LoRA A"):
        fedsa_update({B: own[B]}, {}, "me")


def test_through_the_agents_aggregation_on_a_micro_model(micro_gpt2: Path) -> None:
    """The merge path an agent runs for a ``fedsa`` directive or overlay pull
    (``integrate_adapters`` with ``method=fedsa``): the host's A factors become the mean,
    its B factors do not move."""
    student = ModelHost.load(micro_gpt2, LoraSettings(r=4), device="cpu", seed=0)
    sender = ModelHost.load(micro_gpt2, LoraSettings(r=4), device="cpu", seed=1)
    own = student.adapter_state()
    theirs = {k: v + 0.5 for k, v in sender.adapter_state().items()}
    report, verdict, _ = integrate_adapters(
        student, {"s": theirs}, {"s": 1.0}, PullSettings(method=FEDSA.name), "me"
    )
    assert report.accepted == ("s",) and verdict is None
    after = student.adapter_state()
    for name, tensor in own.items():
        if name.endswith(".lora_A.weight"):
            torch.testing.assert_close(after[name], (tensor + theirs[name]) / 2)
        else:
            assert torch.equal(after[name], tensor), name
