"""Overlay pull-and-aggregate over real mTLS on 127.0.0.1 with micro models.

Two teachers with the student's architecture and LoRA shape are pulled and integrated by
the PDFL step; teachers with another LoRA rank, another base model or LoRA scaling, NaN
values, no adapter, or no server at all are refused with their reason and counted, and
never change the student's adapter on their own.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import safetensors.torch
import structlog
import torch
from peerlm.agent.acceptance import AcceptanceGate
from peerlm.agent.cpm.directives import DirectiveBook
from peerlm.agent.merging.pull_aggregate import Candidate, PullSettings, pull_and_aggregate
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.models.lora import LoraSettings
from peerlm.agent.models.tiny import build_models
from peerlm.agent.peer.service import PeerExchangeService, serve_peer
from peerlm.overlay.aggregation import neighbour_weights, proximal_alpha
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits
from peerlm.metrics import new_registry
from peerlm.node import NodeContext
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.wire.v1 import cpm_pb2
from tests.foreign_pki import foreign_member_credentials
from tests.node_contexts import credentials_context, kit_context
from tests.ports import free_port

pytestmark = pytest.mark.integration

FEDERATION = "pulltest"
LIMITS = GrpcLimits()
CHUNK = 4 * 1024  # micro adapters are ~12 KB: several chunks each
NAMES = ("student", "t1", "t2", "narrow", "nan", "huge", "alien", "scaled", "empty", "split")
T = TypeVar("T")


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def gpt2(micro_models_dir: Path) -> Path:
    [info] = build_models(micro_models_dir, ("gpt2",), size="micro")
    return Path(info.path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation=FEDERATION)
    for name in NAMES:
        issue_certificate(root, Role.AGENT, name, sans=["127.0.0.1"])
    return root


def _perturbed(host: ModelHost, seed: int, scale: float = 0.05) -> None:
    """Give a host's adapter distinct, non-zero LoRA B weights (a freshly set up B is 0)."""
    g = torch.Generator().manual_seed(seed)
    state = host.adapter_state()
    host.load_adapter_state(
        {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}
    )


def _crafted(host: ModelHost, *, nan: bool = False, huge: bool = False, **meta: str) -> bytes:
    """The host's adapter bytes with values or metadata changed (what a bad peer sends)."""
    state = host.adapter_state()
    if huge:  # finite, so it passes every check but a norm bound
        state = {k: torch.full_like(v, 1e30) for k, v in state.items()}
    if nan:
        first = sorted(state)[0]
        state[first] = state[first].clone()
        state[first].view(-1)[0] = math.nan
    metadata = host._metadata()
    metadata.update(meta)
    return bytes(safetensors.torch.save(state, metadata=metadata))


@dataclass
class Teacher:
    name: str
    target: str
    payload: bytes | None
    registry: CollectorRegistry
    server: grpc.aio.Server | None = None


@dataclass
class World:
    student: ModelHost
    teachers: dict[str, Teacher] = field(default_factory=dict)
    hosts: dict[str, ModelHost] = field(default_factory=dict)
    dead_address: str = ""


async def _serve(pki: Path, name: str, payload: bytes | None) -> Teacher:
    registry = new_registry()
    teacher = Teacher(name, "", payload, registry)

    async def no_package(directive: cpm_pb2.Directive) -> bytes:
        raise RuntimeError("this test serves adapters only")

    async def adapter_for(round_: int) -> tuple[int, bytes] | None:
        return None if teacher.payload is None else (7, teacher.payload)

    ctx = kit_context(pki, name, limits=LIMITS, registry=registry, listen="127.0.0.1:0")
    service = PeerExchangeService(
        DirectiveBook(lambda: 0.0),
        no_package,
        adapter_for,
        chunk_bytes=CHUNK,
        max_package_bytes=64 * 1024 * 1024,
        registry=registry,
        log=structlog.get_logger("test"),
        signer=ctx.signer,
    )
    server = await serve_peer(ctx, service, listen="127.0.0.1:0")
    teacher.server, teacher.target = server, f"127.0.0.1:{server.port}"
    return teacher


def _closed_port() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
async def world(gpt2: Path, pki: Path) -> AsyncIterator[World]:
    student = ModelHost.load(gpt2, LoraSettings(r=8), device="cpu", seed=0)
    _perturbed(student, 100)
    t1 = ModelHost.load(gpt2, LoraSettings(r=8), device="cpu", seed=1)
    t2 = ModelHost.load(gpt2, LoraSettings(r=8), device="cpu", seed=2)
    narrow = ModelHost.load(gpt2, LoraSettings(r=4), device="cpu", seed=3)
    for seed, host in enumerate((t1, t2, narrow), start=101):
        _perturbed(host, seed)
    payloads: dict[str, bytes | None] = {
        "t1": t1.adapter_bytes(),
        "t2": t2.adapter_bytes(),
        "narrow": narrow.adapter_bytes(),
        "nan": _crafted(t1, nan=True),
        "huge": _crafted(t1, huge=True),
        "alien": _crafted(t1, **{"peerlm.model_type": "bloom"}),
        "scaled": _crafted(t1, **{"peerlm.lora": LoraSettings(r=8, alpha=32.0).model_dump_json()}),
        "empty": None,
    }
    w = World(student, hosts={"t1": t1, "t2": t2}, dead_address=_closed_port())
    try:
        for name, payload in payloads.items():
            w.teachers[name] = await _serve(pki, name, payload)
        yield w
    finally:
        for teacher in w.teachers.values():
            if teacher.server is not None:
                await teacher.server.stop(0)


def _runner() -> tuple[ThreadPoolExecutor, Callable[..., Awaitable[Any]]]:
    """A one-thread model worker, as the daemon runs its model host."""
    pool = ThreadPoolExecutor(max_workers=1)

    async def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, **kwargs))

    return pool, run


def _student(pki: Path, registry: CollectorRegistry | None = None) -> NodeContext:
    return kit_context(pki, "student", limits=LIMITS, registry=registry)


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_two_teachers_integrated_bad_ones_refused(world: World, pki: Path) -> None:
    student = world.student
    before = student.adapter_state()
    t = world.teachers
    candidates = [
        Candidate("t1", t["t1"].target, 0.9),
        ("t2", t["t2"].target, 0.6),  # plain tuples work too
        Candidate("narrow", t["narrow"].target, 0.95),
        Candidate("nan", t["nan"].target, 0.8),
        Candidate("huge", t["huge"].target, 0.8),
        Candidate("alien", t["alien"].target, 0.8),
        Candidate("scaled", t["scaled"].target, 0.8),
        Candidate("empty", t["empty"].target, 0.8),
        Candidate("gone", world.dead_address, 0.8),
        Candidate("student", t["t1"].target, 1.0),  # the search found ourselves
        Candidate("t2", t["t2"].target, 0.1),  # a duplicate with a worse similarity
        Candidate("weird", t["t1"].target, math.nan),
    ]
    registry = new_registry()
    pool, run = _runner()
    try:
        report = await pull_and_aggregate(
            _student(pki, registry),
            student,
            candidates,
            settings=PullSettings(kappa=0.25, eta=1.0, psi=2.0, timeout_s=20.0),
            run_model=run,
            round_=3,
        )
    finally:
        pool.shutdown()

    reasons = {r.peer: r.reason for r in report.refused}
    assert reasons == {
        "narrow": "shape",
        "nan": "non_finite",
        "huge": "norm",
        "alien": "model_type",
        "scaled": "lora_config",
        "empty": "refused",  # NOT_FOUND: the peer has no adapter yet
        "gone": "unavailable",
        "student": "self",
        "t2": "duplicate",
        "weird": "bad_similarity",
    }
    assert [(p.peer, p.round, p.similarity) for p in report.pulled] == [
        ("t1", 7, 0.9),
        ("t2", 7, 0.6),
    ]
    assert report.applied
    assert report.pulled[0].bytes == len(t["t1"].payload or b"")
    completed = ("t1", "t2", "narrow", "nan", "huge", "alien", "scaled")
    assert report.bytes_received == sum(len(t[n].payload or b"") for n in completed)

    # The student's adapter is exactly (1 - alpha) w + alpha (W_ss w + W_1 w_1 + W_2 w_2).
    weights = neighbour_weights({"t1": 0.9, "t2": 0.6}, self_id="student", kappa=0.25)
    alpha = proximal_alpha(1.0, 2.0)
    assert report.weights == pytest.approx(weights)
    assert report.alpha == pytest.approx(alpha)
    w1, w2 = world.hosts["t1"].adapter_state(), world.hosts["t2"].adapter_state()
    after = student.adapter_state()
    delta_sq = 0.0
    for name, own in before.items():
        anchor = weights["student"] * own + weights["t1"] * w1[name] + weights["t2"] * w2[name]
        expected = (1 - alpha) * own + alpha * anchor
        torch.testing.assert_close(after[name], expected, rtol=1e-5, atol=1e-6)
        delta_sq += float(torch.sum((after[name] - own) ** 2))
    assert delta_sq > 0
    assert report.delta_norm == pytest.approx(math.sqrt(delta_sq), rel=1e-4)

    # Counted: one pull-failure per refusal reason, two integrated adapters, one step.
    for reason in set(reasons.values()):
        expected_n = sum(1 for r in reasons.values() if r == reason)
        assert (
            _metric(registry, "peerlm_agent_overlay_pull_failures_total", reason=reason)
            == expected_n
        )
    assert _metric(registry, "peerlm_agent_overlay_pulled_adapters_total") == 2
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="applied") == 1
    assert _metric(registry, "peerlm_agent_adapter_bytes_received_total") >= report.bytes_received
    # what the teachers served, over mTLS, in several chunks
    assert _metric(t["t1"].registry, "peerlm_agent_adapter_bytes_sent_total") == len(
        t["t1"].payload or b""
    )
    assert len(t["t1"].payload or b"") > CHUNK


async def test_no_usable_neighbour_leaves_the_adapter_untouched(world: World, pki: Path) -> None:
    student = world.student
    before = student.adapter_state()
    t = world.teachers
    registry = new_registry()
    report = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [
            Candidate("narrow", t["narrow"].target, 0.9),
            Candidate("nan", t["nan"].target, 0.9),
            Candidate("gone", world.dead_address, 0.9),
        ],
    )
    assert not report.applied and report.pulled == () and report.delta_norm == 0.0
    assert report.weights == {"student": 1.0}
    assert {r.reason for r in report.refused} == {"shape", "non_finite", "unavailable"}
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="identity") == 1
    assert _metric(registry, "peerlm_agent_overlay_pulled_adapters_total") == 0

    empty = await pull_and_aggregate(_student(pki, registry), student, [])
    assert not empty.applied and empty.refused == () and empty.bytes_received == 0


async def test_limits_bound_fan_out_and_size(world: World, pki: Path) -> None:
    t = world.teachers
    ctx = _student(pki)
    report = await pull_and_aggregate(
        ctx,
        world.student,
        [Candidate("t1", t["t1"].target, 0.5), Candidate("t2", t["t2"].target, 0.7)],
        settings=PullSettings(max_peers=1),
    )
    assert [p.peer for p in report.pulled] == ["t2"]  # the more similar one
    assert [(r.peer, r.reason) for r in report.refused] == [("t1", "over_limit")]

    before = world.student.adapter_state()
    report = await pull_and_aggregate(
        ctx,
        world.student,
        [Candidate("t1", t["t1"].target, 0.5)],
        settings=PullSettings(max_adapter_bytes=1024),
    )
    assert [(r.peer, r.reason) for r in report.refused] == [("t1", "too_large")]
    assert not report.applied
    after = world.student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)


async def test_a_student_from_another_ca_is_not_served(world: World, tmp_path: Path) -> None:
    creds = foreign_member_credentials(tmp_path / "foreign", FEDERATION, "student")
    ctx = credentials_context(creds, PeerIdentity(FEDERATION, Role.AGENT, "student"))
    report = await pull_and_aggregate(
        ctx,
        world.student,
        [Candidate("t1", world.teachers["t1"].target, 0.9)],
        settings=PullSettings(timeout_s=10.0),
    )
    assert not report.applied
    assert [r.reason for r in report.refused] == ["unavailable"]


VAL = [
    ("def add(a, b):\n", "    return a + b\n"),
    ("def neg(x):\n", "    return -x\n"),
]


async def test_a_harmful_aggregate_is_rolled_back(world: World, pki: Path) -> None:
    """With the norm bound off, a finite 1e30 adapter reaches the aggregate; the
    acceptance gate sees the held-out loss explode and restores the student's adapter."""
    student = world.student
    before = student.adapter_state()
    t = world.teachers
    registry = new_registry()
    report = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [Candidate("huge", t["huge"].target, 0.9)],
        settings=PullSettings(max_norm_ratio=None, max_update_ratio=None, timeout_s=20.0),
        gate=AcceptanceGate(VAL, margin=0.1, max_length=64),
    )
    assert report.rolled_back and not report.applied and report.pulled == ()
    assert [(r.peer, r.reason) for r in report.refused] == [("huge", "rolled_back")]
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _metric(registry, "peerlm_agent_integrations_rolled_back_total", kind="overlay") == 1
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="rolled_back") == 1

    # An honest neighbour passes the same gate (a generous margin: the micro model is noisy).
    honest = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [Candidate("t1", t["t1"].target, 0.9)],
        gate=AcceptanceGate(VAL, margin=5.0, max_length=64),
    )
    assert honest.applied and not honest.rolled_back


PUBLIC = [
    ('def add(a: int, b: int) -> int:\n    """Sum.\n    """\n    ', "return a + b\n"),
    ('def neg(x: int) -> int:\n    """Negate.\n    """\n    ', "return -x\n"),
]


async def test_svd_hka_aggregates_the_pulled_adapters_as_one_shot_does(
    world: World, pki: Path, gpt2: Path
) -> None:
    """Aggregation "svd_hka" is OnePeFT's one-shot step on what was pulled, with the
    similarity weights; bad neighbours are refused by the same checks first."""
    from peerlm.agent.merging.lora_merge import ClientAdapter
    from peerlm.agent.merging.onepeft import one_shot
    from peerlm.agent.training import TrainSettings

    student = world.student
    before = student.adapter_state()
    twin = ModelHost.load(gpt2, LoraSettings(r=8), device="cpu", seed=0)
    twin.load_adapter_state(before)
    t = world.teachers
    train = TrainSettings(learning_rate=1e-2, batch_size=2, grad_accumulation=1, seed=5)
    settings = PullSettings(method="svd_hka", hka_steps=2, timeout_s=20.0, kappa=0.25)
    with pytest.raises(ValueError, match="public"):
        await pull_and_aggregate(_student(pki), student, [], settings=settings)
    registry = new_registry()
    report = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [
            Candidate("t1", t["t1"].target, 0.9),
            Candidate("t2", t["t2"].target, 0.6),
            Candidate("nan", t["nan"].target, 0.8),
        ],
        settings=settings,
        hka=(PUBLIC, train),
    )
    assert report.applied and [p.peer for p in report.pulled] == ["t1", "t2"]
    assert {r.peer: r.reason for r in report.refused} == {"nan": "non_finite"}
    weights = neighbour_weights({"t1": 0.9, "t2": 0.6}, self_id="student", kappa=0.25)
    assert report.weights == pytest.approx(weights) and report.alpha == 1.0
    # The same step computed directly on an identical host gives the same adapter.
    states = {"student": before, **{n: world.hosts[n].adapter_state() for n in ("t1", "t2")}}
    clients = [ClientAdapter(states[n], r=8, alpha=16.0, name=n) for n in states]
    result = one_shot(twin, clients, PUBLIC, train, weights=[weights[n] for n in states], steps=2)
    assert result.variant == "svd+hka" and result.hka is not None
    expected, after = twin.adapter_state(), student.adapter_state()
    for name in expected:
        torch.testing.assert_close(after[name], expected[name], rtol=1e-4, atol=1e-5)
    assert report.delta_norm > 0
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="applied") == 1


async def test_a_harmful_svd_hka_aggregate_is_rolled_back(world: World, pki: Path) -> None:
    """Poisoned neighbours for aggregation "svd_hka", as for pmix above. A 1e30 adapter does not
    get that far here (its SVD aggregate is not finite and is refused before loading), so the
    harmful neighbour is a teacher's adapter scaled 100-fold: finite, inside every check once
    the norm bound is off. After OnePeFT's SVD + HKA step it undoes what the student learnt
    (a finite rise of the held-out loss beyond the margin); the acceptance gate restores the
    student's adapter, counts and reports it."""
    from peerlm.agent.training import TrainSettings

    student = world.student
    student.train_local(VAL, TrainSettings(learning_rate=1e-2, batch_size=2, seed=0), steps=20)
    before = student.adapter_state()
    t1 = world.hosts["t1"]
    loud = {k: 100.0 * v for k, v in t1.adapter_state().items()}
    bad = await _serve(pki, "huge", bytes(safetensors.torch.save(loud, metadata=t1._metadata())))
    train = TrainSettings(learning_rate=1e-2, batch_size=2, grad_accumulation=1, seed=5)
    settings = PullSettings(
        method="svd_hka", hka_steps=2, max_norm_ratio=None, max_update_ratio=None, timeout_s=20.0
    )
    gate = AcceptanceGate(VAL, margin=0.1, max_length=64)
    harmful = [Candidate("huge", bad.target, 0.9)]
    try:
        # The 1e30 adapter: its aggregate is refused before it is loaded, nothing to undo.
        refused = await pull_and_aggregate(
            _student(pki),
            student,
            [Candidate("huge", world.teachers["huge"].target, 0.9)],
            settings=settings,
            gate=gate,
            hka=(PUBLIC, train),
        )
        assert not refused.applied and not refused.rolled_back
        assert [(r.peer, r.reason) for r in refused.refused] == [("huge", "load")]
        assert all(torch.equal(student.adapter_state()[k], before[k]) for k in before)
        # Without the gate the aggregate stays, and the held-out loss is finite but worse.
        pre = gate.loss(student)
        kept = await pull_and_aggregate(
            _student(pki), student, harmful, settings=settings, hka=(PUBLIC, train)
        )
        post = gate.loss(student)
        assert kept.applied and math.isfinite(post) and post > pre + gate.margin
        student.load_adapter_state(before)

        registry = new_registry()
        report = await pull_and_aggregate(
            _student(pki, registry),
            student,
            harmful,
            settings=settings,
            gate=gate,
            hka=(PUBLIC, train),
        )
    finally:
        assert bad.server is not None
        await bad.server.stop(0)
    assert report.rolled_back and not report.applied and report.pulled == ()
    assert [(r.peer, r.reason) for r in report.refused] == [("huge", "rolled_back")]
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert gate.loss(student) == pytest.approx(pre)
    assert _metric(registry, "peerlm_agent_integrations_rolled_back_total", kind="overlay") == 1
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="rolled_back") == 1
    assert _metric(registry, "peerlm_agent_overlay_pull_failures_total", reason="rolled_back") == 1

    # An honest neighbour passes the same gate (a generous margin: the micro model is noisy).
    honest = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [Candidate("t1", world.teachers["t1"].target, 0.9)],
        settings=settings,
        gate=AcceptanceGate(VAL, margin=5.0, max_length=64),
        hka=(PUBLIC, train),
    )
    assert honest.applied and not honest.rolled_back
    assert _metric(registry, "peerlm_agent_overlay_aggregations_total", outcome="applied") == 1


# -- CPM merge directives (the student executes the directive's protocol) --


def _directive(teacher: str, endpoint: str, **change: Any) -> dict[str, Any]:
    """merge_from_teacher's keyword arguments for a pmix directive from ``teacher``."""
    return {
        "protocol": "pmix",
        "teacher": teacher,
        "endpoint": endpoint,
        "pull": PullSettings(timeout_s=20.0),
        "val_examples": VAL,
        "max_length": 64,
        "margin": 0.1,
        "reward_gamma": 1.0,
        "reward_delta": 0.001,
        **change,
    }


async def test_a_pmix_directive_merges_the_teacher_and_measures_eq3(
    world: World, pki: Path
) -> None:
    """The directive's teacher is pulled under its name and merged by the PDFL step; the
    reward is Eq. 3 from the gate's two held-out losses and the kilobytes pulled."""
    from peerlm.agent.exchange.rounds import reward_eq3
    from peerlm.agent.merging.directive import merge_from_teacher

    student = world.student
    before = student.adapter_state()
    gate = AcceptanceGate(VAL, margin=None, max_length=64)
    pre = gate.loss(student)
    registry = new_registry()
    t1 = world.teachers["t1"]
    # The directive's protocol wins over the pull settings' method and fan-out.
    pull = PullSettings(timeout_s=20.0, max_peers=5, method="svd_hka")
    out = await merge_from_teacher(
        _student(pki, registry),
        student,
        **_directive("t1", t1.target, pull=pull, margin=None, round_=4),
    )
    assert out.protocol == "pmix" and not out.rolled_back
    assert [p.peer for p in out.report.pulled] == ["t1"] and out.report.applied
    assert out.kilobytes == pytest.approx(len(t1.payload or b"") / 1024.0)
    assert out.loss_pre == pytest.approx(pre)
    assert out.loss_post == pytest.approx(gate.loss(student))
    assert out.reward == reward_eq3(out.loss_pre, out.loss_post, out.kilobytes, 1.0, 0.001)
    after = student.adapter_state()
    assert any(not torch.equal(after[k], before[k]) for k in before)
    assert _metric(t1.registry, "peerlm_agent_adapter_bytes_sent_total") >= len(t1.payload or b"")


async def test_a_merge_with_a_probe_reward_measures_it_on_the_probe(
    world: World, pki: Path
) -> None:
    """With ``reward_examples`` (the agent's ``reward_file``) the merge's reward is Eq. 3 on
    the probe, right before the pull and right after the merge, as AKD's is."""
    from peerlm.agent.exchange.rounds import reward_eq3
    from peerlm.agent.merging.directive import merge_from_teacher

    probe = [("def twice(x):\n", "    return 2 * x\n"), ("def first(xs):\n", "    return xs[0]\n")]
    student = world.student
    probe_pre = student.eval_loss(probe, max_length=64)[0]
    val_pre = student.eval_loss(VAL, max_length=64)[0]
    t1 = world.teachers["t1"]
    out = await merge_from_teacher(
        _student(pki, new_registry()),
        student,
        **_directive("t1", t1.target, margin=None, reward_examples=probe),
    )
    assert out.report.applied and not out.rolled_back
    assert out.loss_pre == pytest.approx(probe_pre) != pytest.approx(val_pre)
    assert out.loss_post == pytest.approx(student.eval_loss(probe, max_length=64)[0])
    assert out.reward == reward_eq3(out.loss_pre, out.loss_post, out.kilobytes, 1.0, 0.001)


@pytest.mark.parametrize(
    ("teacher", "reason"),
    [
        ("narrow", "shape"),
        ("alien", "model_type"),
        ("scaled", "lora_config"),
        ("gone", "unavailable"),
    ],
)
async def test_a_merge_directive_refuses_an_adapter_of_another_space(
    world: World, pki: Path, teacher: str, reason: str
) -> None:
    """A teacher whose adapter turns out to be of another shape, backbone or scaling (or
    who is unreachable) fails the directive with the pull's reason; nothing changes."""
    from peerlm.agent.merging.directive import MergeRefused, merge_from_teacher

    student = world.student
    before = student.adapter_state()
    target = world.dead_address if teacher == "gone" else world.teachers[teacher].target
    registry = new_registry()
    with pytest.raises(MergeRefused) as err:
        await merge_from_teacher(_student(pki, registry), student, **_directive(teacher, target))
    assert err.value.reason == reason
    # The CPM is told which sender's declared fingerprint the adapter disproved; an
    # unreachable teacher proved nothing about its space.
    assert err.value.space_mismatch == (() if teacher == "gone" else (teacher,))
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _metric(registry, "peerlm_agent_overlay_pull_failures_total", reason=reason) == 1


async def test_a_merge_directive_signed_by_another_member_is_refused(
    world: World, pki: Path
) -> None:
    """The directive names t2, but the endpoint serves t1's adapter under t1's proof."""
    from peerlm.agent.merging.directive import MergeRefused, merge_from_teacher

    with pytest.raises(MergeRefused) as err:
        await merge_from_teacher(
            _student(pki), world.student, **_directive("t2", world.teachers["t1"].target)
        )
    assert err.value.reason == "unverified_sender"


async def test_a_harmful_merge_is_rolled_back_and_still_rewarded(world: World, pki: Path) -> None:
    """With the norm bound off, the 1e30 adapter is merged, the gate undoes it, and the
    directive still gets its (bounded, negative) reward, as an AKD rollback does."""
    from peerlm.agent.acceptance import LOSS_PENALTY_NATS
    from peerlm.agent.merging.directive import merge_from_teacher

    student = world.student
    before = student.adapter_state()
    registry = new_registry()
    pull = PullSettings(timeout_s=20.0, max_norm_ratio=None, max_update_ratio=None)
    out = await merge_from_teacher(
        _student(pki, registry),
        student,
        **_directive("huge", world.teachers["huge"].target, pull=pull),
    )
    assert out.rolled_back and out.reward < 0
    assert out.loss_post <= out.loss_pre + LOSS_PENALTY_NATS
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _metric(registry, "peerlm_agent_integrations_rolled_back_total", kind="merge") == 1


async def test_a_rolled_back_merge_reports_the_gates_loss_whatever_the_probe(
    world: World, pki: Path
) -> None:
    """Hostile teacher under a probe reward: its merged adapter wrecks the student's val
    loss, so the gate rolls the merge back; the reward is then the gate's (val losses,
    bounded, negative), never the probe's, so an adapter tuned to the probe cannot buy a
    good reward with a merge the student did not keep (as AKD: test_rounds.py)."""
    from peerlm.agent.acceptance import LOSS_PENALTY_NATS
    from peerlm.agent.merging.directive import merge_from_teacher

    probe = [("def twice(x):\n", "    return 2 * x\n"), ("def first(xs):\n", "    return xs[0]\n")]
    student = world.student
    before = student.adapter_state()
    val_pre = student.eval_loss(VAL, max_length=64)[0]
    probe_pre = student.eval_loss(probe, max_length=64)[0]
    out = await merge_from_teacher(
        _student(pki, new_registry()),
        student,
        **_directive(
            "huge",
            world.teachers["huge"].target,
            pull=PullSettings(timeout_s=20.0, max_norm_ratio=None, max_update_ratio=None),
            reward_examples=probe,
        ),
    )
    assert out.rolled_back and out.merged == () and out.reward < 0
    assert out.loss_pre == pytest.approx(val_pre) != pytest.approx(probe_pre)
    assert out.loss_post <= out.loss_pre + LOSS_PENALTY_NATS
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)


async def test_a_merge_directive_checks_its_protocol_first(world: World, pki: Path) -> None:
    from peerlm.agent.merging.directive import merge_from_teacher

    target = world.teachers["t1"].target
    with pytest.raises(ValueError, match="not a merge"):
        await merge_from_teacher(
            _student(pki), world.student, **_directive("t1", target, protocol="akd")
        )
    with pytest.raises(ValueError, match="public"):
        await merge_from_teacher(
            _student(pki), world.student, **_directive("t1", target, protocol="svd_hka")
        )


async def test_an_svd_hka_directive_merges_by_onepeft(world: World, pki: Path) -> None:
    from peerlm.agent.merging.directive import merge_from_teacher
    from peerlm.agent.training import TrainSettings

    student = world.student
    before = student.adapter_state()
    train = TrainSettings(learning_rate=1e-2, batch_size=2, grad_accumulation=1, seed=5)
    directive = _directive(
        "t1",
        world.teachers["t1"].target,
        protocol="svd_hka",
        pull=PullSettings(timeout_s=20.0, hka_steps=2),
        margin=None,
        hka=(PUBLIC, train),
    )
    out = await merge_from_teacher(_student(pki), student, **directive)
    assert out.protocol == "svd_hka" and out.report.applied and out.report.alpha == 1.0
    assert math.isfinite(out.reward)
    after = student.adapter_state()
    assert any(not torch.equal(after[k], before[k]) for k in before)


async def test_equal_fingerprints_are_exactly_the_mergeable_adapters(
    world: World, gpt2: Path, micro_models_dir: Path
) -> None:
    """The fingerprint agents declare to the CPM agrees with the codec's checks: same
    backbone and LoRA shape, same fingerprint; another rank, scaling or model, another."""
    from peerlm.agent.cpm.profile import host_parameter_space as fingerprint

    [qwen] = build_models(micro_models_dir, ("qwen2",), size="micro")
    same = fingerprint(world.student)
    assert fingerprint(world.hosts["t1"]) == same
    others = [
        ModelHost.load(gpt2, LoraSettings(r=4), device="cpu", seed=0),
        ModelHost.load(gpt2, LoraSettings(r=8, alpha=32.0), device="cpu", seed=0),
        ModelHost.load(Path(qwen.path), LoraSettings(r=8), device="cpu", seed=0),
    ]
    assert len({same, *(fingerprint(h) for h in others)}) == 4


# -- several senders per merge directive (Directive.co_senders, CPM merge_senders > 1) --


async def test_an_svd_hka_directive_merges_every_usable_sender_and_skips_poisoned_ones(
    world: World, pki: Path, gpt2: Path
) -> None:
    """The teacher and its co-senders are pulled; OnePeFT's Eq. 3 aggregates the student's
    own adapter and every usable sender's with uniform lambda (no data shares are known),
    exactly as one_shot on those adapters. A poisoned co-sender (NaN, 1e30 norm, another
    shape) and an unreachable one are refused by the codec or the pull, skipped, never
    merged, and counted by reason."""
    from peerlm.agent.merging.directive import merge_from_teacher
    from peerlm.agent.merging.lora_merge import ClientAdapter
    from peerlm.agent.merging.onepeft import one_shot
    from peerlm.agent.training import TrainSettings

    student = world.student
    before = student.adapter_state()
    twin = ModelHost.load(gpt2, LoraSettings(r=8), device="cpu", seed=0)
    twin.load_adapter_state(before)
    t = world.teachers
    co = [("t2", t["t2"].target), ("nan", t["nan"].target), ("huge", t["huge"].target)]
    co += [("narrow", t["narrow"].target), ("gone", world.dead_address)]
    train = TrainSettings(learning_rate=1e-2, batch_size=2, grad_accumulation=1, seed=5)
    registry = new_registry()
    out = await merge_from_teacher(
        _student(pki, registry),
        student,
        **_directive(
            "t1",
            t["t1"].target,
            protocol="svd_hka",
            pull=PullSettings(timeout_s=20.0, hka_steps=2),
            margin=None,
            hka=(PUBLIC, train),
            co_senders=co,
        ),
    )
    assert out.merged == ("t1", "t2") and out.report.applied
    assert {r.peer: r.reason for r in out.skipped} == {
        "nan": "non_finite",
        "huge": "norm",
        "narrow": "shape",
        "gone": "unavailable",
    }
    # Only the co-sender whose adapter is of another space is named to the CPM: not the
    # poisoned ones of the right space, not the unreachable one.
    assert out.space_mismatch == ("narrow",)
    assert out.report.weights == pytest.approx({"student": 1 / 3, "t1": 1 / 3, "t2": 1 / 3})
    states = {"student": before, **{n: world.hosts[n].adapter_state() for n in ("t1", "t2")}}
    clients = [ClientAdapter(states[n], r=8, alpha=16.0, name=n) for n in states]
    one_shot(twin, clients, PUBLIC, train, weights=[1 / 3] * 3, steps=2)
    expected, after = twin.adapter_state(), student.adapter_state()
    for name in expected:
        torch.testing.assert_close(after[name], expected[name], rtol=1e-4, atol=1e-5)
    for reason in ("non_finite", "norm", "shape", "unavailable"):
        assert _metric(registry, "peerlm_agent_directive_senders_skipped_total", reason=reason) == 1
    assert _metric(registry, "peerlm_agent_directive_senders_merged_total") == 2
    # Every completed pull counts in Eq. 3's kilobytes, merged or not.
    completed = ("t1", "t2", "nan", "huge", "narrow")
    assert out.kilobytes == pytest.approx(sum(len(t[n].payload or b"") for n in completed) / 1024)


async def test_a_pmix_directive_mixes_the_teacher_and_its_co_senders(
    world: World, pki: Path
) -> None:
    """pmix with co-senders is the PDFL step over all of them, each of similarity 1."""
    from peerlm.agent.merging.directive import merge_from_teacher

    student = world.student
    before = student.adapter_state()
    t = world.teachers
    settings = PullSettings(timeout_s=20.0)
    out = await merge_from_teacher(
        _student(pki),
        student,
        **_directive(
            "t1", t["t1"].target, pull=settings, margin=None, co_senders=[("t2", t["t2"].target)]
        ),
    )
    assert out.merged == ("t1", "t2") and out.skipped == () and out.space_mismatch == ()
    weights = neighbour_weights({"t1": 1.0, "t2": 1.0}, self_id="student", kappa=settings.kappa)
    alpha = proximal_alpha(settings.eta, settings.psi)
    w1, w2 = world.hosts["t1"].adapter_state(), world.hosts["t2"].adapter_state()
    after = student.adapter_state()
    for name, own in before.items():
        anchor = weights["student"] * own + weights["t1"] * w1[name] + weights["t2"] * w2[name]
        torch.testing.assert_close(
            after[name], (1 - alpha) * own + alpha * anchor, rtol=1e-5, atol=1e-6
        )


async def test_a_merge_directive_whose_senders_all_fail_is_refused(world: World, pki: Path) -> None:
    """No usable adapter: MergeRefused with the teacher's reason, the adapter untouched,
    every sender counted as skipped."""
    from peerlm.agent.merging.directive import MergeRefused, merge_from_teacher

    student = world.student
    before = student.adapter_state()
    t = world.teachers
    registry = new_registry()
    with pytest.raises(MergeRefused) as err:
        await merge_from_teacher(
            _student(pki, registry),
            student,
            **_directive(
                "alien",
                t["alien"].target,
                co_senders=[("nan", t["nan"].target), ("gone", world.dead_address)],
            ),
        )
    assert err.value.reason == "model_type"
    assert err.value.space_mismatch == ("alien",)
    after = student.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    for reason in ("model_type", "non_finite", "unavailable"):
        assert _metric(registry, "peerlm_agent_directive_senders_skipped_total", reason=reason) == 1
    assert _metric(registry, "peerlm_agent_directive_senders_merged_total") == 0


async def test_co_senders_beyond_the_fan_out_are_skipped(world: World, pki: Path) -> None:
    """The pull's max_peers bounds a directive's senders: the teacher first, then the
    co-senders in the directive's order; the rest are skipped as over_limit."""
    from peerlm.agent.merging.directive import merge_from_teacher

    t = world.teachers
    out = await merge_from_teacher(
        _student(pki),
        world.student,
        **_directive(
            "t1",
            t["t1"].target,
            pull=PullSettings(timeout_s=20.0, max_peers=2),
            margin=None,
            co_senders=[("t2", t["t2"].target), ("narrow", t["narrow"].target)],
        ),
    )
    assert out.merged == ("t1", "t2")
    assert [(r.peer, r.reason) for r in out.skipped] == [("narrow", "over_limit")]


async def test_a_sender_named_twice_or_the_student_itself_is_merged_at_most_once(
    world: World, pki: Path
) -> None:
    """A directive naming the teacher again, a co-sender twice, or the student itself
    (none of which an honest CPM sends) must not weigh one adapter twice or merge the
    student with itself: each sender is pulled once, the rest skipped (``duplicate``,
    ``self``) and counted."""
    from peerlm.agent.merging.directive import merge_from_teacher

    t = world.teachers
    registry = new_registry()
    out = await merge_from_teacher(
        _student(pki, registry),
        world.student,
        **_directive(
            "t1",
            t["t1"].target,
            margin=None,
            co_senders=[
                ("t2", t["t2"].target),
                ("t1", t["t1"].target),
                ("t2", t["t2"].target),
                ("student", t["t2"].target),
            ],
        ),
    )
    assert out.merged == ("t1", "t2")
    assert sorted((r.peer, r.reason) for r in out.skipped) == [
        ("student", "self"),
        ("t1", "duplicate"),
        ("t2", "duplicate"),
    ]
    skipped = "peerlm_agent_directive_senders_skipped_total"
    assert _metric(registry, skipped, reason="duplicate") == 2
    assert _metric(registry, skipped, reason="self") == 1
    assert set(out.report.weights) == {"student", "t1", "t2"}  # each adapter once


# -- the update B A bounded per module, not only the factors' norm --


def _split_budget(host: ModelHost, budget: float) -> bytes:
    """An adapter whose factors' norm is ``budget``, spent half on A and half on B, every
    module's A rows one direction and B columns one direction: the product (the update the
    student would apply) grows with the square of the budget. What a hostile sender serves
    to stay inside a bound on the factors."""
    state = host.adapter_state()
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    r = host.lora.r
    side = budget / math.sqrt(2 * r * len(modules))  # per-row (A) / per-column (B) norm
    crafted: dict[str, torch.Tensor] = {}
    for m in modules:
        a, b = state[m + ".lora_A.weight"], state[m + ".lora_B.weight"]
        u = a[0] / torch.linalg.vector_norm(a[0])
        v = b[:, 0] / torch.linalg.vector_norm(b[:, 0])
        crafted[m + ".lora_A.weight"] = (side * u).expand_as(a).contiguous()
        crafted[m + ".lora_B.weight"] = (side * v).unsqueeze(1).expand_as(b).contiguous()
    return bytes(safetensors.torch.save(crafted, metadata=host._metadata()))


async def test_an_adapter_splitting_the_norm_budget_between_a_and_b_is_refused(
    world: World, pki: Path
) -> None:
    """A sender inside the factor-norm bound (0.9 of 10x the student's) whose B A is
    tens of times an honest teacher's is refused by the per-module update bound
    (``update_norm``, counted), in an overlay pull and as a merge directive's co-sender;
    the honest teachers still pass. Without the update bound it was integrated."""
    from peerlm.agent.adapter_codec import adapter_norm, lora_update_norms
    from peerlm.agent.merging.directive import merge_from_teacher

    student, t = world.student, world.teachers
    before = student.adapter_state()
    payload = _split_budget(world.hosts["t1"], 0.9 * 10 * adapter_norm(before))
    crafted = safetensors.torch.load(payload)
    scaling = student.lora.alpha / student.lora.r
    honest = max(lora_update_norms(world.hosts["t1"].adapter_state(), scaling).values())
    assert max(lora_update_norms(crafted, scaling).values()) > 20 * honest
    split = await _serve(pki, "split", payload)
    try:
        registry = new_registry()
        report = await pull_and_aggregate(
            _student(pki, registry),
            student,
            [
                Candidate("t1", t["t1"].target, 0.9),
                Candidate("t2", t["t2"].target, 0.6),
                Candidate("split", split.target, 0.8),
            ],
            settings=PullSettings(timeout_s=20.0),
        )
        assert {r.peer: r.reason for r in report.refused} == {"split": "update_norm"}
        assert [p.peer for p in report.pulled] == ["t1", "t2"] and report.applied
        failures = "peerlm_agent_overlay_pull_failures_total"
        assert _metric(registry, failures, reason="update_norm") == 1

        registry = new_registry()
        student.load_adapter_state(before)  # the same bounds as the pull's
        out = await merge_from_teacher(
            _student(pki, registry),
            student,
            **_directive("t1", t["t1"].target, margin=None, co_senders=[("split", split.target)]),
        )
        assert out.merged == ("t1",)
        assert [(r.peer, r.reason) for r in out.skipped] == [("split", "update_norm")]
        skipped = "peerlm_agent_directive_senders_skipped_total"
        assert _metric(registry, skipped, reason="update_norm") == 1
    finally:
        assert split.server is not None
        await split.server.stop(0)


# -- an overlay neighbour's pulled adapter checked against the signature it advertised --


async def test_a_neighbour_advertising_more_similarity_than_its_adapter_has_is_refused(
    world: World, pki: Path
) -> None:
    """The search's similarity comes from the signature a peer published; t2 claims 0.99
    (a signature close to ours) while its adapter's recomputed similarity is near 0: refused
    ``signature_mismatch`` and counted; t1, advertised at what its adapter is, is pulled.
    Without the check t2 was integrated, with the largest weight of the anchor."""
    import numpy as np
    from peerlm.agent.overlay_client.advertised_signature import recomputed_similarity
    from peerlm.overlay import flatten_adapter, make_signature

    student, t = world.student, world.teachers
    weights, space = flatten_adapter(student.adapter_state())
    query = make_signature(weights, np.abs(weights), 256, space)
    honest = recomputed_similarity(query, world.hosts["t1"].adapter_state())
    assert recomputed_similarity(query, world.hosts["t2"].adapter_state()) < 0.5
    registry = new_registry()
    report = await pull_and_aggregate(
        _student(pki, registry),
        student,
        [Candidate("t1", t["t1"].target, honest), Candidate("t2", t["t2"].target, 0.99)],
        settings=PullSettings(timeout_s=20.0),
        query=query,
    )
    assert {r.peer: r.reason for r in report.refused} == {"t2": "signature_mismatch"}
    assert [p.peer for p in report.pulled] == ["t1"] and report.applied
    failures = "peerlm_agent_overlay_pull_failures_total"
    assert _metric(registry, failures, reason="signature_mismatch") == 1
