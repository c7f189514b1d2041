"""Overlay narrowing on the wire: a real CPM process recommending merges only.

Agents report their overlay top-K with the profile (``SubmitProfileRequest.overlay_peers``);
a merge directive names a sender from the student's list. Bad lists are refused
(INVALID_ARGUMENT, counted), the stored profile unchanged.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki
from tests.ports import free_port

pytestmark = pytest.mark.integration

N = 6
NAMES = [f"a{k}" for k in range(N)]


@pytest.fixture(scope="module")
def cpm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    tmp = tmp_path_factory.mktemp("cpm")
    env = {
        "PEERLM_CPM_MIN_QUORUM": "1000",
        "PEERLM_CPM_ROUND_INTERVAL_S": "3600",
        "PEERLM_CPM_PROTOCOLS": json.dumps(["pmix", "svd_hka"]),
    }
    proc = CpmProcess(Pki.create(tmp, agents=N), tmp / "cpm.db", tmp, env, metrics_port=free_port())
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


def _request(k: int, round_: int, overlay: list[str]) -> cpm_pb2.SubmitProfileRequest:
    return cpm_pb2.SubmitProfileRequest(
        round=round_,
        features=[float(x) for x in np.random.default_rng(k).uniform(0, 1, 32)],
        parameter_space="ps-tiny",
        protocols=["pmix", "svd_hka"],
        overlay_peers=overlay,
    )


async def _state(cpm: CpmProcess) -> tuple[object, ...]:
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    stats = await admin.GetStats(cpm_pb2.GetStatsRequest())
    await ch.close()
    return stats.profiles_received, sorted((a.name, a.last_round) for a in stats.agents)


async def test_merge_directives_name_only_overlay_senders(cpm: CpmProcess) -> None:
    stubs = {n: cpm.pki.stub(cpm.target, n) for n in NAMES}
    for k, n in enumerate(NAMES):  # first known to the CPM, then they may be named
        await stubs[n][1].SubmitProfile(_request(k, 1, []))
    overlay = {n: [NAMES[(k + 1) % N], NAMES[(k + 2) % N]] for k, n in enumerate(NAMES)}
    checked = 0
    for rnd in (2, 3, 4):
        for k, n in enumerate(NAMES):
            await stubs[n][1].SubmitProfile(_request(k, rnd, overlay[n]))
        # Feeds attached before the round, so the unpaired hear so at once.
        calls = {n: stubs[n][1].StreamDirectives(cpm_pb2.StreamDirectivesRequest()) for n in NAMES}
        await asyncio.sleep(1.0)
        ch, admin = cpm.pki.stub(cpm.target, "admin")
        out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
        await ch.close()
        assert out.pairs >= 1
        for n, call in calls.items():
            while True:  # skip the replay of earlier rounds' directives
                d = await asyncio.wait_for(call.read(), 10)
                if d.matchmaking_round >= out.matchmaking_round:
                    break
            call.cancel()
            if d.role != cpm_pb2.EXCHANGE_ROLE_STUDENT:
                continue
            assert d.protocol in ("pmix", "svd_hka")
            assert d.teacher in overlay[d.student], (d.teacher, d.student, overlay[d.student])
            checked += 1
            await stubs[n][1].ReportReward(
                cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=1.0)
            )
    assert checked >= 3
    for ch, _ in stubs.values():
        await ch.close()


@pytest.mark.parametrize(
    "overlay",
    [
        [f"a{k % N}x{k}" for k in range(65)],  # oversized
        ["a1", "ghost"],  # unknown id
        ["a1", "a1"],  # repeated
        ["a0"],  # itself
    ],
    ids=["oversized", "unknown", "repeated", "itself"],
)
async def test_bad_overlay_lists_are_refused_and_change_nothing(
    cpm: CpmProcess, overlay: list[str]
) -> None:
    ch, stub = cpm.pki.stub(cpm.target, "a0")
    await stub.SubmitProfile(_request(0, 10, []))  # a0 and a1 known from here on
    ch1, stub1 = cpm.pki.stub(cpm.target, "a1")
    await stub1.SubmitProfile(_request(1, 10, []))
    labels = {"rpc": "SubmitProfile", "reason": "overlay_peers"}
    counted = _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels)
    before = await _state(cpm)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitProfile(_request(0, 11, overlay))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await _state(cpm) == before
    assert _metric(cpm, "peerlm_cpm_rejected_requests_total", **labels) == counted + 1
    await ch.close()
    await ch1.close()


async def test_the_agent_client_drops_a_refused_overlay_list(cpm: CpmProcess) -> None:
    """A neighbour the CPM does not know yet (it has sent no profile) must not cost the
    agent its profile: the client submits again without the list, and counts it."""
    from peerlm.agent.cpm.client import CpmClient

    from peerlm.config import GrpcLimits
    from peerlm.pki.identity import Role
    from tests.node_contexts import kit_context

    ctx = kit_context(cpm.pki.root, "a3", limits=GrpcLimits(rpc_timeout_s=5))
    client = CpmClient(ctx, cpm.target, role=Role.CPM)
    req = _request(3, 20, [])
    resp = await client.submit_profile(
        20,
        list(req.features),
        parameter_space=req.parameter_space,
        protocols=list(req.protocols),
        overlay_peers=["a4", "not-yet-here"],
    )
    assert resp.matchmaking_round >= 1
    stats = await _state(cpm)
    assert ("a3", 20) in stats[1]
    dropped = ctx.registry.get_sample_value(
        "peerlm_agent_cpm_recoveries_total", {"kind": "overlay_peers_dropped"}
    )
    assert dropped == 1
    await client.close()


@pytest.fixture(scope="module")
def cpm_multi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    """A CPM whose merge directives name up to three senders (``merge_senders``)."""
    tmp = tmp_path_factory.mktemp("cpm-multi")
    env = {
        "PEERLM_CPM_MIN_QUORUM": "1000",
        "PEERLM_CPM_ROUND_INTERVAL_S": "3600",
        "PEERLM_CPM_PROTOCOLS": json.dumps(["pmix", "svd_hka"]),
        "PEERLM_CPM_MERGE_SENDERS": "3",
    }
    proc = CpmProcess(Pki.create(tmp, agents=N), tmp / "cpm.db", tmp, env, metrics_port=free_port())
    proc.start()
    yield proc
    assert proc.terminate() == 0, proc.log()[-3000:]


async def test_merge_directives_name_co_senders_from_the_overlay(cpm_multi: CpmProcess) -> None:
    """On the wire: a student's merge directive names its teacher and up to two
    co-senders (with their endpoints), all from the student's overlay list, none repeated,
    none the student; one reward per directive is accepted as before."""
    cpm = cpm_multi
    stubs = {n: cpm.pki.stub(cpm.target, n) for n in NAMES}
    for k, n in enumerate(NAMES):
        await stubs[n][1].SubmitProfile(_request(k, 1, []))
    overlay = {n: [NAMES[(k + j) % N] for j in (1, 2, 3)] for k, n in enumerate(NAMES)}
    endpoints: dict[str, str] = {}
    for k, n in enumerate(NAMES):
        req = _request(k, 2, overlay[n])
        req.peer_endpoint = endpoints.setdefault(n, f"127.0.0.1:{7100 + k}")
        await stubs[n][1].SubmitProfile(req)
    calls = {n: stubs[n][1].StreamDirectives(cpm_pb2.StreamDirectivesRequest()) for n in NAMES}
    await asyncio.sleep(1.0)
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    out = await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    await ch.close()
    students = 0
    for n, call in calls.items():
        d = await asyncio.wait_for(call.read(), 10)
        call.cancel()
        if d.role != cpm_pb2.EXCHANGE_ROLE_STUDENT:
            continue
        students += 1
        senders = [d.teacher, *(c.name for c in d.co_senders)]
        assert len(d.co_senders) == 2, d  # three listed, all of one space: the list fills
        assert len(set(senders)) == 3 and d.student not in senders
        assert set(senders) <= set(overlay[d.student])
        assert all(c.endpoint == endpoints[c.name] for c in d.co_senders)
        ack = await stubs[n][1].ReportReward(
            cpm_pb2.ReportRewardRequest(directive_id=d.directive_id, reward=0.5)
        )
        assert ack.bandit_updates >= 1
    assert students == out.pairs >= 1
    for c, _ in stubs.values():
        await c.close()
