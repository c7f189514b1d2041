"""A thousand slow adapter readers cannot grow a teacher's memory.

The audit's 1,030 ``PullAdapter`` readers that took one chunk and stopped grew a teacher
from 106 MB to 2.5 GB: every stalled stream kept a chunk (and its serialised copy) in the
server. Here a real peer-service process (``peer_server_process``: the agent's own service
and server assembly, mTLS on loopback, an 8 MiB adapter in 1 MiB chunks) is flooded by
``FLOOD_IDENTITIES x STREAMS_PER_IDENTITY`` = 1,024 ``PullAdapter`` streams from four
reader processes (``slow_reader_process``) that read one chunk per stream and then stop
(SIGSTOP: their sockets are no longer read). Asserted, from outside the server:

* its resident memory (``/proc/PID/status`` VmRSS) never exceeds its idle figure plus a
  bound derived from the configuration: twice the send budget and one chunk (gRPC holds a
  chunk's serialised copy and its own; one chunk may pass the budget alone) plus a per-call
  allowance for every call the server admits;
* a reader of another identity pulls the whole adapter meanwhile;
* the stalled readers are cut off and counted (``peerlm_agent_peer_send_cutoffs_total``,
  scraped from ``/metrics``): no stream keeps bytes reserved beyond its identity's share;
* when the readers resume, every stream ends, each one cut off with DEADLINE_EXCEEDED
  ("took no data") or RESOURCE_EXHAUSTED ("send budget") exactly as counted;
* when the readers are gone, the budget and the memory come back.

Nothing is timed: the waits poll a condition under a generous deadline.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from peerlm.agent.settings import PeerSendSettings

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.wire.v1 import peer_pb2, peer_pb2_grpc
from tests.node_contexts import kit_context
from tests.security.process_probes import (
    RssSampler,
    ServerProcess,
    SlowReader,
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
ADAPTER = 8 * MiB
FLOOD_IDENTITIES = 16
STREAMS_PER_IDENTITY = 64  # the default max_calls_per_identity: each identity's whole share
READER_PROCESSES = 4
#: Short waits so that the test sees cut-offs in seconds; the bounds are the defaults'.
SEND = PeerSendSettings(budget_bytes=24 * MiB, identity_bytes=1 * MiB, wait_s=4.0, stall_s=3.0)
#: Room for the flood, the honest reader and the test's probes.
MAX_CALLS = FLOOD_IDENTITIES * STREAMS_PER_IDENTITY + 64
#: What one admitted call (its HTTP/2 stream, gRPC call, handler task, no chunk) may cost.
PER_CALL_ALLOWANCE = 64 * 1024
#: The bound on what the flood may add to the idle server, from the configuration.
GROWTH_BOUND = 2 * (SEND.budget_bytes + CHUNK) + MAX_CALLS * PER_CALL_ALLOWANCE


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root, federation="slowreaders")
    issue_certificate(root, Role.AGENT, "teacher", sans=["127.0.0.1"])
    issue_certificate(root, Role.AGENT, "honest")
    for i in range(FLOOD_IDENTITIES):
        issue_certificate(root, Role.AGENT, f"slow{i}")
    return root


class _Server(ServerProcess):
    def cutoffs(self) -> dict[str, float]:
        """``peerlm_agent_peer_send_cutoffs_total`` for PullAdapter by reason, and the
        bytes in flight (key ``in_flight``)."""
        found: dict[str, float] = {}
        for name, labels, value in scrape(self.metrics_port):
            if name == "peerlm_agent_peer_send_cutoffs_total":
                if labels.get("rpc") == "PullAdapter":
                    found[labels["reason"]] = value
            elif name == "peerlm_agent_peer_send_in_flight_bytes":
                found["in_flight"] = value
        return found


@pytest.fixture
def server(pki: Path, tmp_path: Path) -> Iterator[_Server]:
    args = ["--adapter-bytes", str(ADAPTER), "--chunk-bytes", str(CHUNK)]
    args += ["--send", SEND.model_dump_json(), "--max-concurrent-rpcs", str(MAX_CALLS)]
    with peer_server(pki, tmp_path, args) as started:
        yield _Server(started.proc, started.target, started.metrics_port)


async def _pull(pki: Path, name: str, target: str) -> bytes:
    """The whole adapter, pulled as member ``name``; checks the chunks are contiguous."""
    async with kit_context(pki, name).dial(target) as peer:
        stub = peer_pb2_grpc.PeerExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
        data = bytearray()
        async for chunk in stub.PullAdapter(peer_pb2.PullAdapterRequest(round=0), timeout=60):
            assert chunk.offset == len(data)
            data += chunk.data
        assert len(data) == chunk.total_size
        return bytes(data)


def _start_readers(pki: Path, target: str, work: Path) -> list[SlowReader]:
    per_process = FLOOD_IDENTITIES // READER_PROCESSES
    return [
        start_slow_reader(
            pki,
            target,
            work,
            str(p),
            names=[f"slow{i}" for i in range(p * per_process, (p + 1) * per_process)],
            streams=STREAMS_PER_IDENTITY,
        )
        for p in range(READER_PROCESSES)
    ]


async def test_slow_readers_cannot_grow_the_teacher(
    pki: Path, server: _Server, tmp_path: Path
) -> None:
    pid = server.proc.pid
    # Idle figure after one honest pull: the adapter, its chunk messages and gRPC's
    # buffers are all in place, as on a teacher that has served before.
    adapter = await _pull(pki, "honest", server.target)
    assert len(adapter) == ADAPTER
    idle = rss(pid)
    sampler = RssSampler(pid, kill_above=idle + 8 * GROWTH_BOUND)
    readers = _start_readers(pki, server.target, tmp_path)
    try:
        for proc, ready, _ in readers:
            wait_for(
                "a reader to read and stop",
                lambda p=proc, r=ready: r.exists() and stopped(p.pid),
            )
        seen = [json.loads(ready.read_text()) for _, ready, _ in readers]
        assert sum(s["first_chunk"] for s in seen) > 0, seen
        # Meanwhile, another member is served in full (checked after the memory bound, which
        # a server without it fails first).
        try:
            honest: bytes | str = await _pull(pki, "honest", server.target)
        except grpc.aio.AioRpcError as err:
            honest = f"{err.code().name}: {err.details()}"
        # Every flood stream ends: cut off as stalled (a chunk it never took) or busy (no
        # bytes for it within wait_s while its identity's share sat in a stalled stream),
        # unless it finished before its reader stopped. Only the stalled streams' chunks
        # stay reserved, at most one share per identity.
        settled = wait_for(
            "the stalled readers to be cut off",
            lambda: (
                server.cutoffs().get("stalled", 0) >= 1
                and server.cutoffs().get("in_flight", 0) <= FLOOD_IDENTITIES * SEND.identity_bytes
            ),
            deadline_s=60.0,
            required=False,
        )
        growth = sampler.peak - idle
        counted = server.cutoffs()
        print(
            f"\nslow readers: idle RSS {idle / MiB:.1f} MiB, peak {sampler.peak / MiB:.1f} MiB "
            f"(+{growth / MiB:.1f} MiB, bound +{GROWTH_BOUND / MiB:.1f} MiB); readers saw "
            f"{seen}; cut-offs {counted}"
        )
        assert growth <= GROWTH_BOUND, (
            f"the flood grew the teacher by {growth / MiB:.1f} MiB, bound {GROWTH_BOUND / MiB:.1f}"
        )
        assert isinstance(honest, bytes), f"the honest reader was not served: {honest}"
        assert hashlib.sha256(honest).digest() == hashlib.sha256(adapter).digest()
        assert settled, f"the stalled readers were not cut off: {counted}"
        assert counted["stalled"] + counted.get("busy", 0) >= FLOOD_IDENTITIES
        # The readers resume: each stream ends, and a stream that was cut off says why.
        for proc, _, _ in readers:
            proc.send_signal(signal.SIGCONT)
        for proc, _, final in readers:
            wait_for("a reader to finish", lambda f=final: f.exists())
            assert proc.wait(60) == 0
        ended = [json.loads(final.read_text()) for _, _, final in readers]
        codes: collections.Counter[str] = collections.Counter()
        details: dict[str, str] = {}
        for summary in ended:
            codes.update(summary["final"])
            details.update(summary["details"])
        counted = server.cutoffs()
        print(f"slow readers: streams ended {dict(codes)}; cut-offs {counted}; {details}")
        assert sum(codes.values()) == FLOOD_IDENTITIES * STREAMS_PER_IDENTITY
        assert set(codes) <= {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
        # A connection may also have been closed while its reader was stopped (its streams
        # then end UNAVAILABLE, whatever the server had decided); every other stream ends
        # as the server counted it. An identity has at most one stalled stream (its share
        # is one chunk), so each lost connection hides at most one.
        lost = -(-codes["UNAVAILABLE"] // STREAMS_PER_IDENTITY)
        assert lost < FLOOD_IDENTITIES // 2, codes
        dead, busy = codes["DEADLINE_EXCEEDED"], codes["RESOURCE_EXHAUSTED"]
        assert dead <= counted["stalled"] <= dead + lost, (codes, counted)
        assert busy <= counted.get("busy", 0) <= busy + codes["UNAVAILABLE"], (codes, counted)
        assert "took no data" in details["DEADLINE_EXCEEDED"]
        if codes["RESOURCE_EXHAUSTED"]:
            assert "send budget" in details["RESOURCE_EXHAUSTED"]
    finally:
        sampler.stop()
        for proc, _, _ in readers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    # The readers are gone: their connections closed and the bytes came back to the budget,
    # and the chunks' memory to the process. What malloc keeps of the thousand calls' small
    # allocations may stay (their allowance), none of the chunks' part of the bound.
    wait_for("the budget to come back", lambda: server.cutoffs().get("in_flight", 0) == 0)
    kept = idle + MAX_CALLS * PER_CALL_ALLOWANCE
    came_back = wait_for("the memory to come back", lambda: rss(pid) <= kept, 30, required=False)
    after = rss(pid)
    print(f"slow readers: RSS after the readers left {after / MiB:.1f} MiB")
    assert came_back, f"RSS {after / MiB:.1f} MiB after the flood, more than {kept / MiB:.1f}"
    assert await _pull(pki, "honest", server.target) == adapter
    assert os.path.exists(f"/proc/{pid}")  # the teacher survived it all
    assert server.proc.poll() is None
