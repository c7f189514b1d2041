"""A FedWave expert's adapter leaves it only over the FedWave exchange (hostile-member audit).

The expert's LoRA adapter is trained on its stage's private examples. The FedWave exchange
serves it only to the agents of the workflow's other stages (``decide_pull``), but the same
peer port also serves ``PeerExchange.PullAdapter``, which answers *any* authenticated agent
with the host's current adapter (the overlay's and the merge directives' pulls need that). A
FedWave expert takes part in neither, so without a gate any member of the federation, inside
the workflow or not, could pull the expert's adapter round by round there.

A real ``peerlm agent`` process (micro gpt2, agent a1 of the workflow, its peers never
listen) and real mTLS callers: an outsider (a federation member outside the workflow) and a2
(an agent of another stage of the workflow) both ask ``PullAdapter``; both are refused
PERMISSION_DENIED, counted in ``peerlm_agent_peer_refusals_total{rpc="PullAdapter",
reason="fedwave_expert"}``, and no adapter byte is sent.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest

from peerlm.forkserver import ForkServer
from peerlm.pki.ca import issue_certificate
from peerlm.pki.identity import Role
from peerlm.wire.v1 import peer_pb2, peer_pb2_grpc
from tests.integration.test_fedwave_agents import _events, _lone_expert, _wait_for
from tests.node_contexts import kit_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _pull_adapter(pki: Path, name: str, endpoint: str) -> tuple[grpc.StatusCode, int]:
    """``name``'s PullAdapter at ``endpoint``: (status code, adapter bytes received)."""

    async def pull() -> tuple[grpc.StatusCode, int]:
        received = 0
        async with kit_context(pki, name).dial(endpoint) as peer:
            stub = peer_pb2_grpc.PeerExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
            try:
                async for chunk in stub.PullAdapter(
                    peer_pb2.PullAdapterRequest(round=0), timeout=20
                ):
                    received += len(chunk.data)
            except grpc.aio.AioRpcError as err:
                return err.code(), received
        return grpc.StatusCode.OK, received

    return asyncio.run(pull())


def test_a_fedwave_experts_adapter_is_not_served_by_pull_adapter(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    proc, log, cpm = _lone_expert(
        agent_forks, tmp_path, {"rounds": 3, "stop_grace_s": 1}, {"round_deadline_s": 600}
    )
    pki = tmp_path / "pki"
    issue_certificate(pki, Role.AGENT, "outsider", sans=["127.0.0.1"])
    endpoint = json.loads((tmp_path / "a1.yaml").read_text())["listen"]
    try:
        _wait_for(
            lambda: (
                any(e.get("event") == "agent_ready" for e in _events(log))
                or proc.poll() is not None
            ),
            180,
            "agent ready",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        results = {name: _pull_adapter(pki, name, endpoint) for name in ("outsider", "a2")}
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cpm.terminate()
    assert results == {
        "outsider": (grpc.StatusCode.PERMISSION_DENIED, 0),
        "a2": (grpc.StatusCode.PERMISSION_DENIED, 0),
    }
    refused = [
        e
        for e in _events(log)
        if e.get("event") == "peer_request_refused" and e.get("rpc") == "PullAdapter"
    ]
    assert sorted(e["peer"] for e in refused) == ["a2", "outsider"]
    assert {e["reason"] for e in refused} == {"fedwave_expert"}
    assert not any(e.get("event") == "adapter_sent" for e in _events(log))


def _pull_part(pki: Path, name: str, endpoint: str, round_: int) -> tuple[grpc.StatusCode, int]:
    """``name``'s FedWave PullPart of the adapter of ``round_``: (status code, bytes)."""
    from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc

    async def pull() -> tuple[grpc.StatusCode, int]:
        received = 0
        async with kit_context(pki, name).dial(endpoint) as peer:
            stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
            request = fedwave_pb2.PullPartRequest(round=round_, kind=fedwave_pb2.PART_KIND_ADAPTER)
            try:
                async for chunk in stub.PullPart(request, timeout=20):
                    received += len(chunk.data)
            except grpc.aio.AioRpcError as err:
                return err.code(), received
        return grpc.StatusCode.OK, received

    return asyncio.run(pull())


def test_only_the_last_rounds_adapter_is_published(tmp_path: Path, agent_forks: ForkServer) -> None:
    """The other stages assemble π_SFT from the expert's *last* adapter; the adapters of
    the rounds before would give them its training step by step (one round's update is a
    round's gradients on the stage's private examples). a1 plays 2 rounds with the
    assembly on; once round 2 is done, a2 (another stage, entitled to the expert) asks
    for the adapter of round 1 (still kept: the newest 2 rounds are) and of round 2:
    round 1 has none (NOT_FOUND, ``no_part``), round 2's is served."""
    proc, log, cpm = _lone_expert(
        agent_forks,
        tmp_path,
        {"rounds": 2, "batch_size": 4, "max_length": 128, "stop_grace_s": 1},
        {
            "round_deadline_s": 2,
            "assembly": {"enabled": True, "deadline_s": 60, "dpo_steps": 0, "max_new_tokens": 4},
        },
    )
    pki = tmp_path / "pki"
    endpoint = json.loads((tmp_path / "a1.yaml").read_text())["listen"]
    try:
        _wait_for(
            lambda: (
                any(
                    e.get("event") == "fedwave_round_done" and e.get("round") == 2
                    for e in _events(log)
                )
                or proc.poll() is not None
            ),
            240,
            "round 2 done",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        # The assembly's pulls now wait up to 60 s for the (absent) other stages.
        results = {t: _pull_part(pki, "a2", endpoint, t) for t in (1, 2)}
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cpm.terminate()
    assert results[1] == (grpc.StatusCode.NOT_FOUND, 0)
    assert results[2][0] == grpc.StatusCode.OK and results[2][1] > 0
