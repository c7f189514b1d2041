"""Slow readers for ``test_slow_readers.py`` and ``test_slow_cohort_readers.py``: a real mTLS
client process that opens many payload streams (``PullAdapter``, FedProxy's ``PullProxy``,
FedWave's ``PullPart``), reads one chunk of each, then stops reading altogether.

It opens ``--streams`` streams for each of its identities, taking the RPCs of ``--rpcs`` in
turn (``--names``, one connection per
identity, certificates from ``--pki``), waits up to ``--first-timeout-s`` for the first chunk
(or the status) of every stream, writes what it saw to ``--ready-file`` as JSON
(``{"first_chunk": n, "refused": {code: n}, "pending": n}``), and stops itself with SIGSTOP:
from then on its sockets are not read, so the server's writes to it cannot complete, which is
what a reader that does not consume is to the server. Continued (SIGCONT), it reads every
stream to its end and writes how they ended to ``--final-file``
(``{"final": {code: n}, "details": {code: one status message}}``), then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
from pathlib import Path
from typing import Any

import grpc

from peerlm.wire.v1 import (
    fedproxy_pb2,
    fedproxy_pb2_grpc,
    fedwave_pb2,
    fedwave_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
)
from tests.node_contexts import kit_context
from tests.security.peer_server_process import FEDPROXY_ROUND, FEDWAVE_ROUND


def _open(rpc: str, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> Any:
    """One stream of ``rpc`` for the payload the server process holds."""
    if rpc == "PullAdapter":
        stub = peer_pb2_grpc.PeerExchangeStub(channel)  # type: ignore[no-untyped-call]
        return stub.PullAdapter(peer_pb2.PullAdapterRequest(round=0), metadata=metadata)
    if rpc == "PullProxy":
        proxy = fedproxy_pb2_grpc.ProxyExchangeStub(channel)  # type: ignore[no-untyped-call]
        request = fedproxy_pb2.PullProxyRequest(round=FEDPROXY_ROUND)
        return proxy.PullProxy(request, metadata=metadata)
    if rpc == "PullPart":
        wave = fedwave_pb2_grpc.FedWaveExchangeStub(channel)  # type: ignore[no-untyped-call]
        request = fedwave_pb2.PullPartRequest(
            round=FEDWAVE_ROUND, kind=fedwave_pb2.PART_KIND_VCLAYER
        )
        return wave.PullPart(request, metadata=metadata)
    raise ValueError(f"unknown rpc {rpc!r}")


async def _main(args: argparse.Namespace) -> None:
    pki = Path(args.pki)
    calls: list[grpc.aio.UnaryStreamCall] = []
    channels = []
    rpcs = args.rpcs.split(",")
    for name in args.names.split(","):
        channel = kit_context(pki, name).dial(args.target)
        channels.append(channel)
        calls.extend(
            _open(rpcs[i % len(rpcs)], channel.channel, channel.metadata)
            for i in range(args.streams)
        )
    reads = [asyncio.ensure_future(call.read()) for call in calls]
    await asyncio.wait(reads, timeout=args.first_timeout_s)
    first, refused, pending = 0, collections.Counter[str](), 0
    for read in reads:
        if not read.done():
            pending += 1
        elif read.exception() is None:
            first += 1
        else:
            err = read.exception()
            refused[err.code().name if isinstance(err, grpc.aio.AioRpcError) else repr(err)] += 1
    summary = {"first_chunk": first, "refused": dict(refused), "pending": pending}
    Path(args.ready_file).write_text(json.dumps(summary))
    os.kill(os.getpid(), signal.SIGSTOP)  # from here on nothing is read, until SIGCONT
    # Continued: read every stream to its end and report how each ended.
    outcomes = await asyncio.gather(
        *(_finish(call, read) for call, read in zip(calls, reads, strict=True))
    )
    final = collections.Counter(code for code, _ in outcomes)
    details = {code: detail for code, detail in outcomes}
    Path(args.final_file).write_text(json.dumps({"final": dict(final), "details": details}))
    for channel in channels:
        await channel.close()


async def _finish(call: grpc.aio.UnaryStreamCall, first: asyncio.Future[object]) -> tuple[str, str]:
    """How the stream ended: its status code's name and details."""
    try:
        await first
        while await call.read() is not grpc.aio.EOF:
            pass
        return "OK", ""
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""


def main() -> None:
    """Parse the command line, read one chunk per stream, then stop."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pki", required=True)
    parser.add_argument("--names", required=True, help="comma-separated certificate names")
    parser.add_argument("--target", required=True)
    parser.add_argument("--streams", type=int, required=True, help="streams per identity")
    parser.add_argument(
        "--rpcs", default="PullAdapter", help="comma-separated: PullAdapter, PullProxy, PullPart"
    )
    parser.add_argument("--first-timeout-s", type=float, default=20.0)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--final-file", required=True)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
