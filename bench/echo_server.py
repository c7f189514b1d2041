"""A bare mutual-TLS grpc.aio server that acknowledges every streamed message at once.

``peerlm bench cpm-ack`` measures against it the *transport's ceiling*: the messages per
second that Python gRPC with TLS carries on this machine with the benchmark's own client
pattern when the server does nothing at all — no protobuf parsing, no interceptors
(metrics, authorisation, limits), no validation, bandit or SQLite. A durable CPM
acknowledgement cannot be faster than that, so the ceiling says how much of the gap to the
SQLite group-commit limit is the RPC stack's rather than the CPM's.

Run as ``python -m peerlm.bench.echo_server CA CERT KEY PORT_FILE``: it binds an
ephemeral loopback port, writes it to ``PORT_FILE`` and serves until terminated.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from peerlm.config import GrpcLimits
from peerlm.rpc import server_options
from peerlm.security.credentials import TlsFiles, server_credentials

__all__ = ["ECHO_METHOD", "serve"]

#: The one method: a bidirectional stream of raw bytes, one short reply per message.
ECHO_METHOD = "/peerlm.bench.Echo/Acknowledge"
_ACK = b"\x08\x01"


async def _acknowledge(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    async for _ in requests:
        yield _ACK


async def serve(tls: TlsFiles, port_file: Path) -> None:
    """Serve :data:`ECHO_METHOD` with mTLS on 127.0.0.1 until SIGTERM/SIGINT."""
    server = grpc.aio.server(options=server_options(GrpcLimits()))
    service, method = ECHO_METHOD.strip("/").split("/")
    handler = grpc.stream_stream_rpc_method_handler(_acknowledge)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    await server.start()
    port_file.write_text(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(None)


def main(argv: list[str] | None = None) -> None:
    """``python -m peerlm.bench.echo_server CA CERT KEY PORT_FILE``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        raise SystemExit("usage: python -m peerlm.bench.echo_server CA CERT KEY PORT_FILE")
    ca, cert, key, port_file = (Path(a) for a in args)
    asyncio.run(serve(TlsFiles(ca, cert, key), port_file))


if __name__ == "__main__":
    main()
