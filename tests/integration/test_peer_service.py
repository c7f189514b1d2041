"""PeerExchange over real mTLS on 127.0.0.1: who may fetch what, chunked transfers, limits."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import safetensors.torch
import structlog
import torch
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from peerlm.agent.cpm.directives import (
    DirectiveBook,
    DirectiveExpired,
    FetchLimitReached,
    NotTeacher,
    UnknownDirective,
)
from peerlm.agent.exchange.package import TextPackage, build_text_package, decode_package
from peerlm.agent.peer.client import (
    PeerExchangeError,
    fetch_package,
    pull_adapter,
    pull_adapter_with_round,
)
from peerlm.agent.peer.service import PEER_POLICY, PeerExchangeService, serve_peer
from peerlm.agent.peer.stream import PeerStreamer
from peerlm.agent.settings import PeerSendSettings
from peerlm.agent.vetting.guardrail import Guardrail
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits
from peerlm.metrics import new_registry
from peerlm.node import NodeContext
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.pki.proof import ProofError, ProofSigner
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import common_pb2, cpm_pb2, peer_pb2, peer_pb2_grpc
from tests.foreign_pki import foreign_member_credentials
from tests.node_contexts import credentials_context, kit_context

pytestmark = pytest.mark.integration

FEDERATION = "peertest"
CHUNK = 16 * 1024
LIMITS = GrpcLimits()
TRANSFER = "5e" * 32
NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation=FEDERATION)
    issue_certificate(root, Role.AGENT, "teacher", sans=["127.0.0.1"])
    for name in ("student", "other"):
        issue_certificate(root, Role.AGENT, name)
    issue_certificate(root, Role.ADMIN, "admin")
    return root


def _signer(pki: Path, name: str) -> ProofSigner:
    bundle = TlsFiles.from_directory(pki, name).load()
    return ProofSigner.from_pem(bundle.cert, bundle.key)


def _ctx(pki: Path, name: str, registry: CollectorRegistry | None = None) -> NodeContext:
    return kit_context(pki, name, limits=LIMITS, registry=registry)


@pytest.fixture(scope="module")
def payload() -> bytes:
    """A real text package of ~100 KB: several chunks of CHUNK bytes."""
    prompts = [f"def task_{i}(values):" for i in range(120)]
    completions = [
        f"    total = sum(values) * {i}  # step {i} of the plan\n" * 25 for i in range(120)
    ]
    return build_text_package(
        prompts=prompts,
        completions=completions,
        teacher="teacher",
        directive_id="d" * 32,
        transfer_sha256=TRANSFER,
        family="llama",
        guardrail=Guardrail([]),
        created_at=NOW,
    )


@dataclass
class Peer:
    target: str
    registry: CollectorRegistry
    book: DirectiveBook
    clock: list[float]
    payload: bytes
    builds: list[str] = field(default_factory=list)
    tokenizers: list[str | None] = field(default_factory=list)
    adapter: tuple[int, bytes] | None = None
    fail_next_build: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    service: PeerExchangeService | None = None

    def add(
        self,
        directive_id: str,
        *,
        student: str = "student",
        role: int = cpm_pb2.EXCHANGE_ROLE_TEACHER,
        expires_in: float = 600.0,
    ) -> None:
        expires = Timestamp()
        expires.FromNanoseconds(int((self.clock[0] + expires_in) * 1e9))
        self.book.add(
            cpm_pb2.Directive(
                directive_id=directive_id,
                matchmaking_round=4,
                protocol="akd",
                role=role,  # type: ignore[arg-type]
                teacher="teacher" if role == cpm_pb2.EXCHANGE_ROLE_TEACHER else "someone",
                student=student,
                expires_at=expires,
            )
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def peer(pki: Path, payload: bytes) -> AsyncIterator[Peer]:
    registry = new_registry()
    clock = [NOW]
    state = Peer("", registry, DirectiveBook(lambda: clock[0]), clock, payload)

    async def package_for(directive: cpm_pb2.Directive, tokenizer: str | None) -> bytes:
        state.builds.append(directive.directive_id)
        state.tokenizers.append(tokenizer)
        if directive.directive_id.startswith("slow"):
            await state.release.wait()
        if state.fail_next_build:
            state.fail_next_build = False
            raise RuntimeError("model host crashed")
        if directive.directive_id.startswith("big"):
            return b"\x00" * (600 * 1024)
        return state.payload

    async def adapter_for(round_: int) -> tuple[int, bytes] | None:
        return state.adapter

    service = PeerExchangeService(
        state.book,
        package_for,
        adapter_for,
        chunk_bytes=CHUNK,
        max_package_bytes=512 * 1024,
        registry=registry,
        log=structlog.get_logger("test"),
        signer=_signer(pki, "teacher"),
        streamer=PeerStreamer(registry, PeerSendSettings(wait_s=1.0)),
    )
    state.service = service
    server = await serve_peer(
        kit_context(pki, "teacher", registry=registry, listen="127.0.0.1:0"),
        service,
        listen="127.0.0.1:0",
    )
    state.target = f"127.0.0.1:{server.port}"
    try:
        yield state
    finally:
        state.release.set()  # let any parked build finish instead of leaking a task
        await server.stop(0)


async def _fetch(
    peer: Peer,
    pki: Path,
    name: str,
    directive_id: str,
    *,
    registry: CollectorRegistry | None = None,
    **kw: object,
) -> bytes:
    args: dict[str, object] = {"expect": "teacher", "max_bytes": 1024 * 1024, "timeout_s": 20.0}
    args.update(kw)
    ctx = _ctx(pki, name, registry)
    return await fetch_package(ctx, peer.target, directive_id, **args)  # type: ignore[arg-type]


async def _refused(coro: object) -> PeerExchangeError:
    with pytest.raises(PeerExchangeError) as info:
        await coro  # type: ignore[misc]
    return info.value


async def test_named_student_fetches_identical_bytes(peer: Peer, pki: Path) -> None:
    peer.add("a" * 32)
    assert len(peer.payload) > 4 * CHUNK  # several chunks
    client_registry = new_registry()
    data = await _fetch(peer, pki, "student", "a" * 32, registry=client_registry)
    assert data == peer.payload
    assert hashlib.sha256(data).digest() == hashlib.sha256(peer.payload).digest()
    package = decode_package(data, expect_transfer_sha256=TRANSFER, expect_teacher="teacher")
    assert isinstance(package, TextPackage) and len(package.items) == 120
    assert peer.metric("peerlm_agent_package_bytes_sent_total") == len(data)
    assert client_registry.get_sample_value("peerlm_agent_package_bytes_received_total") == len(
        data
    )
    method = "/peerlm.v1.PeerExchange/FetchPackage"
    assert (
        peer.metric(
            "peerlm_grpc_server_requests_total", component="agent", method=method, code="OK"
        )
        == 1
    )

    # A retry reuses the built package; the fetch budget (3 by default) then runs out.
    assert await _fetch(peer, pki, "student", "a" * 32) == data
    assert await _fetch(peer, pki, "student", "a" * 32) == data
    assert peer.builds == ["a" * 32]
    err = await _refused(_fetch(peer, pki, "student", "a" * 32))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "refused"
    assert peer.metric("peerlm_agent_peer_refusals_total", rpc="FetchPackage", reason="fetch_limit")


async def test_refusals_by_directive(peer: Peer, pki: Path) -> None:
    peer.add("b" * 32)
    peer.add("c" * 32, expires_in=10)
    peer.add("e" * 32, role=cpm_pb2.EXCHANGE_ROLE_STUDENT, student="student")
    peer.clock[0] += 60  # "c..." is now expired

    cases = [
        ("other", "b" * 32, grpc.StatusCode.PERMISSION_DENIED, "not_student"),
        ("student", "f" * 32, grpc.StatusCode.NOT_FOUND, "unknown_directive"),
        ("student", "c" * 32, grpc.StatusCode.FAILED_PRECONDITION, "expired"),
        ("student", "e" * 32, grpc.StatusCode.PERMISSION_DENIED, "not_teacher"),
        ("student", "../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT, "bad_directive_id"),
    ]
    for name, directive_id, code, reason in cases:
        err = await _refused(_fetch(peer, pki, name, directive_id))
        assert err.code == code, (name, directive_id, err)
        assert (
            peer.metric("peerlm_agent_peer_refusals_total", rpc="FetchPackage", reason=reason) == 1
        ), reason
    # Refusals spend nothing: the student still gets "b..." and nothing was built before.
    assert peer.builds == []
    assert await _fetch(peer, pki, "student", "b" * 32) == peer.payload
    assert peer.metric("peerlm_agent_package_bytes_sent_total") == len(peer.payload)


async def test_student_tokenizer_hint_reaches_the_provider(peer: Peer, pki: Path) -> None:
    """The student's announced tokenizer goes to the package provider (which picks logits or
    text); a malformed hint is refused before anything is built or counted."""
    peer.add("g" * 32)
    peer.add("h" * 32)
    err = await _refused(_fetch(peer, pki, "student", "g" * 32, tokenizer_sha256="not-hex"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert peer.metric(
        "peerlm_agent_peer_refusals_total", rpc="FetchPackage", reason="bad_tokenizer_hash"
    )
    assert peer.builds == []
    await _fetch(peer, pki, "student", "g" * 32, tokenizer_sha256="ab" * 32)
    await _fetch(peer, pki, "student", "h" * 32)
    assert peer.tokenizers == ["ab" * 32, None]


async def test_only_agents_may_call(peer: Peer, pki: Path) -> None:
    peer.add("b" * 32)
    assert set(PEER_POLICY.values()) == {frozenset({Role.AGENT})}
    err = await _refused(_fetch(peer, pki, "admin", "b" * 32))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert (
        peer.metric(
            "peerlm_auth_refusals_total",
            component="agent",
            method="/peerlm.v1.PeerExchange/FetchPackage",
            reason="role_not_allowed",
        )
        == 1
    )


async def test_oversize_package_refused_by_client_at_first_chunk(peer: Peer, pki: Path) -> None:
    peer.add("d" * 32)
    client_registry = new_registry()
    err = await _refused(
        _fetch(peer, pki, "student", "d" * 32, max_bytes=4 * CHUNK, registry=client_registry)
    )
    assert err.reason == "too_large" and "first chunk" in str(err)
    # Exactly one chunk was taken off the stream before the client hung up.
    received = client_registry.get_sample_value("peerlm_agent_package_bytes_received_total")
    assert received == CHUNK


async def test_teacher_refuses_to_send_beyond_its_limit(peer: Peer, pki: Path) -> None:
    peer.add("big" + "0" * 29)
    err = await _refused(_fetch(peer, pki, "student", "big" + "0" * 29))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        peer.metric(
            "peerlm_agent_peer_refusals_total", rpc="FetchPackage", reason="package_too_large"
        )
        == 1
    )


async def test_a_busy_send_budget_refuses_counts_and_refunds_the_fetch(
    peer: Peer, pki: Path
) -> None:
    # White-box: the budget held in full stands in for stalled readers of other members
    # (tests/security/test_slow_readers.py makes real ones).
    assert peer.service is not None
    budget = peer.service._streamer.budget
    held = budget.ledger.total_bytes
    assert await budget.reserve("stalled", held, timeout_s=1)
    peer.add("c" * 32)
    err = await _refused(_fetch(peer, pki, "student", "c" * 32))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "send budget" in str(err)
    assert peer.book.fetches("c" * 32) == 0  # the teacher's load, not the student's fetch
    peer.adapter = (2, b"adapter" * 100)
    with pytest.raises(PeerExchangeError) as pulled:
        await pull_adapter(
            _ctx(pki, "student"), peer.target, 0, expect="teacher", max_bytes=10**6, timeout_s=20
        )
    assert pulled.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for rpc in ("FetchPackage", "PullAdapter"):
        assert peer.metric("peerlm_agent_peer_send_cutoffs_total", rpc=rpc, reason="busy") == 1
    # Once the bytes come back, both are served.
    budget.release("stalled", held)
    assert await _fetch(peer, pki, "student", "c" * 32) == peer.payload
    assert peer.metric("peerlm_agent_peer_send_in_flight_bytes") == 0


async def test_failed_build_is_retried_not_cached(peer: Peer, pki: Path) -> None:
    peer.add("b" * 32)
    peer.fail_next_build = True
    err = await _refused(_fetch(peer, pki, "student", "b" * 32))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert await _fetch(peer, pki, "student", "b" * 32) == peer.payload
    assert peer.builds == ["b" * 32, "b" * 32]
    # The teacher's failure did not use up one of the student's three fetches.
    assert peer.book.fetches("b" * 32) == 1


async def test_deadline_and_unreachable_peer(peer: Peer, pki: Path) -> None:
    peer.add("slow" + "0" * 28)
    err = await _refused(_fetch(peer, pki, "student", "slow" + "0" * 28, timeout_s=0.5))
    assert err.reason == "timeout" and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    err = await _refused(
        fetch_package(
            _ctx(pki, "student"),
            "127.0.0.1:1",
            "b" * 32,
            expect="teacher",
            max_bytes=1024,
            timeout_s=5.0,
        )
    )
    assert err.reason == "unavailable"


async def test_pull_adapter(peer: Peer, pki: Path) -> None:
    err = await _refused(pull_adapter(_ctx(pki, "other"), peer.target, 0, max_bytes=10**6))
    assert err.code == grpc.StatusCode.NOT_FOUND
    tensors = {"lora_A": torch.randn(64, 8), "lora_B": torch.zeros(8, 64)}
    blob = safetensors.torch.save(tensors)
    peer.adapter = (7, blob)
    for name in ("other", "student"):  # any authenticated agent may pull
        data = await pull_adapter(_ctx(pki, name), peer.target, 0, max_bytes=10**6)
        assert data == blob
        loaded = safetensors.torch.load(data)
        assert torch.equal(loaded["lora_A"], tensors["lora_A"])
    assert await pull_adapter_with_round(
        _ctx(pki, "other"), peer.target, 7, expect="teacher", max_bytes=10**6
    ) == (7, blob)
    err = await _refused(pull_adapter(_ctx(pki, "other"), peer.target, 3, max_bytes=10**6))
    assert err.code == grpc.StatusCode.NOT_FOUND
    err = await _refused(pull_adapter(_ctx(pki, "other"), peer.target, 0, max_bytes=100))
    assert err.reason == "too_large"
    assert peer.metric("peerlm_agent_adapter_bytes_sent_total") >= 3 * len(blob)
    assert (
        peer.metric("peerlm_agent_peer_refusals_total", rpc="PullAdapter", reason="no_adapter") == 2
    )


async def test_health_serving(peer: Peer, pki: Path) -> None:
    async with _ctx(pki, "other").dial(peer.target) as dialled:
        stub = health_pb2_grpc.HealthStub(dialled.channel)  # type: ignore[no-untyped-call]
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="peerlm.v1.PeerExchange"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- the directive book on its own (no network) ----------------------------------------------


def _directive(directive_id: str, expires_at: float, **kw: object) -> cpm_pb2.Directive:
    expires = Timestamp()
    expires.FromNanoseconds(int(expires_at * 1e9))
    fields: dict[str, object] = {
        "directive_id": directive_id,
        "role": cpm_pb2.EXCHANGE_ROLE_TEACHER,
        "teacher": "teacher",
        "student": "student",
        "expires_at": expires,
    }
    fields.update(kw)
    return cpm_pb2.Directive(**fields)  # type: ignore[arg-type]


def test_directive_book_bounds_replays_and_errors() -> None:
    clock = [100.0]
    book = DirectiveBook(lambda: clock[0], self_name="teacher", capacity=2, max_fetches=2)
    assert book.add(_directive("x1", 150.0))
    assert book.add(_directive("x2", 500.0))
    assert not book.add(_directive("x2", 900.0))  # a replay keeps the original
    book.teaching_for("x2", "student")
    book.add(_directive("x2", 900.0))
    assert book.fetches("x2") == 1
    clock[0] = 200.0  # x1 expired: it is evicted first when room is needed
    book.add(_directive("x3", 500.0))
    assert "x1" not in book and len(book) == 2
    book.add(_directive("x4", 500.0))  # nothing expired: the oldest (x2) goes
    assert "x2" not in book and "x3" in book and "x4" in book
    book.teaching_for("x3", "student")
    book.refund("x3")
    book.teaching_for("x3", "student")
    book.teaching_for("x3", "student")
    with pytest.raises(FetchLimitReached):
        book.teaching_for("x3", "student")
    book.add(_directive("x5", 900.0, teacher="impostor"))
    with pytest.raises(NotTeacher):
        book.teaching_for("x5", "student")  # role says teacher, but not under our name
    with pytest.raises(UnknownDirective):
        book.teaching_for("nope", "student")
    with pytest.raises(ValueError):
        book.add(cpm_pb2.Directive(directive_id="x6", teacher="t", student="s"))
    clock[0] = 10_000.0
    with pytest.raises(DirectiveExpired):
        book.teaching_for("x4", "student")
    assert book.purge_expired() == 2


async def test_a_teacher_refusing_our_certificate_is_counted_by_the_student(
    peer: Peer, pki: Path, tmp_path: Path
) -> None:
    """A handshake refusal never reaches server code; the student's client counts it."""
    # Trusts our CA (so it reaches the teacher) but presents a certificate of another CA.
    creds = foreign_member_credentials(
        tmp_path / "foreign", FEDERATION, "student", trust=pki / "ca.crt"
    )
    registry = new_registry()
    ctx = credentials_context(
        creds, PeerIdentity(FEDERATION, Role.AGENT, "student"), registry=registry
    )
    peer.add("f" * 32)
    err = await _refused(
        fetch_package(
            ctx, peer.target, "f" * 32, expect="teacher", max_bytes=1024 * 1024, timeout_s=10.0
        )
    )
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    failures = sum(
        s.value
        for metric in registry.collect()
        if metric.name == "peerlm_grpc_client_tls_failures"
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("component") == "agent"
    )
    assert failures == 1
    assert peer.book.fetches("f" * 32) == 0  # nothing was served or used up


async def test_transfers_carry_the_senders_proof(peer: Peer, pki: Path) -> None:
    """The student checks whose certificate signed what it received (TLS alone shows it
    only that some federation member answered at that address)."""
    peer.add("p" * 32)
    got = await _fetch(peer, pki, "student", "p" * 32, expect="teacher")
    assert got == peer.payload
    # The directive named another teacher: the member that answered is not it.
    peer.add("q" * 32)
    err = await _refused(_fetch(peer, pki, "student", "q" * 32, expect="other"))
    assert err.reason == "unverified_sender" and "wrong_sender" in str(err)
    # A proof made out to another recipient does not cover what we received: "other"
    # checks the proof the teacher made out to "student" (the caller of this stream).
    peer.add("r" * 32)
    student = _ctx(pki, "student")
    async with student.dial(peer.target) as dialled:
        stub = peer_pb2_grpc.PeerExchangeStub(dialled.channel)  # type: ignore[no-untyped-call]
        call = stub.FetchPackage(peer_pb2.FetchPackageRequest(directive_id="r" * 32))
        received = b"".join([chunk.data async for chunk in call])
        metadata = await call.initial_metadata()
    with pytest.raises(ProofError) as proof:
        expected = _ctx(pki, "other").expect("teacher")
        assert expected is not None
        expected.verify(metadata, "package", "r" * 32, received)
    assert proof.value.reason == "bad_signature"
    peer.adapter = (7, b"adapter-bytes" * 100)
    sent_round, payload = await pull_adapter_with_round(
        student, peer.target, 0, expect="teacher", max_bytes=1 << 20
    )
    assert (sent_round, payload) == peer.adapter
    err = await _refused(
        pull_adapter_with_round(student, peer.target, 0, expect="other", max_bytes=1 << 20)
    )
    assert err.reason == "unverified_sender"


async def test_a_package_fetch_is_counted_by_the_agents_registry(peer: Peer, pki: Path) -> None:
    """What the daemon's fetch records: bytes received, and a refused handshake, land in
    the registry of the context that fetched (they were once never recorded)."""
    peer.add("m" * 32)
    ctx = _ctx(pki, "student")
    data = await fetch_package(
        ctx, peer.target, "m" * 32, expect="teacher", max_bytes=1 << 20, timeout_s=20.0
    )
    assert ctx.registry.get_sample_value("peerlm_agent_package_bytes_received_total") == len(data)


async def test_the_daemons_package_fetch_is_counted_in_its_registry(peer: Peer, pki: Path) -> None:
    """The student side of an AKD directive (the registered protocol's student step, run
    with the daemon as its context) records the package bytes it received in the agent's
    registry (it once passed no registry, so the count never moved). The model host is a
    stand-in: integration is not under test here and fails after the fetch, as an exchange
    failure the daemon counts."""
    from peerlm.agent import AgentSettings
    from peerlm.agent.daemon import AgentDaemon, AgentSummary
    from peerlm.agent.metrics import AgentTelemetry

    from peerlm.config import TlsSettings
    from peerlm.protocols import AKD

    kit = TlsFiles.from_directory(pki, "student")
    settings = AgentSettings(
        federation=FEDERATION,
        tls=TlsSettings(ca_cert=kit.ca_cert, cert=kit.cert, key=kit.key),
        cpm="127.0.0.1:1",
        round_timeout_s=20.0,
    )
    daemon = AgentDaemon(settings, structlog.get_logger("test"))
    daemon._connect()
    daemon.telemetry = AgentTelemetry(daemon.registry)
    daemon.summary = AgentSummary(name="student", model="none", family="none")
    daemon.transfer_digest = TRANSFER
    daemon.host = type("NoModel", (), {"tokenizer_hash": None})()  # type: ignore[assignment]
    peer.add("s" * 32)
    directive = cpm_pb2.Directive(
        directive_id="s" * 32,
        role=cpm_pb2.EXCHANGE_ROLE_STUDENT,
        teacher="teacher",
        student="student",
        peer=common_pb2.PeerAddress(name="teacher", endpoint=peer.target),
    )
    try:
        await daemon.exchanges[AKD.name].student(daemon, directive, 1)
    finally:
        daemon._worker.shutdown(wait=True)
    received = daemon.registry.get_sample_value("peerlm_agent_package_bytes_received_total")
    assert received == len(peer.payload)
    assert peer.book.fetches("s" * 32) == 1
