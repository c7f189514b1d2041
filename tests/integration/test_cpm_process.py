"""A real CPM process on loopback over mTLS: the happy path, refusals, bad input, metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from peerlm.agent.cpm.client import CpmClient

from peerlm.config import GrpcLimits
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.pki.proof import FEED_NONCE_METADATA, SenderCheck
from peerlm.rpc import create_channel
from peerlm.security.credentials import channel_credentials
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc
from tests.cpm_harness import FEDERATION, CpmProcess, Pki
from tests.node_contexts import credentials_context, dev_context, kit_context
from tests.ports import free_port

pytestmark = pytest.mark.integration

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}


@pytest.fixture(scope="module")
def cpm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    tmp = tmp_path_factory.mktemp("cpm")
    proc = CpmProcess(
        Pki.create(tmp, agents=13), tmp / "cpm.db", tmp, MANUAL, metrics_port=free_port()
    )
    proc.start()
    yield proc
    assert proc.terminate() == 0, proc.log()[-3000:]


def _profile(i: int) -> list[float]:
    return [float(x) for x in np.random.default_rng(i).uniform(0, 1, 32)]


def _metric(cpm: CpmProcess, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cpm.metrics_port}/metrics").read().decode()
    total = 0.0
    for line in body.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def test_health_serving(cpm: CpmProcess) -> None:
    ch = cpm.pki.channel(cpm.target, "a0")
    stub = health_pb2_grpc.HealthStub(ch)  # type: ignore[no-untyped-call]
    resp = await stub.Check(health_pb2.HealthCheckRequest(service="peerlm.v1.Matchmaker"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    await ch.close()


async def test_round_trip_profile_directive_reward(cpm: CpmProcess) -> None:
    chans = {}
    for i in range(4):
        ch, stub = cpm.pki.stub(cpm.target, f"a{i}")
        chans[f"a{i}"] = (ch, stub)
        resp = await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(
                round=1, features=_profile(i), peer_endpoint=f"127.0.0.1:{7000 + i}"
            )
        )
        assert resp.profiles_pending == i + 1
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    assert out.pairs == 2
    directives = {}
    for name, (_, stub) in chans.items():
        call = stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        d = await call.read()
        call.cancel()
        directives[name] = d
        assert name in (d.teacher, d.student)
        me_teacher = d.teacher == name
        assert d.role == (
            cpm_pb2.EXCHANGE_ROLE_TEACHER if me_teacher else cpm_pb2.EXCHANGE_ROLE_STUDENT
        )
        assert d.peer.name == (d.student if me_teacher else d.teacher)
        assert d.peer.endpoint.startswith("127.0.0.1:")
        assert d.protocol == "akd" and len(d.directive_id) == 32
    students = [n for n, d in directives.items() if d.role == cpm_pb2.EXCHANGE_ROLE_STUDENT]
    assert len(students) == 2
    for n in students:
        d = directives[n]
        ack = await chans[n][1].ReportReward(
            cpm_pb2.ReportRewardRequest(
                directive_id=d.directive_id, reward=0.5, loss_pre=2.0, loss_post=1.5, kilobytes=3
            )
        )
        assert ack.directive_id == d.directive_id and ack.bandit_updates >= 1
    stats = await admin.GetStats(cpm_pb2.GetStatsRequest())
    assert stats.rewards_observed >= 2 and stats.matchmaking_rounds >= 1
    assert {a.name for a in stats.agents} >= {"a0", "a1", "a2", "a3"}
    assert _metric(cpm, "peerlm_cpm_rewards_observed_total") >= 2
    assert (
        _metric(
            cpm,
            "peerlm_grpc_server_requests_total",
            method="/peerlm.v1.Matchmaker/ReportReward",
            code="OK",
        )
        >= 2
    )

    # Replay and wrong reporter, on a real directive.
    d = directives[students[0]]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await chans[students[0]][1].ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.5)
        )
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    other = directives[students[1]]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await chans[students[0]][1].ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=other.directive_id, reward=0.5)
        )
    assert e.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS)
    assert (
        _metric(cpm, "peerlm_cpm_rejected_requests_total", rpc="ReportReward", reason="replayed")
        >= 1
    )
    after = await admin.GetStats(cpm_pb2.GetStatsRequest())
    assert after.bandit_updates == stats.bandit_updates
    for ch, _ in chans.values():
        await ch.close()
    await admin_ch.close()


async def test_unpaired_agent_is_told_at_once(cpm: CpmProcess) -> None:
    """Three agents, one pair: the third gets an EXCHANGE_ROLE_UNMATCHED notice for the
    round its profile was considered in, instead of silence until its round timeout."""
    names = [f"a{i}" for i in (10, 11, 12)]
    chans = {n: cpm.pki.stub(cpm.target, n) for n in names}
    calls = {
        n: stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        for n, (_, stub) in chans.items()
    }
    reads = {n: asyncio.ensure_future(call.read()) for n, call in calls.items()}
    await asyncio.sleep(1.0)  # the feeds attach before the round runs (notices are not replayed)
    rounds = set()
    for i, (_, stub) in enumerate(chans.values()):
        resp = await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=1, features=_profile(10 + i))
        )
        rounds.add(resp.matchmaking_round)
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    got = {n: await asyncio.wait_for(r, 10) for n, r in reads.items()}
    unmatched = [n for n, d in got.items() if d.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED]
    assert len(unmatched) == 1
    notice = got[unmatched[0]]
    assert notice.directive_id == "" and notice.matchmaking_round in rounds
    for n, d in got.items():
        if n not in unmatched:
            assert n in (d.teacher, d.student) and len(d.directive_id) == 32
    for call in calls.values():
        call.cancel()
    for ch, _ in chans.values():
        await ch.close()
    await admin_ch.close()


async def test_teacher_cannot_report(cpm: CpmProcess) -> None:
    stubs = {}
    for i in (4, 5):
        _ch, stub = cpm.pki.stub(cpm.target, f"a{i}")
        stubs[f"a{i}"] = stub
        await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=1, features=_profile(i)))
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    call = stubs["a4"].StreamDirectives(cpm_pb2.StreamDirectivesRequest())
    d = await call.read()
    call.cancel()
    before = await admin.GetStats(cpm_pb2.GetStatsRequest())
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs[d.teacher].ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=1.0)
        )
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    after = await admin.GetStats(cpm_pb2.GetStatsRequest())
    assert after.bandit_updates == before.bandit_updates
    assert (
        _metric(
            cpm, "peerlm_cpm_rejected_requests_total", rpc="ReportReward", reason="not_receiver"
        )
        >= 1
    )
    await admin_ch.close()


async def _admin_stats(cpm: CpmProcess) -> cpm_pb2.CpmStats:
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        return await admin.GetStats(cpm_pb2.GetStatsRequest())
    finally:
        await ch.close()


def _state(stats: cpm_pb2.CpmStats) -> tuple[object, ...]:
    """What a refused request must leave unchanged."""
    agents = sorted((a.name, a.last_round) for a in stats.agents)
    return (stats.profiles_received, stats.bandit_updates, stats.rewards_observed, agents)


_GOOD = [0.5] * 32


@pytest.mark.parametrize(
    ("features", "code", "reason", "extra"),
    [
        ([0.5] * 31, grpc.StatusCode.INVALID_ARGUMENT, "profile_dim", {}),
        ([float("nan")] * 32, grpc.StatusCode.INVALID_ARGUMENT, "profile_values", {}),
        ([float("-inf")] + [0.0] * 31, grpc.StatusCode.INVALID_ARGUMENT, "profile_values", {}),
        # The protocol menu's declarations (services/cpm/menu.py) are bounded too.
        (_GOOD, grpc.StatusCode.INVALID_ARGUMENT, "param_space", {"parameter_space": "x" * 129}),
        (_GOOD, grpc.StatusCode.INVALID_ARGUMENT, "param_space", {"parameter_space": "a b"}),
        (_GOOD, grpc.StatusCode.INVALID_ARGUMENT, "protocols", {"protocols": ["akd", "akd"]}),
        (_GOOD, grpc.StatusCode.INVALID_ARGUMENT, "protocols", {"protocols": ["p"] * 17}),
        (_GOOD, grpc.StatusCode.INVALID_ARGUMENT, "protocols", {"protocols": ["AKD;drop"]}),
    ],
)
async def test_bad_profiles(
    cpm: CpmProcess,
    features: list[float],
    code: grpc.StatusCode,
    reason: str,
    extra: dict[str, object],
) -> None:
    labels = {"rpc": "SubmitProfile", "reason": reason}
    counted = _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels)
    before = _state(await _admin_stats(cpm))
    ch, stub = cpm.pki.stub(cpm.target, "a5")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=99, features=features, **extra)  # type: ignore[arg-type]
        )
    assert e.value.code() == code and e.value.details()
    await ch.close()
    assert _state(await _admin_stats(cpm)) == before
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels) == counted + 1


async def test_oversized_message_refused(cpm: CpmProcess) -> None:
    """Above max_message_bytes (4 MiB) the server refuses without parsing, and counts it;
    our own clients never send that much, so this client raises its send limit."""
    method = "/peerlm.v1.Matchmaker/SubmitProfile"
    counted = _metric(cpm, "peerlm_grpc_server_oversized_messages_total", method=method)
    before = _state(await _admin_stats(cpm))
    loose = GrpcLimits(max_message_bytes=64 * 1024 * 1024)
    ch = create_channel(cpm.target, loose, channel_credentials(cpm.pki.tls("a5")))
    stub = cpm_pb2_grpc.MatchmakerStub(ch)  # type: ignore[no-untyped-call]
    big = cpm_pb2.SubmitProfileRequest(round=1, features=[0.0] * 700_000)  # ~5.6 MB
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(big)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the limit" in (e.value.details() or "")
    huge = cpm_pb2.SubmitProfileRequest(round=1, features=[0.0] * 1_200_000)  # ~9.6 MB
    with pytest.raises(grpc.aio.AioRpcError) as e:  # gRPC's own cap, before any Python
        await stub.SubmitProfile(huge)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await ch.close()
    assert _metric(cpm, "peerlm_grpc_server_oversized_messages_total", method=method) == counted + 1
    assert _state(await _admin_stats(cpm)) == before
    # Our own channels refuse to send it at all (the same limit on the client side).
    own, own_stub = cpm.pki.stub(cpm.target, "a5")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await own_stub.SubmitProfile(big)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await own.close()


@pytest.mark.parametrize(
    ("directive_id", "reward", "code", "reason"),
    [
        ("zz", 1.0, grpc.StatusCode.INVALID_ARGUMENT, "directive_id"),
        ("0" * 32, float("nan"), grpc.StatusCode.INVALID_ARGUMENT, "non_finite"),
        ("0" * 32, 1.0, grpc.StatusCode.NOT_FOUND, "unknown_directive"),
    ],
)
async def test_bad_rewards(
    cpm: CpmProcess, directive_id: str, reward: float, code: grpc.StatusCode, reason: str
) -> None:
    labels = {"rpc": "ReportReward", "reason": reason}
    counted = _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels)
    before = _state(await _admin_stats(cpm))
    ch, stub = cpm.pki.stub(cpm.target, "a1")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=directive_id, reward=reward)
        )
    assert e.value.code() == code
    await ch.close()
    assert _state(await _admin_stats(cpm)) == before
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels) == counted + 1


async def test_roles_enforced(cpm: CpmProcess) -> None:
    ch, agent = cpm.pki.stub(cpm.target, "a0")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await agent.GetStats(cpm_pb2.GetStatsRequest())
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await agent.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    ch2, admin = cpm.pki.stub(cpm.target, "admin")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await admin.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=1, features=_profile(0)))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _metric(cpm, "peerlm_auth_refusals_total") >= 3
    await ch.close()
    await ch2.close()


async def test_foreign_ca_and_missing_cert_refused(cpm: CpmProcess) -> None:
    ch, stub = cpm.pki.stub(cpm.target, "a0", foreign=True)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=1, features=_profile(0)), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await ch.close()
    ca = (cpm.pki.root / "ca.crt").read_bytes()
    ch = grpc.aio.secure_channel(cpm.target, grpc.ssl_channel_credentials(root_certificates=ca))
    from peerlm.wire.v1 import cpm_pb2_grpc

    stub = cpm_pb2_grpc.MatchmakerStub(ch)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=1, features=_profile(0)), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await ch.close()
    ch = grpc.aio.insecure_channel(cpm.target)
    stub = cpm_pb2_grpc.MatchmakerStub(ch)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=1, features=_profile(0)), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await ch.close()


def test_insecure_dev_refuses_non_loopback(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerlm",
            "cpm",
            "--insecure-dev",
            "--listen",
            "0.0.0.0:0",
            "--db",
            str(tmp_path / "x.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "loopback" in out.stderr


def test_missing_tls_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerlm",
            "cpm",
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "x.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "TLS" in out.stderr or "tls" in out.stderr or "certificate" in out.stderr


async def test_insecure_dev_on_loopback_uses_metadata_identity(tmp_path: Path) -> None:
    import asyncio
    import subprocess
    import sys

    from peerlm.agent.cpm.client import CpmClient

    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peerlm",
            "cpm",
            "--insecure-dev",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--db",
            str(tmp_path / "x.db"),
            "--init",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if port_file.exists():
                break
            await asyncio.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text().strip()}"
        client = CpmClient(dev_context("peerlm", "dev1"), target)
        resp = await client.submit_profile(1, [0.1] * 32)
        assert resp.profiles_pending == 1
        await client.close()
        async with grpc.aio.insecure_channel(target) as anonymous:
            stub = cpm_pb2_grpc.MatchmakerStub(anonymous)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=1, features=[0.1] * 32))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert b"insecure" in err.lower()


async def test_the_agent_client_counts_handshake_refusals(cpm: CpmProcess) -> None:
    """The CPM refuses a foreign certificate in the handshake, where no server code runs:
    the agent's CPM client is the side that counts it."""
    from peerlm.agent.cpm.client import CpmClient

    from peerlm.metrics import new_registry

    foreign = cpm.pki.foreign
    creds = grpc.ssl_channel_credentials(
        root_certificates=(cpm.pki.root / "ca.crt").read_bytes(),
        private_key=(foreign / "a0.key").read_bytes(),
        certificate_chain=(foreign / "a0.crt").read_bytes(),
    )
    registry = new_registry()
    ctx = credentials_context(
        creds,
        PeerIdentity(FEDERATION, Role.AGENT, "a0"),
        limits=GrpcLimits(rpc_timeout_s=5),
        registry=registry,
    )
    client = CpmClient(ctx, cpm.target)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.submit_profile(1, _profile(0))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await client.close()
    failures = registry.get_sample_value(
        "peerlm_grpc_client_tls_failures_total",
        {"component": "agent", "reason": "refused_by_server"},
    )
    assert failures == 1


def _client(cpm: CpmProcess, agent: str, *, role: Role = Role.CPM) -> CpmClient:
    ctx = kit_context(cpm.pki.root, agent, limits=GrpcLimits(rpc_timeout_s=5))
    return CpmClient(ctx, cpm.target, role=role)


async def test_the_directive_feed_proves_it_comes_from_a_cpm(cpm: CpmProcess) -> None:
    """TLS shows the agent only that a federation member with the dialled host's SAN
    answered; the feed's proof (over the agent's nonce) shows it is a CPM."""
    admin_ch, admin = cpm.pki.stub(cpm.target, "admin")
    await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())  # nobody else pending
    a6, a7 = _client(cpm, "a6"), _client(cpm, "a7")
    await a6.submit_profile(1, _profile(6), "127.0.0.1:7006")
    await a7.submit_profile(1, _profile(7), "127.0.0.1:7007")
    await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    feed = a6.directives()
    directive = await asyncio.wait_for(anext(feed), 10)
    assert "a6" in (directive.teacher, directive.student)
    await feed.aclose()
    # Expecting a proof from another role (here: an agent) fails before any directive.
    wrong = _client(cpm, "a6", role=Role.AGENT)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(anext(wrong.directives()), 10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "wrong_sender" in (e.value.details() or "")
    # A proof made out to another agent does not cover us.
    # (a6's certificate, checking as if it were a7.)
    other = CpmClient(
        credentials_context(
            channel_credentials(cpm.pki.tls("a6")),
            PeerIdentity(FEDERATION, Role.AGENT, "a7"),
            sender_check=SenderCheck.from_pem((cpm.pki.root / "ca.crt").read_bytes(), FEDERATION),
        ),
        cpm.target,
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(anext(other.directives()), 10)
    assert "bad_signature" in (e.value.details() or "")
    for c in (a6, a7, wrong, other):
        await c.close()
    await admin_ch.close()


async def test_a_malformed_feed_nonce_is_refused_and_counted(cpm: CpmProcess) -> None:
    counted = _metric(
        cpm, "peerlm_cpm_rejected_requests_total", rpc="StreamDirectives", reason="bad_nonce"
    )
    ch, stub = cpm.pki.stub(cpm.target, "a5")
    call = stub.StreamDirectives(
        cpm_pb2.StreamDirectivesRequest(), metadata=((FEED_NONCE_METADATA, "not hex"),)
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await ch.close()
    after = _metric(
        cpm, "peerlm_cpm_rejected_requests_total", rpc="StreamDirectives", reason="bad_nonce"
    )
    assert after == counted + 1


async def test_an_unreachable_cpm_is_retried_not_taken_for_an_impostor(cpm: CpmProcess) -> None:
    client = CpmClient(kit_context(cpm.pki.root, "a5"), "127.0.0.1:1")
    with pytest.raises(TimeoutError):  # still retrying: no error, no directive
        await asyncio.wait_for(anext(client.directives(max_backoff_s=0.2)), 2)
    await client.close()
