"""Adapter transfer throughput: peerlm's pull path beside a raw TLS socket and plain gRPC.

One run, one server process, real certificates from a fresh federation CA, loopback only.
For each size (default 16 and 64 MiB) the same bytes (a real peerlm adapter, encoded by the
codec) travel three ways, each on a fresh connection (handshake included, as every pull
opens its own channel):

* ``raw_tls``: a blocking TLS 1.3 socket with mutual authentication (Python ``ssl``, i.e.
  OpenSSL), the payload written in one ``sendall`` and read into one preallocated buffer:
  what the link and TLS can do;
* ``grpc``: a plain gRPC mTLS server-streaming call, the payload as raw ``bytes`` messages
  of ``chunk_bytes`` (identity serialisers: no protobuf, no hashing, no proof);
* ``peerlm``: ``PeerExchange.PullAdapter`` against the real peer service and server
  (interceptors, authorisation, sender proof signed by the server's certificate key), pulled
  by :func:`~peerlm.agent.peer.client.pull_adapter_with_round` with the sender proof
  checked and the SHA-256 verified.

Each method runs ``repeats`` times (interleaved, so drift hits all alike); the table shows
the median MiB/s and the ratios to ``raw_tls`` and to ``grpc``. The server caches the
encoded adapter and its digest as the agent does (one per adapter version), so a pull
measures the steady state. Timings vary with load on the machine; the ratios in one run
are what compare.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import ssl
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import torch
from rich.console import Console
from rich.table import Table

from peerlm.config import GrpcLimits
from peerlm.node import NodeContext

__all__ = ["TransferConfig", "render_report", "run_benchmark"]

Progress = Callable[[str, int, int], None]
_MiB = 1024 * 1024
_FEDERATION = "benchxfer"
_METHOD = "/peerlm.bench.Blob/Stream"
_METHODS = ("raw_tls", "grpc", "peerlm")


@dataclass(frozen=True)
class TransferConfig:
    """Sizes in MiB, repetitions per (size, method), and the chunk size of both streams."""

    sizes_mib: tuple[int, ...] = (16, 64)
    repeats: int = 3
    chunk_bytes: int = GrpcLimits().chunk_bytes


def _payload(size_mib: int) -> bytes:
    """A real adapter of ``size_mib`` MiB of float32 tensor data, encoded by the codec."""
    from peerlm.agent import AdapterSpec, encode_adapter

    n = size_mib * _MiB // 4
    shapes = {"lora_A.weight": (n // 2,), "lora_B.weight": (n - n // 2,)}
    spec = AdapterSpec(
        shapes=shapes,
        model_type="gpt2",
        tokenizer_hash="0" * 64,
        lora_r=8,
        lora_alpha=16.0,
        lora_json='{"r": 8, "alpha": 16.0}',
    )
    g = torch.Generator().manual_seed(size_mib)
    return encode_adapter({k: torch.randn(s, generator=g) for k, s in shapes.items()}, spec)


def _ssl_context(pki: Path, name: str, *, server: bool) -> ssl.SSLContext:
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    ctx = ssl.create_default_context(purpose, cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / f"{name}.crt"), str(pki / f"{name}.key"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


# ------------------------------------------------------------------------------ server


async def _serve(pki: Path, sizes: tuple[int, ...], chunk: int, conn: Connection) -> None:
    import structlog
    from peerlm.agent import DirectiveBook, PeerExchangeService, serve_peer

    from peerlm.chunks import HashedPayload
    from peerlm.security.credentials import TlsFiles

    payloads = {n: _payload(n) for n in sizes}
    hashed = {n: HashedPayload.of(p) for n, p in payloads.items()}
    limits = GrpcLimits()
    log = structlog.get_logger("bench.transfer")

    raw_listener = socket.create_server(("127.0.0.1", 0))
    raw_port = raw_listener.getsockname()[1]
    threading.Thread(
        target=_raw_tls_server,
        args=(raw_listener, _ssl_context(pki, "server", server=True), payloads),
        daemon=True,
    ).start()

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        data = payloads[int(request)]
        for off in range(0, len(data), chunk):
            yield data[off : off + chunk]

    tls = TlsFiles.from_directory(pki, "server")
    plain = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", limits.max_message_bytes),
            ("grpc.max_receive_message_length", limits.max_message_bytes),
        ]
    )
    plain.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "peerlm.bench.Blob", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
            ),
        )
    )
    bundle = tls.load()
    creds = grpc.ssl_server_credentials(
        [(bundle.key, bundle.cert)], root_certificates=bundle.ca_cert, require_client_auth=True
    )
    grpc_port = plain.add_secure_port("127.0.0.1:0", creds)
    await plain.start()

    async def no_package(directive: Any, tokenizer: str | None) -> bytes:
        raise RuntimeError("the transfer benchmark serves adapters only")

    async def adapter_for(round_: int) -> tuple[int, HashedPayload] | None:
        found = hashed.get(round_)
        return None if found is None else (round_, found)

    node = _node_context(pki, "server", limits, log, listen="127.0.0.1:0")
    service = PeerExchangeService(
        DirectiveBook(time.time),
        no_package,
        adapter_for,
        chunk_bytes=chunk,
        max_package_bytes=limits.max_message_bytes,
        registry=node.registry,
        log=log,
        signer=node.signer,
    )
    peer_server = await serve_peer(node, service, listen="127.0.0.1:0")
    peer_port = peer_server.port
    conn.send({"raw_tls": raw_port, "grpc": grpc_port, "peerlm": peer_port})
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    raw_listener.close()
    await plain.stop(None)
    await peer_server.stop(None)


def _node_context(
    pki: Path, name: str, limits: GrpcLimits, log: Any, listen: str | None = None
) -> NodeContext:
    """Member ``name``'s mTLS node context: the same plumbing an agent process builds."""
    from peerlm.pki.identity import Role
    from peerlm.security.credentials import TlsFiles

    return NodeContext.create(
        component="agent",
        role=Role.AGENT,
        federation=_FEDERATION,
        tls=TlsFiles.from_directory(pki, name),
        insecure_dev=False,
        limits=limits,
        log=log,
        listen=listen,
    )


def _raw_tls_server(
    listener: socket.socket, ctx: ssl.SSLContext, payloads: dict[int, bytes]
) -> None:
    """Blocking TLS sockets in a thread (asyncio's SSL layer is pure Python and slower): one
    ``sendall`` of the whole payload per connection."""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return  # closed: the benchmark is over
        with ctx.wrap_socket(sock, server_side=True) as tls:
            size = int.from_bytes(_recv_exactly(tls, 4), "big")
            tls.sendall(payloads[size])
            tls.shutdown(socket.SHUT_RDWR)


def _recv_exactly(sock: ssl.SSLSocket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise RuntimeError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _server_main(pki: str, sizes: tuple[int, ...], chunk: int, conn: Connection) -> None:
    import logging

    logging.disable(logging.WARNING)  # the server's info lines are not the benchmark's output
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(_serve(Path(pki), sizes, chunk, conn))


# ------------------------------------------------------------------------------ clients


def _pull_raw_blocking(port: int, size: int, expected: int, ctx: ssl.SSLContext) -> None:
    with (
        socket.create_connection(("127.0.0.1", port)) as sock,
        ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(size.to_bytes(4, "big"))
        _recv_exactly(tls, expected)  # into one preallocated buffer


async def _pull_raw(port: int, size: int, expected: int, ctx: ssl.SSLContext) -> None:
    await asyncio.to_thread(_pull_raw_blocking, port, size, expected, ctx)


async def _pull_grpc(port: int, size: int, expected: int, creds: grpc.ChannelCredentials) -> None:
    limits = GrpcLimits()
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        creds,
        options=[("grpc.max_receive_message_length", limits.max_message_bytes)],
    ) as channel:
        stream = channel.unary_stream(_METHOD, None, None)  # raw bytes both ways
        call = stream(str(size).encode())
        parts = [part async for part in call]
    if len(b"".join(parts)) != expected:
        raise RuntimeError("gRPC transfer short")


async def _pull_peerlm(port: int, size: int, expected: int, node: NodeContext) -> None:
    from peerlm.agent import pull_adapter_with_round

    sent, data = await pull_adapter_with_round(
        node,
        f"127.0.0.1:{port}",
        size,
        max_bytes=expected,
        timeout_s=120.0,
        expect="server",  # the sender proof of agent "server" is checked on every pull
    )
    if sent != size or len(data) != expected:
        raise RuntimeError("peerlm pull returned the wrong adapter")


async def _measure(
    cfg: TransferConfig, pki: Path, ports: dict[str, int], progress: Progress
) -> dict[str, dict[str, list[float]]]:
    import structlog

    from peerlm.security.credentials import TlsFiles, channel_credentials

    ctx = _ssl_context(pki, "client", server=False)
    creds = channel_credentials(TlsFiles.from_directory(pki, "client"))
    node = _node_context(pki, "client", GrpcLimits(), structlog.get_logger("bench"))
    times: dict[str, dict[str, list[float]]] = {}
    total = len(cfg.sizes_mib) * cfg.repeats * len(_METHODS)
    done = 0
    for size in cfg.sizes_mib:
        expected = len(_payload(size))
        per: dict[str, list[float]] = {m: [] for m in _METHODS}

        async def pull(name: str, size: int = size, expected: int = expected) -> None:
            if name == "raw_tls":
                await _pull_raw(ports[name], size, expected, ctx)
            elif name == "grpc":
                await _pull_grpc(ports[name], size, expected, creds)
            else:
                await _pull_peerlm(ports[name], size, expected, node)

        for name in _METHODS:  # warm-up: first connections, caches, allocator
            await pull(name)
        for rep in range(cfg.repeats):
            for name in _METHODS:
                progress(f"{size} MiB {name} #{rep + 1}", done, total)
                started = time.perf_counter()
                await pull(name)
                per[name].append(time.perf_counter() - started)
                done += 1
        times[str(size)] = per
    progress("done", total, total)
    return times


def run_benchmark(cfg: TransferConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the comparison; returns ``{"config", "results": [{size_mib, method, ...}]}``."""
    from peerlm.pki.ca import init_ca, issue_certificate
    from peerlm.pki.identity import Role

    report: Progress = progress or (lambda label, done, total: None)
    with tempfile.TemporaryDirectory(prefix="peerlm-bench-transfer-") as tmp:
        pki = Path(tmp)
        init_ca(pki, federation=_FEDERATION)
        for name in ("server", "client"):
            issue_certificate(pki, Role.AGENT, name, sans=["127.0.0.1"])
        report("starting the server process", 0, 1)
        spawn = mp.get_context("spawn")
        ours, theirs = spawn.Pipe()
        server = spawn.Process(
            target=_server_main,
            args=(str(pki), cfg.sizes_mib, cfg.chunk_bytes, theirs),
            daemon=True,
        )
        server.start()
        try:
            if not ours.poll(300):
                raise RuntimeError("the benchmark server did not start")
            ports: dict[str, int] = ours.recv()
            times = asyncio.run(_measure(cfg, pki, ports, report))
        finally:
            ours.send("stop")
            server.join(30)
            if server.is_alive():
                server.kill()
    results = []
    for size in cfg.sizes_mib:
        per = times[str(size)]
        nbytes = len(_payload(size))
        raw_rate = nbytes / _MiB / statistics.median(per["raw_tls"])
        grpc_rate = nbytes / _MiB / statistics.median(per["grpc"])
        for name in _METHODS:
            median = statistics.median(per[name])
            rate = nbytes / _MiB / median
            results.append(
                {
                    "size_mib": size,
                    "bytes": nbytes,
                    "method": name,
                    "median_s": round(median, 4),
                    "best_s": round(min(per[name]), 4),
                    "mib_per_s": round(rate, 1),
                    "ratio_to_raw_tls": round(rate / raw_rate, 3),
                    "ratio_to_grpc": round(rate / grpc_rate, 3),
                }
            )
    return {"benchmark": "transfer", "config": asdict(cfg), "results": results}


def render_report(report: dict[str, Any], console: Console) -> None:
    """The results as a table: one row per (size, method)."""
    table = Table(title="Adapter transfer over mTLS on loopback (median of repeats)")
    for col in ("size", "method", "median s", "best s", "MiB/s", "÷ raw TLS", "÷ gRPC"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for r in report["results"]:
        table.add_row(
            f"{r['size_mib']} MiB",
            r["method"],
            f"{r['median_s']:.3f}",
            f"{r['best_s']:.3f}",
            f"{r['mib_per_s']:.0f}",
            f"{r['ratio_to_raw_tls']:.2f}",
            f"{r['ratio_to_grpc']:.2f}",
        )
    console.print(table)
