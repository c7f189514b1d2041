"""Agent-side recovery against real CPM processes.

* A reward in flight while the CPM restarts is retried with the same directive id and is
  learnt exactly once (before, the agent dropped it on UNAVAILABLE).
* An agent that restarts with fresh state (or an older checkpoint) numbers its rounds
  from an older one; the CPM refuses that profile (``stale_round``) and names its last
  round, and the agent resynchronises instead of ending its run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from peerlm.agent.cpm.client import CpmClient
from prometheus_client import CollectorRegistry

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki
from tests.node_contexts import kit_context
from tests.ports import free_port

pytestmark = pytest.mark.integration

MANUAL = {"PEERLM_CPM_MIN_QUORUM": "1000", "PEERLM_CPM_ROUND_INTERVAL_S": "3600"}


def _client(cpm: CpmProcess, name: str, registry: CollectorRegistry) -> CpmClient:
    ctx = kit_context(cpm.pki.root, name, registry=registry)
    return CpmClient(ctx, cpm.target, reward_retry_s=60)


def _count(registry: CollectorRegistry, kind: str) -> float:
    value = registry.get_sample_value("peerlm_agent_cpm_recoveries_total", {"kind": kind})
    return value or 0.0


async def _stats(cpm: CpmProcess) -> cpm_pb2.CpmStats:
    ch, admin = cpm.pki.stub(cpm.target, "admin")
    try:
        return await admin.GetStats(cpm_pb2.GetStatsRequest())
    finally:
        await ch.close()


async def test_a_reward_in_flight_survives_a_cpm_restart(tmp_path: Path) -> None:
    cpm = CpmProcess(
        Pki.create(tmp_path, agents=2),
        tmp_path / "cpm.db",
        tmp_path,
        MANUAL,
        listen=f"127.0.0.1:{free_port()}",
    ).start()
    registries = {a: CollectorRegistry() for a in ("a0", "a1")}  # one per agent process
    clients = {a: _client(cpm, a, registries[a]) for a in ("a0", "a1")}
    try:
        for c in clients.values():
            await c.submit_profile(1, [0.3] * 32)
        ch, admin = cpm.pki.stub(cpm.target, "admin")
        await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
        await ch.close()
        feed = clients["a0"]._stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        d = await feed.read()
        feed.cancel()
        cpm.kill()
        report = asyncio.ensure_future(clients[d.student].report_reward(d.directive_id, 0.4))
        await asyncio.sleep(1.5)
        assert not report.done()  # retrying against a CPM that is down
        await asyncio.get_running_loop().run_in_executor(None, cpm.start)
        ack = await asyncio.wait_for(report, 60)
        assert ack.directive_id == d.directive_id
        assert _count(registries[d.student], "reward_retry") >= 1
        assert (await _stats(cpm)).bandit_updates == 1
        # Sent again by a confused agent: refused, learnt once.
        with pytest.raises(Exception, match="ALREADY_EXISTS"):
            await clients[d.student].report_reward(d.directive_id, 0.4)
        assert (await _stats(cpm)).bandit_updates == 1
    finally:
        for c in clients.values():
            await c.close()
        if cpm.proc is not None and cpm.proc.poll() is None:
            assert cpm.terminate() == 0


async def test_an_agent_restarted_with_fresh_state_resynchronises(tmp_path: Path) -> None:
    cpm = CpmProcess(Pki.create(tmp_path, agents=1), tmp_path / "cpm.db", tmp_path, MANUAL)
    cpm.start()
    try:
        first = _client(cpm, "a0", CollectorRegistry())
        for t in range(1, 6):
            await first.submit_profile(t, [0.1] * 32)
        await first.close()
        # The agent process restarts from scratch (or an older checkpoint): round 1 again.
        registry = CollectorRegistry()
        again = _client(cpm, "a0", registry)
        await again.submit_profile(1, [0.2] * 32)
        assert again.round_offset == 5
        assert _count(registry, "round_resync") == 1
        [agent] = (await _stats(cpm)).agents
        assert agent.last_round == 6
        await again.submit_profile(2, [0.2] * 32)  # later rounds keep the offset
        [agent] = (await _stats(cpm)).agents
        assert agent.last_round == 7 and _count(registry, "round_resync") == 1
        await again.close()
    finally:
        assert cpm.terminate() == 0
    assert '"reason": "stale_round"' in cpm.log()
