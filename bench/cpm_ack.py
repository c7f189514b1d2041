"""``peerlm bench cpm-ack``: durably acknowledged rewards per second against a real CPM.

For each concurrency ``C`` (default 1, 10, 50) the benchmark, in one run:

1. **CPM.** Builds a federation CA with ``2C`` agent certificates, starts a real
   ``peerlm cpm`` process (mTLS, SQLite WAL with ``synchronous=FULL``) in a fresh
   directory, has every agent submit profiles and an admin trigger matchmaking until at
   least ``rewards`` directives are open, and reads each agent's directives from its
   feed. Then ``C`` client tasks, each with at most one call in flight, report the
   rewards over the agents' own mTLS channels (one per agent, ``2C`` in all), as the
   directive's student. Figure: acknowledged rewards / wall time from the first call to
   the last acknowledgement, plus per-call latency percentiles. A GetStats afterwards
   checks that the bandit holds exactly the acknowledged rewards.
2. **SQLite limit.** The same number of small rows inserted by ``C`` concurrent producers
   in the same kind of directory, each waiting until its row is durable, with one writer
   thread committing everything queued in one transaction (WAL, ``synchronous=FULL``):
   the group-commit rate SQLite itself allows at that concurrency, with the same asyncio
   plumbing and no RPC, TLS or bandit.

3. **Transport ceiling.** The ``ReportRewards`` client pattern against a bare mTLS
   grpc.aio server (:mod:`peerlm.bench.echo_server`) that answers every message at once:
   what Python gRPC with TLS carries here when the server does no work at all.

``ratio = cpm_acks_per_s / sqlite_inserts_per_s`` is the figure the CPM targets (>= 0.25
at 50 clients); ``echo_ratio`` is the same for the bare transport (no server can beat
it with this stack), and ``stream_share_of_echo`` the share of that ceiling the CPM
reaches. Client and server share the machine, so the CPM figure includes the
client's own gRPC cost.
"""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from peerlm.services.cpm import cpm_command

from peerlm.config import GrpcLimits
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.rpc import create_channel
from peerlm.security.credentials import TlsFiles, channel_credentials
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

from .echo_server import ECHO_METHOD

__all__ = ["AckParams", "render_report", "run_benchmark"]

ProgressFn = Callable[[str, int, int], None]
_FEDERATION = "bench"


@dataclass(frozen=True)
class AckParams:
    """What to measure: concurrency levels and rewards per level."""

    clients: tuple[int, ...] = (1, 10, 50)
    #: Rewards per level: ``max(min_rewards, C * rewards_per_client)``.
    rewards_per_client: int = 40
    min_rewards: int = 400
    seed: int = 0
    workdir: Path | None = None

    @classmethod
    def quick(cls) -> AckParams:
        """Seconds, for tests."""
        return cls(clients=(1, 4), rewards_per_client=10, min_rewards=40)

    def rewards(self, clients: int) -> int:
        """Rewards reported at concurrency ``clients``."""
        return max(self.min_rewards, clients * self.rewards_per_client)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields 14 and 15 of stat (utime, stime), counted after the ")" closing the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1000.0
    return {f"p{q}_ms": float(np.percentile(arr, q)) for q in (50, 90, 99)}


# --------------------------------------------------------------------------- CPM side


def _federation_pki(root: Path, agents: int) -> Path:
    """A federation CA under ``root/pki`` with a server (``cpm``), an admin and ``agents``
    agent certificates ``a0``, ``a1``, ..."""
    pki = root / "pki"
    init_ca(pki, federation=_FEDERATION)
    issue_certificate(pki, Role.CPM, "cpm", sans=["127.0.0.1", "localhost"])
    issue_certificate(pki, Role.ADMIN, "admin")
    for i in range(agents):
        issue_certificate(pki, Role.AGENT, f"a{i}")
    return pki


def _start_child(
    args: list[str], env: Mapping[str, str], root: Path, port_file: Path, what: str
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server child that writes its port to ``port_file``; (process, target)."""
    log = (root / "server.log").open("ab")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=dict(env))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_child(proc)
            tail = (root / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{what} did not start: {tail}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def _stop_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Cpm:
    """A ``peerlm cpm`` child with its own CA and ``agents`` agent certificates."""

    def __init__(self, root: Path, agents: int) -> None:
        self.root = root
        self.pki = _federation_pki(root, agents)
        self.agents = [f"a{i}" for i in range(agents)]
        port_file = root / "cpm.port"
        args = cpm_command(
            tls=self.tls("cpm"),
            db=root / "cpm.db",
            port_file=port_file,
            federation=_FEDERATION,
            init=True,
        )
        env = {
            **os.environ,
            "PEERLM_CPM_MIN_QUORUM": "1000000",
            "PEERLM_CPM_ROUND_INTERVAL_S": "86400",
            "PEERLM_CPM_DIRECTIVE_TTL_S": "86400",
        }
        self.proc, self.target = _start_child(args, env, root, port_file, "the CPM")

    def tls(self, name: str) -> TlsFiles:
        return TlsFiles(self.pki / "ca.crt", self.pki / f"{name}.crt", self.pki / f"{name}.key")

    def stub(self, name: str) -> tuple[grpc.aio.Channel, Any]:
        """A channel with ``name``'s certificate and an (aio) Matchmaker stub on it."""
        ch = create_channel(self.target, GrpcLimits(), channel_credentials(self.tls(name)))
        # The generated stub is typed for the sync API; on an aio channel calls are awaitable.
        return ch, cpm_pb2_grpc.MatchmakerStub(ch)  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        _stop_child(self.proc)


class _Echo:
    """A bare mTLS echo server child (:mod:`peerlm.bench.echo_server`) with the CPM's
    certificate, and ``agents`` agent certificates for its clients."""

    def __init__(self, root: Path, agents: int) -> None:
        self.pki = _federation_pki(root, agents)
        self.agents = [f"a{i}" for i in range(agents)]
        port_file = root / "echo.port"
        tls = TlsFiles(self.pki / "ca.crt", self.pki / "cpm.crt", self.pki / "cpm.key")
        args = [
            sys.executable,
            "-m",
            "peerlm.bench.echo_server",
            *(str(x) for x in (tls.ca_cert, tls.cert, tls.key, port_file)),
        ]
        self.proc, self.target = _start_child(args, os.environ, root, port_file, "the echo server")

    def channel(self, name: str) -> grpc.aio.Channel:
        tls = TlsFiles(self.pki / "ca.crt", self.pki / f"{name}.crt", self.pki / f"{name}.key")
        return create_channel(self.target, GrpcLimits(), channel_credentials(tls))


async def _issue(
    cpm: _Cpm, stubs: Mapping[str, Any], rounds: int, seed: int
) -> list[tuple[str, str]]:
    """Run ``rounds`` matchmaking rounds; ``(student, directive_id)`` of every directive."""
    rng = np.random.default_rng(seed)
    admin_ch, admin = cpm.stub("admin")
    try:
        for r in range(1, rounds + 1):
            await asyncio.gather(
                *(
                    stubs[a].SubmitProfile(
                        cpm_pb2.SubmitProfileRequest(
                            round=r, features=[float(x) for x in rng.uniform(0, 1, 32)]
                        )
                    )
                    for a in cpm.agents
                )
            )
            await admin.TriggerMatchmaking(cpm_pb2.TriggerMatchmakingRequest())
    finally:
        await admin_ch.close(None)
    found: list[tuple[str, str]] = []
    for a in cpm.agents:
        # Every agent is in exactly one pair per round: its feed replays ``rounds`` of them.
        call = stubs[a].StreamDirectives(cpm_pb2.StreamDirectivesRequest())
        for _ in range(rounds):
            d = await call.read()
            assert isinstance(d, cpm_pb2.Directive)
            if d.student == a:
                found.append((a, d.directive_id))
        call.cancel()
    return found


def _by_client(
    work: list[tuple[str, str]], agents: list[str], clients: int, n: int
) -> list[list[tuple[str, str]]]:
    """``n`` items of ``work`` split over ``clients`` lists; agent ``i``'s rewards all go to
    list ``i % clients`` (a stream belongs to one agent), taken round-robin across lists."""
    owner = {a: i % clients for i, a in enumerate(agents)}
    pools: list[list[tuple[str, str]]] = [[] for _ in range(clients)]
    for item in work:
        pools[owner[item[0]]].append(item)
    out: list[list[tuple[str, str]]] = [[] for _ in range(clients)]
    taken = 0
    depth = 0
    while taken < n and any(depth < len(p) for p in pools):
        for i, pool in enumerate(pools):
            if depth < len(pool) and taken < n:
                out[i].append(pool[depth])
                taken += 1
        depth += 1
    return out


async def _report_unary(
    stubs: Mapping[str, Any], work: list[tuple[str, str]], clients: int, values: Any
) -> list[float]:
    """``clients`` tasks, one ReportReward call in flight each; per-call latencies."""
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    latencies: list[float] = []

    async def client() -> None:
        while not queue.empty():
            student, directive_id = queue.get_nowait()
            t0 = time.perf_counter()
            await stubs[student].ReportReward(
                cpm_pb2.ReportRewardRequest(
                    directive_id=directive_id, reward=float(values[len(latencies)])
                ),
                timeout=60,
            )
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


async def _report_stream(
    open_call: Callable[[str], Any],
    lists: list[list[tuple[str, str]]],
    values: Any,
    *,
    raw: bool = False,
) -> list[float]:
    """One task per list, each with one reward in flight on its agents' streams (opened
    on first use by ``open_call(agent)``, one per agent); per-reward latencies. ``raw``:
    the stream carries bytes (the echo server), so requests go serialised and any reply
    counts as the acknowledgement."""
    latencies: list[float] = []

    async def client(items: list[tuple[str, str]]) -> None:
        calls: dict[str, Any] = {}
        try:
            for student, directive_id in items:
                call = calls.get(student)
                if call is None:
                    call = calls[student] = open_call(student)
                t0 = time.perf_counter()
                request = cpm_pb2.ReportRewardRequest(
                    directive_id=directive_id, reward=float(values[len(latencies)])
                )
                await call.write(request.SerializeToString() if raw else request)
                result = await call.read()
                if raw:
                    if not isinstance(result, bytes):
                        raise RuntimeError(f"message {directive_id} not acknowledged: {result}")
                elif not isinstance(result, cpm_pb2.ReportRewardResult) or not result.HasField(
                    "ack"
                ):
                    raise RuntimeError(f"reward {directive_id} not acknowledged: {result}")
                latencies.append(time.perf_counter() - t0)
            for call in calls.values():
                await call.done_writing()
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    raise RuntimeError(f"ReportRewards ended with {code.name}")
        finally:
            for call in calls.values():
                call.cancel()  # no-op on a finished call

    await asyncio.gather(*(client(items) for items in lists))
    return latencies


async def _cpm_level(
    root: Path, clients: int, rewards: int, seed: int, *, stream: bool
) -> dict[str, Any]:
    cpm = _Cpm(root, 2 * clients)
    channels = {a: cpm.stub(a) for a in cpm.agents}
    stubs = {a: s for a, (_, s) in channels.items()}
    try:
        rounds = math.ceil(rewards / clients)
        found = await _issue(cpm, stubs, rounds, seed)
        rng = np.random.default_rng(seed + 1)
        values = rng.uniform(-1, 1, rewards)
        cpu0, own0 = _cpu_seconds(cpm.proc.pid), time.process_time()
        started = time.perf_counter()
        if stream:
            lists = _by_client(found, cpm.agents, clients, rewards)
            latencies = await _report_stream(
                lambda a: stubs[a].ReportRewards(timeout=600), lists, values
            )
        else:
            latencies = await _report_unary(stubs, found[:rewards], clients, values)
        elapsed = time.perf_counter() - started
        cpu1, own1 = _cpu_seconds(cpm.proc.pid), time.process_time()
        n = max(1, len(latencies))
        server_cpu = None if cpu0 is None or cpu1 is None else 1000 * (cpu1 - cpu0) / n
        admin_ch, admin = cpm.stub("admin")
        stats = await admin.GetStats(cpm_pb2.GetStatsRequest())
        await admin_ch.close(None)
        return {
            "acked": len(latencies),
            "seconds": elapsed,
            "acks_per_s": len(latencies) / elapsed,
            "bandit_updates": int(stats.bandit_updates),
            # Where the time goes: CPU per acknowledged reward in the CPM and in the clients.
            "server_cpu_ms_per_ack": server_cpu,
            "client_cpu_ms_per_ack": 1000 * (own1 - own0) / n,
            **_percentiles(latencies),
        }
    finally:
        for ch, _ in channels.values():
            await ch.close(None)
        cpm.stop()


def _raw_stream(channel: grpc.aio.Channel) -> Any:
    """The echo method on ``channel``, carrying bytes both ways (no (de)serialisers)."""
    method: Any = channel.stream_stream
    return method(ECHO_METHOD)


async def _echo_level(root: Path, clients: int, rewards: int, seed: int) -> dict[str, Any]:
    """The transport's ceiling: the ReportRewards client pattern against the echo server."""
    echo = _Echo(root, 2 * clients)
    channels = {a: echo.channel(a) for a in echo.agents}
    try:
        # Stand-ins for directives: each agent reports its share, as in the CPM levels.
        work = [(echo.agents[i % len(echo.agents)], f"{i:032x}") for i in range(rewards)]
        lists = _by_client(work, echo.agents, clients, rewards)
        values = np.random.default_rng(seed + 1).uniform(-1, 1, rewards)
        cpu0, own0 = _cpu_seconds(echo.proc.pid), time.process_time()
        started = time.perf_counter()
        latencies = await _report_stream(
            lambda a: _raw_stream(channels[a])(timeout=600),
            lists,
            values,
            raw=True,
        )
        elapsed = time.perf_counter() - started
        cpu1, own1 = _cpu_seconds(echo.proc.pid), time.process_time()
        n = max(1, len(latencies))
        server_cpu = None if cpu0 is None or cpu1 is None else 1000 * (cpu1 - cpu0) / n
        return {
            "acked": len(latencies),
            "seconds": elapsed,
            "acks_per_s": len(latencies) / elapsed,
            "server_cpu_ms_per_ack": server_cpu,
            "client_cpu_ms_per_ack": 1000 * (own1 - own0) / n,
            **_percentiles(latencies),
        }
    finally:
        for ch in channels.values():
            await ch.close(None)
        _stop_child(echo.proc)


# ------------------------------------------------------------------------ SQLite limit


async def _sqlite_level(path: Path, clients: int, rows: int) -> dict[str, Any]:
    """Group-committed inserts: ``clients`` producers, one committing writer thread."""
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE rewards (id TEXT PRIMARY KEY, reward REAL, at REAL)")
    loop = asyncio.get_running_loop()
    pending: list[tuple[tuple[str, float, float], asyncio.Future[None]]] = []
    cond = threading.Condition()
    stop = False

    def writer() -> None:
        while True:
            with cond:
                while not pending and not stop:
                    cond.wait()
                if stop and not pending:
                    return
                batch = pending[:]
                pending.clear()
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO rewards VALUES (?, ?, ?)", [r for r, _ in batch])
            db.execute("COMMIT")
            for _, fut in batch:
                loop.call_soon_threadsafe(fut.set_result, None)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    counter = iter(range(rows))

    async def producer() -> None:
        for i in counter:
            fut: asyncio.Future[None] = loop.create_future()
            with cond:
                pending.append(((f"{i:032x}", 0.5, time.time()), fut))
                cond.notify()
            await fut

    started = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    with cond:
        stop = True
        cond.notify()
    thread.join()
    db.close()
    return {"rows": rows, "seconds": elapsed, "inserts_per_s": rows / elapsed}


# ----------------------------------------------------------------------------- runner


def run_benchmark(params: AckParams, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Both measurements at every concurrency level; one JSON-able report."""
    levels: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cpm-ack-", dir=params.workdir) as tmp:
        root = Path(tmp)
        for k, clients in enumerate(params.clients):
            n = params.rewards(clients)
            if progress is not None:
                progress(f"SQLite group commit, {clients} clients", k, len(params.clients))
            sql = asyncio.run(_sqlite_level(root / f"sqlite-{clients}.db", clients, n))
            results = {}
            for kind, stream in (("cpm", False), ("cpm_stream", True)):
                if progress is not None:
                    how = "ReportRewards streams" if stream else "ReportReward calls"
                    progress(f"CPM, {how}, {clients} clients", k, len(params.clients))
                level_dir = root / f"{kind}-{clients}"
                level_dir.mkdir()
                results[kind] = asyncio.run(
                    _cpm_level(level_dir, clients, n, params.seed + k, stream=stream)
                )
            if progress is not None:
                progress(f"bare mTLS echo stream, {clients} clients", k, len(params.clients))
            echo_dir = root / f"echo-{clients}"
            echo_dir.mkdir()
            echo = asyncio.run(_echo_level(echo_dir, clients, n, params.seed + k))
            levels.append(
                {
                    "clients": clients,
                    **results,
                    "echo": echo,
                    "sqlite": sql,
                    "ratio": results["cpm"]["acks_per_s"] / sql["inserts_per_s"],
                    "stream_ratio": results["cpm_stream"]["acks_per_s"] / sql["inserts_per_s"],
                    # The ceiling any server reaches here with Python gRPC and TLS, and the
                    # share of it the CPM reaches with durable acknowledgement.
                    "echo_ratio": echo["acks_per_s"] / sql["inserts_per_s"],
                    "stream_share_of_echo": results["cpm_stream"]["acks_per_s"]
                    / echo["acks_per_s"],
                }
            )
        if progress is not None:
            progress("done", len(params.clients), len(params.clients))
    return {
        "params": {k: v for k, v in asdict(params).items() if k != "workdir"},
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "levels": levels,
    }


def render_report(report: Mapping[str, Any], console: Any) -> None:
    """One rich table: per concurrency and RPC, acks/s, SQLite limit, ratio, latency, CPU."""
    from rich.table import Table

    table = Table(title="Durable reward acknowledgement (real CPM, mTLS, SQLite WAL FULL)")
    cols = ("clients", "RPC", "CPM acks/s", "SQLite inserts/s", "ratio", "p50 ms", "p99 ms")
    for col in (*cols, "CPM CPU ms/ack", "client CPU ms/ack"):
        table.add_column(col, justify="right")
    for lv in report["levels"]:
        for rpc, key, ratio in (
            ("ReportReward", "cpm", "ratio"),
            ("ReportRewards", "cpm_stream", "stream_ratio"),
            ("bare mTLS echo", "echo", "echo_ratio"),
        ):
            cpm = lv[key]
            server = cpm["server_cpu_ms_per_ack"]
            table.add_row(
                str(lv["clients"]),
                rpc,
                f"{cpm['acks_per_s']:.0f}",
                f"{lv['sqlite']['inserts_per_s']:.0f}",
                f"{lv[ratio]:.1%}",
                f"{cpm['p50_ms']:.2f}",
                f"{cpm['p99_ms']:.2f}",
                "-" if server is None else f"{server:.3f}",
                f"{cpm['client_cpu_ms_per_ack']:.3f}",
            )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    """``python -m peerlm.bench.cpm_ack [--quick] [--json]`` (also ``peerlm bench cpm-ack``)."""
    from peerlm.bench.cli import app

    app(["cpm-ack", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
