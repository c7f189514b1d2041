"""``peer_endpoint`` is a claim an agent makes about itself. A real CPM
process (mTLS on loopback) refuses one whose port is not a TCP port and one whose host is
not a DNS or IP SAN of the caller's certificate (another agent's address), counts both,
keeps no trace of the refused profile, and accepts an endpoint the certificate names."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from peerlm.pki.ca import issue_certificate
from peerlm.pki.identity import Role
from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import CpmProcess, Pki
from tests.overlay_process_harness import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cpm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpmProcess]:
    tmp = tmp_path_factory.mktemp("endpoint")
    pki = Pki.create(tmp, agents=2)  # a0, a1: SANs 127.0.0.1 and localhost
    issue_certificate(pki.root, Role.AGENT, "far", sans=["far.example.org"])
    proc = CpmProcess(pki, tmp / "cpm.db", tmp, metrics_port=free_port()).start()
    yield proc
    proc.terminate()


def _rejected(cpm: CpmProcess, reason: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cpm.metrics_port}/metrics", timeout=10)
    for line in body.read().decode().splitlines():
        if line.startswith("peerlm_cpm_rejected_requests_total{") and (
            f'reason="{reason}"' in line and 'rpc="SubmitProfile"' in line
        ):
            return float(line.rpartition(" ")[2])
    return 0.0


async def _submit(cpm: CpmProcess, name: str, endpoint: str) -> grpc.StatusCode:
    channel, stub = cpm.pki.stub(cpm.target, name)
    try:
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(round=1, features=[0.1] * 32, peer_endpoint=endpoint),
            timeout=10,
        )
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        return err.code()
    finally:
        await channel.close(None)


async def _agents(cpm: CpmProcess) -> dict[str, str]:
    channel, stub = cpm.pki.stub(cpm.target, "admin")
    try:
        stats = await stub.GetStats(cpm_pb2.GetStatsRequest(), timeout=10)
        return {a.name: a.peer_endpoint for a in stats.agents}
    finally:
        await channel.close(None)


def test_an_endpoint_outside_the_certificate_or_with_a_bad_port_is_refused(
    cpm: CpmProcess,
) -> None:
    async def run() -> None:
        # Another agent's address, and a name this certificate does not carry.
        assert await _submit(cpm, "a1", "far.example.org:7000") == grpc.StatusCode.PERMISSION_DENIED
        assert await _submit(cpm, "a1", "10.0.0.7:7000") == grpc.StatusCode.PERMISSION_DENIED
        assert await _submit(cpm, "a1", "127.0.0.1:99999") == grpc.StatusCode.INVALID_ARGUMENT
        assert "a1" not in await _agents(cpm)
        assert _rejected(cpm, "endpoint_not_certified") == 2
        assert _rejected(cpm, "endpoint") == 1
        # What the certificates name is accepted, for each agent its own.
        assert await _submit(cpm, "a1", "localhost:7001") == grpc.StatusCode.OK
        assert await _submit(cpm, "far", "far.example.org:7000") == grpc.StatusCode.OK
        assert await _agents(cpm) == {"a1": "localhost:7001", "far": "far.example.org:7000"}

    asyncio.run(run())


def test_no_endpoint_is_still_allowed(cpm: CpmProcess) -> None:
    """An agent that cannot teach advertises nothing."""
    assert asyncio.run(_submit(cpm, "a0", "")) == grpc.StatusCode.OK
