"""An admitted member that pulls FedProxy proxies and FedWave parts and reads none of them
cannot grow the server's memory, nor stop another member from being served.

A member of an owner's cohort (and of a FedWave workflow) is admitted, not trusted. Here a
real peer-server process (``peer_server_process``: ``PeerExchange``, FedWave's
``FedWaveExchange`` and FedProxy's ``ProxyExchange`` on one mTLS port, as the agent serves
them, an 8 MiB proxy and 8 MiB parts in 1 MiB chunks) is flooded by one member, ``hostile``:
``FLOOD_STREAMS`` streams, ``PullProxy`` and ``PullPart`` in turn, from a reader process
(``slow_reader_process``) that reads one chunk of each and stops (SIGSTOP). Asserted, from
outside the server:

* the server admits at most ``max_calls_per_identity`` of them; the rest are refused
  (RESOURCE_EXHAUSTED) and counted in ``peerlm_auth_refusals_total{reason="identity_limit"}``
  for the FedProxy and FedWave methods;
* its resident memory never exceeds its idle figure plus a bound from the configuration:
  twice (the hostile member's share of the send budget, the honest member's share and one
  chunk) plus a per-call allowance;
* meanwhile the honest member pulls the whole proxy and a whole part;
* the stalled streams are cut off and counted
  (``peerlm_agent_peer_send_cutoffs_total{rpc="PullProxy"|"PullPart"}``), and the bytes
  held for the hostile member never exceed its share.

Before FedProxy and FedWave streamed through the peer port's send budget, the same flood
grew the server by every stalled stream's queued chunks.
"""

from __future__ import annotations

import collections
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from peerlm.agent.settings import PeerSendSettings

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.wire.v1 import fedproxy_pb2, fedproxy_pb2_grpc, fedwave_pb2, fedwave_pb2_grpc
from tests.node_contexts import kit_context
from tests.security.peer_server_process import FEDPROXY_ROUND, FEDWAVE_ROUND
from tests.security.process_probes import (
    RssSampler,
    ServerProcess,
    peer_server,
    rss,
    scrape,
    start_slow_reader,
    stopped,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MiB = 1024 * 1024
CHUNK = 1 * MiB
PAYLOAD = 8 * MiB
#: The server's bound on one identity's calls in flight (the default is 64; fewer keep the
#: test light, the mechanism is the same).
CALLS_PER_IDENTITY = 32
#: The hostile member opens this many: the last are over its call bound.
FLOOD_STREAMS = CALLS_PER_IDENTITY + 16
SEND = PeerSendSettings(budget_bytes=16 * MiB, identity_bytes=1 * MiB, wait_s=4.0, stall_s=3.0)
MAX_CALLS = 256
#: What one admitted call (its HTTP/2 stream, gRPC call, handler task, no chunk) may cost.
PER_CALL_ALLOWANCE = 64 * 1024
#: What the allocator may keep of the chunks freed meanwhile (the honest pulls' and the cut
#: streams'), spread over the server's threads' arenas: measured +9.9 MiB in all with the
#: bound in place, +137 MiB without (32 stalled streams of 8 MiB payloads).
ALLOCATOR_SLACK = 8 * MiB
#: Unwritten chunk bytes the flood and the honest pulls may make the server hold: each
#: member's share (one chunk larger than the share goes alone), twice for gRPC's
#: serialised copy and its own, plus every call the member opened and the slack.
GROWTH_BOUND = (
    2 * (2 * max(SEND.identity_bytes, CHUNK) + CHUNK)
    + (FLOOD_STREAMS + 8) * PER_CALL_ALLOWANCE
    + ALLOCATOR_SLACK
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation="slowcohort")
    issue_certificate(root, Role.AGENT, "teacher", sans=["127.0.0.1"])
    for name in ("honest", "hostile"):
        issue_certificate(root, Role.AGENT, name)
    return root


@pytest.fixture
def server(pki: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    args = ["--fedproxy", "--members", "hostile", "--chunk-bytes", str(CHUNK)]
    args += ["--fedproxy-bytes", str(PAYLOAD), "--fedwave-bytes", str(PAYLOAD)]
    args += ["--send", SEND.model_dump_json(), "--max-concurrent-rpcs", str(MAX_CALLS)]
    args += ["--max-calls-per-identity", str(CALLS_PER_IDENTITY)]
    with peer_server(pki, tmp_path, args) as started:
        yield started


def _counts(server: ServerProcess) -> dict[str, float]:
    """Cut-offs by ``rpc/reason``, identity-limit refusals by method name (``limit/RPC``)
    and the bytes in flight (``in_flight``)."""
    found: dict[str, float] = collections.defaultdict(float)
    for name, labels, value in scrape(server.metrics_port):
        if name == "peerlm_agent_peer_send_cutoffs_total":
            found[f"{labels['rpc']}/{labels['reason']}"] += value
        elif name == "peerlm_auth_refusals_total" and labels["reason"] == "identity_limit":
            found[f"limit/{labels['method'].rsplit('/', 1)[1]}"] += value
        elif name == "peerlm_agent_peer_send_in_flight_bytes":
            found["in_flight"] = value
    return dict(found)


async def _pull_both(pki: Path, target: str) -> tuple[bytes, bytes]:
    """The whole proxy and the whole VCLayer part, pulled as ``honest``."""
    got: list[bytes] = []
    async with kit_context(pki, "honest").dial(target) as peer:
        proxy = fedproxy_pb2_grpc.ProxyExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        wave = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        # One stream at a time: a call starts when it is made, and a stream opened but not
        # read holds its chunk, which is this member's whole share here.
        opens = (
            lambda: proxy.PullProxy(
                fedproxy_pb2.PullProxyRequest(round=FEDPROXY_ROUND), timeout=60
            ),
            lambda: wave.PullPart(
                fedwave_pb2.PullPartRequest(
                    round=FEDWAVE_ROUND, kind=fedwave_pb2.PART_KIND_VCLAYER
                ),
                timeout=60,
            ),
        )
        for open_stream in opens:
            data = bytearray()
            async for chunk in open_stream():
                assert chunk.offset == len(data)
                data += chunk.data
            assert len(data) == PAYLOAD
            got.append(bytes(data))
    return got[0], got[1]


async def test_a_member_flooding_proxy_and_part_pulls_cannot_grow_the_server(
    pki: Path, server: ServerProcess, tmp_path: Path
) -> None:
    pid = server.proc.pid
    # Idle figure after one honest pull of each: payloads, chunk messages and gRPC's
    # buffers in place, as on a server that has served before.
    proxy, part = await _pull_both(pki, server.target)
    idle = rss(pid)
    sampler = RssSampler(pid, kill_above=idle + 16 * GROWTH_BOUND)
    reader = start_slow_reader(
        pki,
        server.target,
        tmp_path,
        "hostile",
        names=["hostile"],
        streams=FLOOD_STREAMS,
        rpcs=("PullProxy", "PullPart"),
    )
    try:
        wait_for(
            "the hostile reader to read and stop",
            lambda: reader.ready.exists() and stopped(reader.proc.pid),
        )
        seen = json.loads(reader.ready.read_text())
        assert seen["first_chunk"] > 0, seen
        try:
            honest: tuple[bytes, bytes] | str = await _pull_both(pki, server.target)
        except grpc.aio.AioRpcError as err:
            honest = f"{err.code().name}: {err.details()}"
        settled = wait_for(
            "the stalled streams to be cut off",
            lambda: (
                _counts(server).get("PullProxy/stalled", 0)
                + _counts(server).get("PullPart/stalled", 0)
                >= 1
            ),
            deadline_s=60.0,
            required=False,
        )
        growth = sampler.peak - idle
        counted = _counts(server)
        print(
            f"\nslow cohort reader: idle RSS {idle / MiB:.1f} MiB, peak "
            f"{sampler.peak / MiB:.1f} MiB (+{growth / MiB:.1f} MiB, bound "
            f"+{GROWTH_BOUND / MiB:.1f} MiB); reader saw {seen}; counted {counted}"
        )
        assert growth <= GROWTH_BOUND, (
            f"one member grew the server by {growth / MiB:.1f} MiB, bound {GROWTH_BOUND / MiB:.1f}"
        )
        assert honest == (proxy, part), f"the honest member was not served: {honest!r:.200}"
        # The per-identity call bound covers the FedProxy and FedWave methods.
        over = counted.get("limit/PullProxy", 0) + counted.get("limit/PullPart", 0)
        assert over >= FLOOD_STREAMS - CALLS_PER_IDENTITY, counted
        assert settled, f"the stalled streams were not cut off: {counted}"
        # Only the hostile member's stalled chunks stay reserved: at most its share.
        assert counted.get("in_flight", 0) <= max(SEND.identity_bytes, CHUNK), counted
        reader.proc.send_signal(signal.SIGCONT)
        wait_for("the reader to finish", lambda: reader.final.exists())
        assert reader.proc.wait(60) == 0
        ended = json.loads(reader.final.read_text())
        print(f"slow cohort reader: streams ended {ended}")
        assert sum(ended["final"].values()) == FLOOD_STREAMS
        assert set(ended["final"]) <= {
            "OK",
            "DEADLINE_EXCEEDED",
            "RESOURCE_EXHAUSTED",
            "UNAVAILABLE",
        }
    finally:
        sampler.stop()
        if reader.proc.poll() is None:
            reader.proc.send_signal(signal.SIGKILL)
            reader.proc.wait()
    wait_for("the budget to come back", lambda: _counts(server).get("in_flight", 0) == 0)
    assert await _pull_both(pki, server.target) == (proxy, part)
    assert server.proc.poll() is None
