"""The experiment executes a pairing's directive by the agent's own protocol objects
(:mod:`peerlm.app.experiment_agent`): the in-process transport and CPM, an honest AKD and
merge, and a hostile teacher whose package or adapter the student's checks refuse."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from peerlm.agent import (
    Guardrail,
    LoraSettings,
    ModelHost,
    PeerExchangeError,
    Problem,
    encode_adapter,
)
from peerlm.services.cpm import Pairing

from peerlm.app.experiment_agent import InProcessCpm, InProcessFederation, InProcessPeers
from peerlm.app.experiment_plan import ExperimentPlan
from peerlm.app.experiment_slices import ClientSlices
from peerlm.app.experiment_world import Client, World
from peerlm.wire.v1 import cpm_pb2


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


def _problem(category: str, k: int) -> Problem:
    return Problem(
        task_id=f"{category}-{k}",
        category=category,
        prompt=f"def {category}_{k}(x):\n    ",
        reference=f"return x + {k}\n",
        tests=f"assert {category}_{k}(1) == {k + 1}\n",
        entry_point=f"{category}_{k}",
    )


class RecordingPolicy:
    """A pairing policy that learns nothing and remembers what it was told."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, str, float]] = []

    def observe(self, pairing: Pairing, reward: float) -> float:
        self.observed.append((pairing.sender, pairing.receiver, reward))
        return 2.0 * reward


def _pairing(sender: str, receiver: str, protocol: str) -> Pairing:
    return Pairing(sender, receiver, protocol, "one_way", np.zeros(1), 0.0, 0.0)


def _client(path: Path, i: int) -> Client:
    host = ModelHost.load(str(path), LoraSettings(r=4, alpha=8.0), device="cpu", seed=i)
    # A trained-looking adapter (a fresh one's B is zero: every merge would be the identity).
    state = host.adapter_state()
    gen = torch.Generator().manual_seed(10 + i)
    for k, v in state.items():
        if "lora_B" in k:
            state[k] = 0.01 * torch.randn(v.shape, generator=gen)
    host.load_adapter_state(state)
    train = [_problem("dict", k) for k in range(4)]
    val = [_problem("dict", k) for k in range(4, 6)]
    guard = Guardrail([p.prompt + p.reference for p in train])
    return Client(f"agent-{i}", "gpt2", host, train, val, guard)


@pytest.fixture
def world(micro_gpt2: Path) -> tuple[World, list[Client]]:
    plan = ExperimentPlan(
        agents=2,
        teach_scope="all",
        teach_limit=4,
        max_new_tokens=8,
        integration="separate",
        local_steps=1,
        seeds=(0,),
    )
    transfer = [_problem("string", k).prompt for k in range(4)]
    public = [(p.prompt, p.reference) for p in (_problem("string", k) for k in range(4))]
    slices = [ClientSlices(frozenset({"dict"}), frozenset({"format"}), frozenset({"string"}))] * 2
    w = World(
        plan=plan,
        models=micro_gpt2.parent,
        clients_data=[],
        transfer=transfer,
        transfer_sha256="ab" * 32,
        test=[],
        probe=[_problem("format", k) for k in range(2)],
        slices=slices,
        public=("string",),
        public_pairs=public,
        transfer_categories=["string"] * len(transfer),
    )
    return w, [_client(micro_gpt2, 0), _client(micro_gpt2, 1)]


def _federation(w: World, clients: list[Client], policy: Any) -> InProcessFederation:
    return InProcessFederation(w, clients, 0, 1, InProcessCpm(policy, -0.5))


def test_an_akd_directive_runs_the_agents_protocol_into_the_students_slot(
    world: tuple[World, list[Client]],
) -> None:
    w, (teacher, student) = world
    own_before = {k: v.clone() for k, v in student.host.adapter_state().items()}
    policy = RecordingPolicy()
    fed = _federation(w, [teacher, student], policy)
    record = fed.execute(_pairing(teacher.name, student.name, "akd"), "d-akd").record
    assert record is not None
    assert record["teacher"] == teacher.name and record["student"] == student.name
    assert record["mode"] == "text" and 0 <= record["alpha_kd"] <= 1
    # Eq. 3 with gamma 1, on the bytes the teacher's package really took on the wire.
    kb = fed.peers.bytes_served / 1024
    assert record["kilobytes"] == pytest.approx(kb, abs=0.01)
    expected = record["loss_pre"] - record["loss_post"] - w.plan.reward_delta * kb
    assert record["reward"] == pytest.approx(expected, abs=1e-4)
    assert policy.observed == [
        (teacher.name, student.name, pytest.approx(record["reward"], abs=1e-6))
    ]
    assert record["normalised_reward"] == pytest.approx(2 * record["reward"], abs=1e-4)
    # ``separate``: the peer slot took the exchange; the own adapter is untouched.
    assert student.slot.integrations == 1 and student.slot.state is not None
    for k, v in student.host.adapter_state().items():
        assert torch.equal(v, own_before[k]), k


def test_the_agents_akd_protocol_trains_the_slot_at_its_own_rate(
    world: tuple[World, list[Client]],
) -> None:
    """The protocol applies the slot's learning rate itself (agent/exchange/akd.py, as
    the daemon runs it): the context's configuration carries it unapplied."""
    from dataclasses import replace

    w, (teacher, student) = world
    w.plan = replace(w.plan, slot_learning_rate=2e-2)
    rates: list[float] = []
    train_akd = student.host.train_akd

    def spy(local: Any, pairs: Any, alpha: float, settings: Any, **kw: Any) -> Any:
        rates.append(settings.learning_rate)
        return train_akd(local, pairs, alpha, settings, **kw)

    student.host.train_akd = spy  # type: ignore[method-assign]
    try:
        fed = _federation(w, [teacher, student], RecordingPolicy())
        assert fed.execute(_pairing(teacher.name, student.name, "akd"), "d-akd").record
    finally:
        del student.host.train_akd
    assert rates == [2e-2]
    assert w.plan.learning_rate != 2e-2


def test_a_merge_directive_pulls_the_senders_adapter_through_the_codec(
    world: tuple[World, list[Client]],
) -> None:
    w, (teacher, student) = world
    fed = _federation(w, [teacher, student], RecordingPolicy())
    record = fed.execute(_pairing(teacher.name, student.name, "pmix"), "d-pmix").record
    assert record is not None and record["mode"] == "pmix" and record["co_senders"] == []
    encoded = len(teacher.host.encoded_adapter().data)
    assert record["kilobytes"] == pytest.approx(encoded / 1024, abs=0.01)
    assert student.slot.integrations == 1


def test_a_corrupt_package_is_refused_and_learnt_as_a_refusal(
    world: tuple[World, list[Client]], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, (teacher, student) = world
    policy = RecordingPolicy()
    fed = _federation(w, [teacher, student], policy)
    honest = InProcessPeers.offer

    def truncated(self: InProcessPeers, directive_id: str, who: str, data: bytes) -> None:
        honest(self, directive_id, who, data[: len(data) // 2])

    monkeypatch.setattr(InProcessPeers, "offer", truncated)
    done = fed.execute(_pairing(teacher.name, student.name, "akd"), "d-bad")
    assert done.record is None and done.integrations == 0
    # The CPM learnt the configured refusal reward; nothing reached the student.
    assert policy.observed == [(teacher.name, student.name, -0.5)]
    assert fed.cpm.reports["d-bad"].failure != 0
    assert student.slot.integrations == 0 and student.slot.state is None


@pytest.mark.parametrize("poison", ["nan", "norm"])
def test_a_poisoned_adapter_is_refused_by_the_students_checks(
    world: tuple[World, list[Client]], monkeypatch: pytest.MonkeyPatch, poison: str
) -> None:
    w, (teacher, student) = world
    state = teacher.host.adapter_state()
    first = next(k for k in state if "lora_B" in k)
    if poison == "nan":
        state[first] = torch.full_like(state[first], math.nan)
    else:  # finite, but far over the bound the student derives from its own adapter
        state[first] = state[first] * 1e4 + 1.0
    # A hostile teacher serves it (its own host would refuse to load a NaN).
    poisoned = SimpleNamespace(data=encode_adapter(state, teacher.host.adapter_spec()))
    monkeypatch.setattr(teacher.host, "encoded_adapter", lambda: poisoned)
    policy = RecordingPolicy()
    fed = _federation(w, [teacher, student], policy)
    done = fed.execute(_pairing(teacher.name, student.name, "pmix"), "d-bad")
    assert done.record is None and done.integrations == 0
    assert policy.observed == [(teacher.name, student.name, -0.5)]
    assert fed.cpm.reports["d-bad"].failure == cpm_pb2.EXCHANGE_FAILURE_INVALID_PAYLOAD
    assert student.slot.integrations == 0


def test_an_internal_error_in_the_student_stops_the_run(
    world: tuple[World, list[Client]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import peerlm.agent.exchange.rounds as rounds

    w, (teacher, student) = world

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(rounds, "integrate_package", broken)
    policy = RecordingPolicy()
    fed = _federation(w, [teacher, student], policy)
    # An agent keeps its own trouble from the CPM; the harness must not lose it quietly.
    with pytest.raises(RuntimeError, match="boom"):
        fed.execute(_pairing(teacher.name, student.name, "akd"), "d-err")
    assert policy.observed == []


def test_a_pairing_strategy_counts_steps_and_exchanges_only_for_what_was_integrated(
    world: tuple[World, list[Client]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerlm.services.cpm import PROFILE_DIM, RandomMatchmaker

    from peerlm.app.experiment_exchange import exchange

    w, clients = world
    profiles = {c.name: np.ones(PROFILE_DIM) for c in clients}
    records, _ = exchange(w, "random", RandomMatchmaker(seed=0), clients, profiles, 0, 1)
    [student] = [c for c in clients if c.name == records[0]["student"]]
    assert student.peer_steps == w.plan.integration_steps and student.exchanges == 1
    assert len(student.rewards) == 1
    honest = InProcessPeers.offer

    def truncated(self: InProcessPeers, directive_id: str, who: str, data: bytes) -> None:
        honest(self, directive_id, who, data[:10])

    monkeypatch.setattr(InProcessPeers, "offer", truncated)
    before = [(c.peer_steps, c.exchanges) for c in clients]
    records, _ = exchange(w, "random", RandomMatchmaker(seed=0), clients, profiles, 0, 2)
    assert records == [] and [(c.peer_steps, c.exchanges) for c in clients] == before


def test_the_harness_settings_ignore_the_shell(
    world: tuple[World, list[Client]], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, clients = world
    monkeypatch.setenv("PEERLM_AGENT_ACCEPTANCE_MARGIN", "0.5")
    monkeypatch.setenv("PEERLM_AGENT_MAX_LENGTH", "64")
    monkeypatch.setenv("PEERLM_AGENT_OVERLAY__K", "7")
    monkeypatch.setenv("PEERLM_CPM_REFUSAL_REWARD", "-0.7")
    monkeypatch.setenv("PEERLM_CPM_BETA", "9")
    settings = _federation(w, clients, RecordingPolicy()).settings
    assert settings.acceptance_margin is None and settings.max_length == 256
    assert settings.overlay.k == 2
    cpm = ExperimentPlan().cpm_settings(0, ("akd",))
    assert cpm.refusal_reward == 0.0 and cpm.beta == ExperimentPlan().cpm_settings(0).beta
    assert ExperimentPlan(cpm_beta=3.0).cpm_settings(0).beta == 3.0


def test_the_transport_refuses_what_a_peer_would_not_serve(
    world: tuple[World, list[Client]],
) -> None:
    _w, (teacher, student) = world
    peers = InProcessPeers({c.name: c for c in (teacher, student)}, 3)
    peers.offer("d", teacher.name, b"x" * 100)

    async def fetch(endpoint: str, directive: str, max_bytes: int = 1000) -> bytes:
        return await peers.fetch_package(
            endpoint, directive, expect=endpoint, max_bytes=max_bytes, timeout_s=1.0
        )

    assert asyncio.run(fetch(teacher.name, "d")) == b"x" * 100
    assert peers.bytes_served == 100
    for endpoint, directive, limit, reason in (
        (student.name, "d", 1000, "refused"),  # not the teacher that built it
        (teacher.name, "other", 1000, "refused"),  # no such directive
        (teacher.name, "d", 99, "too_large"),
    ):
        with pytest.raises(PeerExchangeError) as err:
            asyncio.run(fetch(endpoint, directive, limit))
        assert err.value.reason == reason
    assert peers.bytes_served == 100
    with pytest.raises(PeerExchangeError) as err:
        asyncio.run(peers.pull_adapter("nobody", expect="nobody", max_bytes=10**9, timeout_s=1))
    assert err.value.reason == "unavailable"
    round_, data = asyncio.run(
        peers.pull_adapter(teacher.name, expect=teacher.name, max_bytes=10**9, timeout_s=1)
    )
    assert round_ == 3 and data == teacher.host.encoded_adapter().data


def test_the_cpm_takes_one_report_per_directive_it_issued() -> None:
    policy = RecordingPolicy()
    cpm = InProcessCpm(policy, 0.0)
    cpm.pairings["d"] = _pairing("a", "b", "akd")
    with pytest.raises(ValueError, match="not issued"):
        asyncio.run(cpm.report_reward("unknown", 0.1))
    ack = asyncio.run(cpm.report_reward("d", 0.25, loss_pre=1.0, loss_post=0.75))
    assert ack.normalised_reward == 0.5 and policy.observed == [("a", "b", 0.25)]
    with pytest.raises(ValueError, match="twice"):
        asyncio.run(cpm.report_reward("d", 0.1))
    assert len(policy.observed) == 1
    # A disproof of a sender's space is the harness pairing wrongly: raised, nothing learnt.
    cpm.pairings["e"] = _pairing("a", "b", "pmix")
    with pytest.raises(ValueError, match="another parameter space"):
        asyncio.run(cpm.report_reward("e", 0.0, failure=1, space_mismatch=["a"]))
    assert len(policy.observed) == 1 and "e" not in cpm.reports


def test_the_overlay_pull_aggregates_what_the_neighbours_held_before_anyones_step(
    world: tuple[World, list[Client]],
) -> None:
    from peerlm.agent import Candidate, PullSettings

    w, (a, b) = world
    fed = _federation(w, [a, b], RecordingPolicy())
    fed.peers.freeze()
    held = a.host.encoded_adapter().data
    # a changes after the freeze: b still pulls what a held before (agents step at once).
    state = a.host.adapter_state()
    first = next(k for k in state if "lora_B" in k)
    state[first] = state[first] + 1.0
    a.host.load_adapter_state(state)
    _round, data = asyncio.run(
        fed.peers.pull_adapter(a.name, expect=a.name, max_bytes=10**9, timeout_s=1)
    )
    assert data == held != a.host.encoded_adapter().data
    report = fed.pull(b, [Candidate(a.name, a.name, 0.9)], PullSettings(max_peers=2), None, None)
    assert report.applied and [p.peer for p in report.pulled] == [a.name]
    assert report.bytes_received == len(held)
    assert b.slot.integrations == 1  # ``separate``: into the peer slot


class _RejectAll:
    """A router that keeps every input with the own adapter."""

    def to_peer(self, prompts: Any) -> list[bool]:
        return [False] * len(prompts)


def test_a_slot_scoped_student_learns_nothing_the_router_keeps_and_earns_the_kb_penalty(
    world: tuple[World, list[Client]],
) -> None:
    from dataclasses import replace

    from peerlm.services.cpm import PROFILE_DIM, RandomMatchmaker

    from peerlm.app.experiment_exchange import exchange

    w, clients = world
    for c in clients:
        c.router = _RejectAll()  # type: ignore[assignment]
    everything = clients[0].slot_learns(w.plan)  # slot_scope "all": every item
    assert everything is not None and list(everything(["a", "b"])) == [True, True]
    w.plan = replace(w.plan, slot_scope="routed")
    routed = clients[0].slot_learns(w.plan)
    assert routed is not None and list(routed(["a"])) == [False]
    assert clients[0].slot_learns(replace(w.plan, integration="shared", slot_banks="one")) is None
    profiles = {c.name: np.ones(PROFILE_DIM) for c in clients}
    records, _ = exchange(w, "random", RandomMatchmaker(seed=0), clients, profiles, 0, 1)
    [record] = records
    [student] = [c for c in clients if c.name == record["student"]]
    # The exchange happened and was rewarded (the CPM hears it taught nothing), but no
    # optimiser step was spent and the slot is as it was: empty, no integration counted.
    assert record["loss_pre"] == record["loss_post"]
    assert record["reward"] == pytest.approx(-w.plan.reward_delta * record["kilobytes"], abs=1e-4)
    assert student.exchanges == 1 and student.peer_steps == 0
    assert student.slot.state is None and student.slot.integrations == 0


def test_the_experiments_lessons_rehearse_through_the_slot(
    world: tuple[World, list[Client]],
) -> None:
    """experiment_distill.integrate (the Oracle's trials, central KD's lessons) goes through
    the daemon's slot runner: with slot_rehearsal a second lesson is distilled beside pairs
    of the first, and the own adapter is never written."""
    from dataclasses import replace

    from peerlm.agent.exchange.package import TextItem, TextPackage, prompt_sha256

    from peerlm.app.experiment_distill import integrate

    w, (_, student) = world
    w.plan = replace(w.plan, slot_rehearsal=2, reward="val")
    student.slot.rehearsal = 2
    package = TextPackage(
        teacher="agent-0",
        directive_id="d" * 32,
        transfer_sha256=w.transfer_sha256,
        model_family="gpt2",
        items=tuple(
            TextItem(str(k), prompt_sha256(p), f"return x * {k}\n")
            for k, p in enumerate(w.transfer)
        ),
        created_at=1.0,
    )
    seen: list[list[tuple[str, str]]] = []
    train_akd = student.host.train_akd

    def spy(local: Any, teacher: Any, *args: Any, **kw: Any) -> Any:
        seen.append(list(teacher))
        return train_akd(local, teacher, *args, **kw)

    own = {k: v.clone() for k, v in student.host.adapter_state().items()}
    student.host.train_akd = spy  # type: ignore[method-assign]
    try:
        integrate(w, student, package, 1.0, 0, 1, 1)
        lesson = [(p, f"return x * {k}\n") for k, p in enumerate(w.transfer)]
        assert seen[-1] == lesson and student.slot.lessons == [tuple(lesson)]
        integrate(w, student, package, 1.0, 0, 1, 2)
        assert seen[-1][:4] == lesson and len(seen[-1]) == 6
        assert set(seen[-1][4:]) <= set(lesson)
    finally:
        del student.host.train_akd
    assert student.slot.integrations == 2
    assert student.peer_steps == 2 * w.plan.integration_steps
    after = student.host.adapter_state()
    assert all(torch.equal(own[k], after[k]) for k in own)


def test_a_student_of_two_teachers_learns_both_lessons_and_loses_no_own_step(
    world: tuple[World, list[Client]], micro_gpt2: Path
) -> None:
    """``teachers_per_student: 2``: Random-P2P and the Oracle give every student two
    distinct teachers a round, each lesson integrated into the slot and rewarded; the own
    adapter is untouched, and LocalOnly+'s own-data steps are two lessons' worth."""
    from dataclasses import replace

    from peerlm.services.cpm import PROFILE_DIM

    from peerlm.app.experiment_distill import oracle_exchange
    from peerlm.app.experiment_exchange import exchange, pairing_policy
    from peerlm.app.experiment_run import own_data_steps

    w, pair = world
    w.plan = replace(w.plan, agents=3, teachers_per_student=2)
    w.slices = [*w.slices, w.slices[0]]
    clients = [*pair, _client(micro_gpt2, 2)]
    own = {c.name: {k: v.clone() for k, v in c.host.adapter_state().items()} for c in clients}
    profiles = {c.name: np.ones(PROFILE_DIM) for c in clients}
    records, _ = exchange(w, "random", pairing_policy("random", w.plan, 0), clients, profiles, 0, 1)
    taught = sorted((r["teacher"], r["student"]) for r in records)
    assert taught == sorted((a.name, b.name) for a in clients for b in clients if a is not b)
    for c in clients:
        assert c.exchanges == 2 and len(c.rewards) == 2 and c.slot.integrations == 2
        assert c.peer_steps == 2 * w.plan.integration_steps
        after = c.host.adapter_state()
        assert all(torch.equal(own[c.name][k], after[k]) for k in after)
    records, gains = oracle_exchange(w, clients, 0, 2)
    assert sorted((r["teacher"], r["student"]) for r in records) == taught
    assert len(gains) == 6 and all(c.exchanges == 4 for c in clients)
    # The best teacher's trial kept, the second teacher's lesson learnt on top of it.
    assert [c.slot.integrations for c in clients] == [4, 4, 4]
    assert all(len(c.slot.history) == 4 for c in clients)
    before = [c.own_steps for c in clients]
    own_data_steps(w, clients, 0, 3)
    assert [c.own_steps - b for c, b in zip(clients, before, strict=True)] == [
        2 * w.plan.integration_steps
    ] * 3
    assert w.plan.exchange_own_steps == 2 * w.plan.integration_steps
