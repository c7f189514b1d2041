"""Refused exchanges on the wire: a real CPM process, real certificates.

A student that refuses a directive reports ``ReportRewardRequest.failure``; the CPM
authorises it as a reward (only the directive's student, once), commits it in the ledger,
counts it in ``peerlm_cpm_exchange_refusals_total{reason,protocol}`` and updates the bandit
with ``refusal_reward``. Bad refusals leave the state unchanged and are counted.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from peerlm.agent.cpm.client import CpmClient

from peerlm.config import GrpcLimits
from peerlm.pki.identity import Role
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc
from tests.cpm_harness import CpmProcess, Pki
from tests.node_contexts import kit_context
from tests.ports import free_port

pytestmark = pytest.mark.integration

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}
FAILED = cpm_pb2.EXCHANGE_FAILURE_PARAMETER_SPACE


@pytest.fixture(scope="module")
def cpm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    tmp = tmp_path_factory.mktemp("cpm")
    env = {**MANUAL, "PEERLM_CPM_REFUSAL_REWARD": "-0.5"}
    proc = CpmProcess(Pki.create(tmp, agents=8), tmp / "cpm.db", tmp, env, metrics_port=free_port())
    proc.start()
    yield proc
    assert proc.terminate() == 0, proc.log()[-3000:]


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


async def _stats(cpm: CpmProcess) -> cpm_pb2.CpmStats:
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        return await admin.GetStats(cpm_pb2.GetStatsRequest())
    finally:
        await ch.close()


async def _pair(
    cpm: CpmProcess, a: str, b: str, round_: int
) -> tuple[cpm_pb2.Directive, dict[str, cpm_pb2_grpc.MatchmakerStub], list[grpc.aio.Channel]]:
    """Profiles of ``a`` and ``b`` (for ``round_`` or past their last), one matchmaking
    round; their directive and stubs."""
    last = {x.name: x.last_round for x in (await _stats(cpm)).agents}
    round_ = max(round_, last.get(a, 0) + 1, last.get(b, 0) + 1)
    stubs, chans = {}, []
    for i, name in enumerate((a, b)):
        ch, stub = cpm.pki.stub(cpm.target, name)
        stubs[name], chans = stub, [*chans, ch]
        features = [float(x) for x in np.random.default_rng(round_ * 10 + i).uniform(0, 1, 32)]
        await stub.SubmitProfile(cpm_pb2.SubmitProfileRequest(round=round_, features=features))
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    await ch.close()
    assert out.pairs == 1
    call = stubs[a].StreamDirectives(cpm_pb2.StreamDirectivesRequest())
    d = await call.read()
    call.cancel()
    return d, stubs, chans


async def test_a_refusal_is_acknowledged_once_and_counted(cpm: CpmProcess) -> None:
    d, stubs, chans = await _pair(cpm, "a0", "a1", 1)
    student = stubs[d.student]
    before = await _stats(cpm)
    counted = _metric(cpm, "peerlm_cpm_exchange_refusals_total", reason="parameter_space")
    ack = await student.ReportReward(
        cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, kilobytes=7, failure=FAILED)
    )
    assert ack.directive_id == d.directive_id
    assert ack.bandit_updates == before.bandit_updates + 1
    after = await _stats(cpm)
    assert after.bandit_updates == before.bandit_updates + 1 and after.directives_open == 0
    teacher = next(x for x in after.agents if x.name == d.teacher)
    assert (teacher.exchanges, teacher.successes) == (1, 0)  # a refusal is no success
    assert (
        _metric(cpm, "peerlm_cpm_exchange_refusals_total", reason="parameter_space", protocol="akd")
        == counted + 1
    )
    # Once: the retry of the refusal, then a reward after it, are ALREADY_EXISTS.
    replayed = _metric(cpm, "peerlm_cpm_rejected_requests_total", reason="replayed")
    for req in (
        cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, failure=FAILED),
        cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.5),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await student.ReportReward(req)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", reason="replayed") == replayed + 2
    assert (await _stats(cpm)).bandit_updates == after.bandit_updates
    for ch in chans:
        await ch.close()


@pytest.mark.parametrize(
    ("who", "failure", "reward", "code", "reason"),
    [
        ("student", 99, 0.0, grpc.StatusCode.INVALID_ARGUMENT, "failure_reason"),
        ("student", FAILED, 0.25, grpc.StatusCode.INVALID_ARGUMENT, "failure_with_reward"),
        ("teacher", FAILED, 0.0, grpc.StatusCode.PERMISSION_DENIED, "not_receiver"),
        ("a4", FAILED, 0.0, grpc.StatusCode.PERMISSION_DENIED, "not_receiver"),
    ],
)
async def test_bad_refusals_change_nothing_and_are_counted(
    cpm: CpmProcess, who: str, failure: int, reward: float, code: grpc.StatusCode, reason: str
) -> None:
    d, stubs, chans = await _pair(cpm, "a2", "a3", 1)
    name = {"student": d.student, "teacher": d.teacher}.get(who, who)
    ch, stub = cpm.pki.stub(cpm.target, name)
    labels = {"rpc": "ReportReward", "reason": reason}
    counted = _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels)
    before = await _stats(cpm)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportReward(
            cpm_pb2.ReportRewardRequest(
                directive_id=d.directive_id,
                reward=reward,
                failure=failure,  # type: ignore[arg-type]
            )
        )
    assert e.value.code() == code
    after = await _stats(cpm)
    assert (after.bandit_updates, after.directives_open) == (
        before.bandit_updates,
        before.directives_open,
    )
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels) == counted + 1
    # The directive is still the student's to report.
    ack = await stubs[d.student].ReportReward(
        cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, failure=FAILED)
    )
    assert ack.bandit_updates == before.bandit_updates + 1
    for c in (*chans, ch):
        await c.close()


async def test_the_agent_client_reports_a_refusal_on_the_reward_stream(cpm: CpmProcess) -> None:
    d, _, chans = await _pair(cpm, "a6", "a7", 1)
    client = CpmClient(
        kit_context(cpm.pki.root, d.student, limits=GrpcLimits(rpc_timeout_s=5)),
        cpm.target,
        role=Role.CPM,
    )
    counted = _metric(cpm, "peerlm_cpm_exchange_refusals_total", reason="sender_proof")
    ack = await client.report_reward(
        d.directive_id, 0.0, failure=cpm_pb2.EXCHANGE_FAILURE_SENDER_PROOF
    )
    assert ack.directive_id == d.directive_id and ack.bandit_updates >= 1
    assert _metric(cpm, "peerlm_cpm_exchange_refusals_total", reason="sender_proof") == counted + 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.report_reward(
            d.directive_id, 0.0, failure=cpm_pb2.EXCHANGE_FAILURE_SENDER_PROOF
        )
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (
        _metric(cpm, "peerlm_cpm_rejected_requests_total", rpc="ReportRewards", reason="replayed")
        >= 1
    )
    await client.close()
    for ch in chans:
        await ch.close()
