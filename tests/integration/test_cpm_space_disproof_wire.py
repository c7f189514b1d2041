"""A disproved parameter-space fingerprint on the wire: a real CPM process, the agent's client.

Merges only (``pmix``): two agents declare one fingerprint and are paired; the student
finds the teacher's adapter of another space and names it in
``ReportRewardRequest.space_mismatch`` through :class:`~peerlm.agent.cpm.client.CpmClient`.
The CPM records the disproof (``peerlm_cpm_space_disproofs_total``) and never pairs the
two for a merge again. A report naming an agent that is not a sender of the directive is
refused (INVALID_ARGUMENT, reason ``space_mismatch``, counted), the state unchanged.
"""

from __future__ import annotations

import json
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

SPACE = "ps1:declared-by-both"
FAILED = cpm_pb2.EXCHANGE_FAILURE_PARAMETER_SPACE


@pytest.fixture(scope="module")
def cpm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    tmp = tmp_path_factory.mktemp("cpm")
    env = {
        "PEERLM_CPM_MIN_QUORUM": "1000",
        "PEERLM_CPM_ROUND_INTERVAL_S": "3600",
        "PEERLM_CPM_PROTOCOLS": json.dumps(["pmix"]),
    }
    proc = CpmProcess(Pki.create(tmp, agents=4), tmp / "cpm.db", tmp, env, metrics_port=free_port())
    proc.start()
    yield proc
    assert proc.terminate() == 0, proc.log()[-3000:]


def _metric(cpm: CpmProcess, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cpm.metrics_port}/metrics").read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name):
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


async def _round(
    cpm: CpmProcess, names: tuple[str, str], stubs: dict[str, cpm_pb2_grpc.MatchmakerStub]
) -> int:
    """Both agents submit a profile declaring :data:`SPACE` (one round past their last);
    one matchmaking round; how many pairs it made."""
    last = {x.name: x.last_round for x in (await _stats(cpm)).agents}
    for i, name in enumerate(names):
        round_ = last.get(name, 0) + 1
        await stubs[name].SubmitProfile(
            cpm_pb2.SubmitProfileRequest(
                round=round_,
                features=[float(x) for x in np.random.default_rng(i).uniform(0, 1, 32)],
                parameter_space=SPACE,
                protocols=["akd", "pmix"],
            )
        )
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    finally:
        await ch.close()
    return int(out.pairs)


async def _directive(stub: cpm_pb2_grpc.MatchmakerStub) -> cpm_pb2.Directive:
    call = stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest())
    d: cpm_pb2.Directive = await call.read()
    call.cancel()
    return d


async def test_a_disproved_teacher_is_never_paired_with_its_student_again(
    cpm: CpmProcess,
) -> None:
    names = ("a0", "a1")
    chans, stubs = {}, {}
    for n in names:
        chans[n], stubs[n] = cpm.pki.stub(cpm.target, n)
    assert await _round(cpm, names, stubs) == 1
    d = await _directive(stubs["a0"])
    assert d.protocol == "pmix"
    client = CpmClient(
        kit_context(cpm.pki.root, d.student, limits=GrpcLimits(rpc_timeout_s=5)),
        cpm.target,
        role=Role.CPM,
    )
    recorded = _metric(cpm, "peerlm_cpm_space_disproofs_total")
    ack = await client.report_reward(
        d.directive_id, 0.0, failure=FAILED, space_mismatch=[d.teacher]
    )
    assert ack.directive_id == d.directive_id
    assert _metric(cpm, "peerlm_cpm_space_disproofs_total") == recorded + 1
    # Both still declare the same fingerprint, but the student disproved the teacher's:
    # no merge between them, in either role (merges are all this CPM recommends).
    assert await _round(cpm, names, stubs) == 0
    await client.close()
    for ch in chans.values():
        await ch.close()


async def test_naming_an_agent_that_sent_nothing_is_refused_and_counted(cpm: CpmProcess) -> None:
    names = ("a2", "a3")
    chans, stubs = {}, {}
    for n in names:
        chans[n], stubs[n] = cpm.pki.stub(cpm.target, n)
    assert await _round(cpm, names, stubs) == 1
    d = await _directive(stubs["a2"])
    labels = {"rpc": "ReportReward", "reason": "space_mismatch"}
    refused = _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels)
    recorded = _metric(cpm, "peerlm_cpm_space_disproofs_total")
    before = await _stats(cpm)
    for named in (["a0"], [d.teacher, d.teacher], [d.student]):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stubs[d.student].ReportReward(
                cpm_pb2.ReportRewardRequest(
                    directive_id=d.directive_id, failure=FAILED, space_mismatch=named
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "space_mismatch" in (e.value.details() or "")
    after = await _stats(cpm)
    assert (after.bandit_updates, after.directives_open) == (
        before.bandit_updates,
        before.directives_open,
    )
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels) == refused + 3
    assert _metric(cpm, "peerlm_cpm_space_disproofs_total") == recorded
    # The directive is still the student's to report, and a plain reward names nobody.
    ack = await stubs[d.student].ReportReward(
        cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.1)
    )
    assert ack.bandit_updates == before.bandit_updates + 1
    assert await _round(cpm, names, stubs) == 1
    for ch in chans.values():
        await ch.close()
