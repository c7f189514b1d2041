"""A stand-alone ``PeerExchange`` server process for the RPC fuzz tests.

It serves the product's :class:`~peerlm.agent.peer.service.PeerExchangeService` through
:func:`~peerlm.agent.peer.service.serve_peer` (the agent's own server assembly: metrics,
authorisation, limits) over mTLS on loopback, with a real :class:`DirectiveBook` holding
one directive (``teacher`` -> ``student``) and a fixed adapter of round 3, and beside it on
the same port FedWave's :class:`~peerlm.agent.fedwave.exchange_service.FedWaveExchangeService`
(as the agent daemon serves it) for a workflow of the server, the student, ``a2`` and ``a3``,
with fixed parts of round :data:`FEDWAVE_ROUND`. What it does not have is a model: the
package, the adapter and the parts are fixed bytes, so a fuzz run never waits for a model
and the adapter version (the state a refused request must leave alone) only changes when
something in the server is wrong.

All three services stream through one :class:`~peerlm.agent.peer.stream.PeerStreamer`, as
on the agent's peer port: one send budget for the port.

Run: ``python -m tests.security.peer_server_process --pki DIR --name teacher --port-file F
--metrics-port-file M``; it writes the bound ports and serves until SIGTERM. The slow-reader
tests (``test_slow_readers.py``, ``test_slow_cohort_readers.py``) also set the adapter's,
proxy's and parts' sizes (random bytes), the chunk size, the send budget
(:class:`~peerlm.agent.settings.PeerSendSettings`), the server's call limits and more
members of the FedProxy cohort and the FedWave workflow's first stage (``--members``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import structlog
from google.protobuf.timestamp_pb2 import Timestamp
from peerlm.agent.cpm.directives import DirectiveBook
from peerlm.agent.fedwave.exchange import PartKind, PartStore
from peerlm.agent.fedwave.exchange_service import (
    FEDWAVE_POLICY,
    FedWaveExchangeService,
    fedwave_service,
)
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.peer.service import PeerExchangeService, serve_peer
from peerlm.agent.peer.stream import PeerStreamer
from peerlm.agent.settings import PeerSendSettings

from peerlm.chunks import HashedPayload
from peerlm.config import GrpcLimits
from peerlm.metrics import new_registry, serve_metrics
from peerlm.node import NodeContext
from peerlm.pki.identity import Role
from peerlm.pki.proof import ProofSigner
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import cpm_pb2

#: The directive the server teaches under, and what it sends for it / as its adapter.
DIRECTIVE_ID = "d" * 32
PACKAGE = b"package-bytes " * 512
ADAPTER_ROUND = 3
ADAPTER = b"adapter-bytes " * 512
CHUNK_BYTES = 1024
#: The round whose FedWave parts the server holds (the server does not decode them).
FEDWAVE_ROUND = 2
#: With ``--fedproxy``: the round of the proxy the server owns (fixed bytes; PullProxy
#: streams a payload without decoding it).
FEDPROXY_ROUND = 2
FEDPROXY_PAYLOAD = b"proxy-bytes " * 128
FEDWAVE_PARTS = {PartKind.ROUTER: b"router-bytes " * 64, PartKind.VCLAYER: b"vclayer " * 256}


async def _main(args: argparse.Namespace) -> None:
    registry = new_registry()
    tls = TlsFiles.from_directory(Path(args.pki), args.name)
    ctx = NodeContext.create(
        component="agent",
        role=Role.AGENT,
        federation="unused-with-a-certificate",
        tls=tls,
        insecure_dev=False,
        limits=GrpcLimits(
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            max_calls_per_identity=args.max_calls_per_identity,
        ),
        log=structlog.get_logger("peer"),
        registry=registry,
        listen="127.0.0.1:0",
    )
    book = DirectiveBook(time.time, self_name=args.name)
    expires = Timestamp()
    expires.FromSeconds(int(time.time()) + 86_400)
    book.add(
        cpm_pb2.Directive(
            directive_id=DIRECTIVE_ID,
            matchmaking_round=1,
            protocol="akd",
            role=cpm_pb2.EXCHANGE_ROLE_TEACHER,
            teacher=args.name,
            student=args.student,
            expires_at=expires,
        )
    )

    async def package_for(directive: cpm_pb2.Directive, tokenizer: str | None) -> bytes:
        return PACKAGE

    # Hashed once, as the model host's cached encoding of its current adapter version is.
    adapter = HashedPayload.of(
        ADAPTER if args.adapter_bytes is None else os.urandom(args.adapter_bytes)
    )

    async def adapter_for(round_: int) -> tuple[int, HashedPayload] | None:
        return (ADAPTER_ROUND, adapter)

    bundle = tls.load()
    streamer = PeerStreamer(
        registry, PeerSendSettings.model_validate_json(args.send) if args.send else None
    )
    members = [m for m in args.members.split(",") if m]
    service = PeerExchangeService(
        book,
        package_for,
        adapter_for,
        chunk_bytes=args.chunk_bytes,
        max_package_bytes=1 << 20,
        max_adapter_bytes=max(1 << 20, len(adapter.data)),
        registry=registry,
        signer=ProofSigner.from_pem(bundle.cert, bundle.key),
        streamer=streamer,
    )
    workflow = Workflow.model_validate(
        {
            "stages": [
                {"name": "first", "agents": [args.name, args.student, *members]},
                {"name": "second", "agents": ["a2", "a3"]},
            ]
        }
    )
    store = PartStore()
    parts = FEDWAVE_PARTS
    if args.fedwave_bytes is not None:
        parts = {kind: os.urandom(args.fedwave_bytes) for kind in PartKind}
    store.publish(FEDWAVE_ROUND, parts)
    fedwave = FedWaveExchangeService(
        workflow,
        args.name,
        store,
        chunk_bytes=args.chunk_bytes,
        registry=registry,
        signer=ProofSigner.from_pem(bundle.cert, bundle.key),
        streamer=streamer,
    )
    extra: list[tuple[Any, Any]] = [(fedwave_service(fedwave), FEDWAVE_POLICY)]
    if args.fedproxy:
        # Imported here: the FedProxy service pulls in torch, which the slow-reader test's
        # server does not need to start.
        from peerlm.agent.fedproxy.service import (
            FEDPROXY_POLICY,
            ProxyExchangeService,
            RoundBoard,
            fedproxy_service,
        )

        board = RoundBoard(horizon=1)
        await board.publish(
            FEDPROXY_ROUND,
            FEDPROXY_PAYLOAD if args.fedproxy_bytes is None else os.urandom(args.fedproxy_bytes),
        )
        proxy = ProxyExchangeService(
            proxies=board,
            cohort={args.student, *members},
            chunk_bytes=args.chunk_bytes,
            max_wait_s=0.5,
            registry=registry,
            signer=ProofSigner.from_pem(bundle.cert, bundle.key),
            streamer=streamer,
        )
        extra.append((fedproxy_service(proxy), FEDPROXY_POLICY))
    server = await serve_peer(ctx, service, listen="127.0.0.1:0", extra=extra)
    metrics = serve_metrics(registry, "127.0.0.1", 0)
    Path(args.metrics_port_file).write_text(str(metrics.port))
    Path(args.port_file).write_text(str(server.port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    """Parse the command line and serve until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pki", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--metrics-port-file", required=True)
    parser.add_argument("--adapter-bytes", type=int, default=None)
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    parser.add_argument("--send", default=None, help="PeerSendSettings as JSON")
    parser.add_argument(
        "--fedproxy",
        action="store_true",
        help="also serve FedProxy's ProxyExchange as a cohort owner (imports torch)",
    )
    parser.add_argument(
        "--members", default="", help="comma-separated: more cohort and workflow members"
    )
    parser.add_argument("--fedproxy-bytes", type=int, default=None, help="random proxy bytes")
    parser.add_argument("--fedwave-bytes", type=int, default=None, help="random bytes per part")
    parser.add_argument("--max-concurrent-rpcs", type=int, default=GrpcLimits().max_concurrent_rpcs)
    parser.add_argument(
        "--max-calls-per-identity", type=int, default=GrpcLimits().max_calls_per_identity
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
