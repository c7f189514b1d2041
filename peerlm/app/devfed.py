"""``peerlm up``: a local federation of real processes on loopback with real mTLS.

Creates (or reuses) a dev CA and certificates under the state directory, builds (or
reuses) the tiny models and the federation data, starts a CPM and N model-hosting agents
(``peerlm agent``) as separate processes, shows live progress from the CPM's admin stats,
and ends with a summary table (or one JSON object with ``--json``). Ctrl-C stops
everything: agents first (SIGTERM, each finishes or cuts its round and checkpoints), the
CPM last. ``--simulated`` runs synthetic-learning agents (:mod:`peerlm.app.simulated`)
instead: real processes and RPCs, no models.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, Annotated, Any, Literal

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from peerlm.app.agent_launch import agent_argv
from peerlm.app.private_state import PRIVATE_UMASK, make_private, tighten
from peerlm.node import NodeContext
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.protocols import (
    DEFAULT_OVERLAY_AGGREGATION,
    DEFAULT_PROTOCOL,
    check_names,
    lookup,
)
from peerlm.protocols import names as protocol_names
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

__all__ = ["DevFederation", "up_command"]

FEDERATION = "dev"


@dataclass
class DevFederation:
    """Paths of a dev federation's state directory."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def tls(self, name: str) -> TlsFiles:
        return TlsFiles(self.pki / "ca.crt", self.pki / f"{name}.crt", self.pki / f"{name}.key")

    def provision(self, agents: list[str]) -> None:
        """Create the CA and every certificate that does not exist yet."""
        self.pki.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        if not (self.pki / "ca.crt").exists():
            init_ca(self.pki, federation=FEDERATION)
        wanted = [("cpm", Role.CPM), ("admin", Role.ADMIN)] + [(a, Role.AGENT) for a in agents]
        for name, role in wanted:
            if not (self.pki / f"{name}.crt").exists():
                issue_certificate(self.pki, role, name, sans=["127.0.0.1", "localhost"], days=30)


def _spawn(
    args: list[str], log: Path, stdout: int | IO[Any] | None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    # Owner-only whatever the umask: a log holds peers' names, rounds and errors.
    handle = os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    # Own process group: Ctrl-C in the terminal reaches only `peerlm up`, which then stops
    # the children in order (agents first, CPM last) instead of all dying at once.
    return subprocess.Popen(
        args,
        stdout=stdout,
        stderr=handle,
        start_new_session=True,
        env={**os.environ, **(env or {})},
        umask=PRIVATE_UMASK,
    )


async def _wait_serving(target: str, tls: TlsFiles, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    channel = NodeContext.client(tls, role=Role.ADMIN).dial(target).channel
    stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
    try:
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"CPM at {target} not serving after {timeout:.0f}s")
            await asyncio.sleep(0.2)
    finally:
        await channel.close(None)


async def _stats(stub: Any) -> cpm_pb2.CpmStats | None:
    try:
        result: cpm_pb2.CpmStats = await stub.GetStats(cpm_pb2.GetStatsRequest(), timeout=2)
        return result
    except grpc.aio.AioRpcError:
        return None


def _stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


AgentArgv = Callable[[int, str, str], list[str]]


async def _run(
    fed: DevFederation,
    agents: list[str],
    rounds: int,
    agent_argv: AgentArgv,
    metrics_port: int | None,
    console: Console | None,
    protocols: tuple[str, ...] = (DEFAULT_PROTOCOL,),
    round_of: Callable[[str], int] | None = None,
    merge_senders: int = 1,
    co_sender_scoring: str = "pair",
    reward_normaliser: str = "robust",
) -> dict[str, Any]:
    # Imported here: the CPM package loads the matchmaking library (scikit-learn, SciPy),
    # seconds that every `peerlm` process would pay when the CLI mounts `up`.
    from peerlm.services.cpm import cpm_command

    port_file = fed.root / "cpm.port"
    port_file.unlink(missing_ok=True)
    cpm_args = cpm_command(
        tls=fed.tls("cpm"),
        db=fed.root / "cpm.db",
        port_file=port_file,
        federation=FEDERATION,
        metrics_port=metrics_port,
        init=True,  # `peerlm up` starts a new local federation every time
    )
    # Dev pace: the timer matches whoever is waiting after 15 s (30 s in production) when an
    # agent is missing; shorter fragments rounds when agents of different speeds finish apart.
    dev_env = {"PEERLM_CPM_ROUND_INTERVAL_S": "15", "PEERLM_CPM_PROTOCOLS": json.dumps(protocols)}
    if merge_senders != 1:
        dev_env["PEERLM_CPM_MERGE_SENDERS"] = str(merge_senders)
    if co_sender_scoring != "pair":
        dev_env["PEERLM_CPM_CO_SENDER_SCORING"] = co_sender_scoring
    dev_env["PEERLM_CPM_REWARD_NORMALISER"] = reward_normaliser
    started = time.monotonic()
    cpm = _spawn(cpm_args, fed.logs / "cpm.log", subprocess.DEVNULL, dev_env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if cpm.poll() is not None:
                raise RuntimeError(f"CPM exited with {cpm.returncode}; see {fed.logs / 'cpm.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError("CPM did not start within 60 s")
            await asyncio.sleep(0.1)
        target = f"127.0.0.1:{port_file.read_text().strip()}"
        await _wait_serving(target, fed.tls("admin"), 30)
        for i, name in enumerate(agents):
            procs.append(
                _spawn(
                    agent_argv(i, name, target),
                    fed.logs / f"{name}.log",
                    subprocess.PIPE,
                    AGENT_ENV,
                )
            )
        admin = NodeContext.client(fed.tls("admin"), role=Role.ADMIN).dial(target).channel
        stub = cpm_pb2_grpc.MatchmakerStub(admin)  # type: ignore[no-untyped-call]
        stats = await _watch(stub, procs, agents, rounds, console, round_of)
        await admin.close(None)
        reports = []
        for name, p in zip(agents, procs, strict=True):
            out = p.stdout.read().decode() if p.stdout else ""
            p.wait()
            # An agent that printed nothing (killed) gave no report: an error, not an empty
            # report that would pass for a quiet success.
            line = out.strip().splitlines()[-1] if out.strip() else ""
            try:
                reports.append(json.loads(line))
            except json.JSONDecodeError:
                reports.append({"name": name, "errors": [f"no report (exit {p.returncode})"]})
    finally:
        for p in procs:
            _stop(p)
        cpm_rc = _stop(cpm)
    rewards = sum(len(r.get("rewards", [])) for r in reports)
    pulled = sum(int(r.get("adapters_pulled", 0)) for r in reports)
    return {
        "federation": FEDERATION,
        "state_dir": str(fed.root),
        "cpm": target,
        "cpm_exit_code": cpm_rc,
        "seconds": round(time.monotonic() - started, 2),
        "rounds": rounds,
        "rounds_completed": min(
            (int(r.get("rounds_completed", r.get("rounds", 0))) for r in reports), default=0
        ),
        "rewards_reported": rewards,
        "matchmaking_rounds": stats.matchmaking_rounds if stats else 0,
        "directives_issued": stats.directives_issued if stats else 0,
        "rewards_observed": stats.rewards_observed if stats else 0,
        "theta_norm": stats.theta_norm if stats else 0.0,
        "adapters_pulled": pulled,
        "agents": reports,
    }


async def _watch(
    stub: Any,
    procs: list[subprocess.Popen[bytes]],
    agents: list[str],
    rounds: int,
    console: Console | None,
    round_of: Callable[[str], int] | None = None,
) -> cpm_pb2.CpmStats | None:
    """Progress until every agent exits: each agent's round from the CPM's stats, or from
    ``round_of(agent)`` where the agents do not report rounds to the CPM (FedWave)."""
    last: cpm_pb2.CpmStats | None = None
    # A pipe or log file gets one line per step (an agent's round, new rewards), not bars.
    lines = console is not None and not console.is_terminal
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=console is None or lines,
        transient=False,
    )
    seen_rounds: dict[str, int] = {}
    seen_rewards = 0
    started = time.monotonic()
    with progress:
        tasks = {a: progress.add_task(f"agent {a}", total=rounds) for a in agents}
        cpm_task = progress.add_task("CPM rewards", total=None)
        while True:
            stats = await _stats(stub)
            if stats is not None:
                last = stats
                for a in stats.agents:
                    if a.name in tasks:
                        progress.update(tasks[a.name], completed=a.last_round)
                        if lines and console and a.last_round != seen_rounds.get(a.name, 0):
                            console.print(
                                f"[{time.monotonic() - started:6.0f} s] {a.name}: round "
                                f"{a.last_round}/{rounds}",
                                highlight=False,
                            )
                        seen_rounds[a.name] = a.last_round
                progress.update(
                    cpm_task,
                    completed=stats.rewards_observed,
                    description=f"CPM: {stats.matchmaking_rounds} matchmaking rounds, "
                    f"{stats.rewards_observed} rewards",
                )
                if round_of is not None:
                    for agent in agents:
                        done = round_of(agent)
                        progress.update(tasks[agent], completed=done)
                        if lines and console and done != seen_rounds.get(agent, 0):
                            console.print(
                                f"[{time.monotonic() - started:6.0f} s] {agent}: round "
                                f"{done}/{rounds}",
                                highlight=False,
                            )
                        seen_rounds[agent] = done
                if lines and console and stats.rewards_observed != seen_rewards:
                    seen_rewards = stats.rewards_observed
                    console.print(
                        f"[{time.monotonic() - started:6.0f} s] CPM: "
                        f"{stats.matchmaking_rounds} matchmaking rounds, {seen_rewards} rewards",
                        highlight=False,
                    )
            if all(p.poll() is not None for p in procs):
                final = await _stats(stub)
                return final or last
            await asyncio.sleep(0.5)


def _sim_argv(
    fed: DevFederation, agents: list[str], rounds: int, seed: int, heterogeneity: str
) -> AgentArgv:
    def argv(i: int, name: str, target: str) -> list[str]:
        t = fed.tls(name)
        return [
            sys.executable, "-m", "peerlm", "sim-agent", "--name", name, "--index", str(i),
            "--peers", ",".join(agents), "--cpm", target, "--ca-cert", str(t.ca_cert),
            "--cert", str(t.cert), "--key", str(t.key), "--federation", FEDERATION,
            "--rounds", str(rounds), "--seed", str(seed), "--heterogeneity", heterogeneity,
        ]  # fmt: skip

    return argv


#: N agents share the machine's cores: one BLAS/torch thread each avoids oversubscription
#: (measured 3-5x slower steps with 2 threads per agent on 2 cores). No hub, no progress bars.
AGENT_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}

#: Architectures of the bundled tiny models, assigned to agents round-robin.
ARCHS: tuple[str, ...] = ("gpt2", "gpt_neox", "bloom", "qwen2")


@dataclass(frozen=True)
class RealPlan:
    """How ``peerlm up`` runs model-hosting agents."""

    size: str = "tiny"
    local_steps: int = 8
    transfer_limit: int = 16
    eval_limit: int = 12
    max_new_tokens: int = 64
    round_timeout_s: float = 60.0
    alpha: float = 0.1
    overlay: bool = False
    family: str | None = None
    # What overlay pulls become: a catalogue merge that aggregates overlay pulls
    # (peerlm.protocols; pmix, SemanticDFL, or svd_hka, OnePeFT).
    aggregation: str = DEFAULT_OVERLAY_AGGREGATION
    # OnePeFT's one-shot mode: each agent aggregates once after joining (overlay.aggregate_once).
    one_shot: bool = False
    # Protocols off by default (catalogue baselines) that --protocols names: the agents
    # execute them besides those on by default, or the CPM could never pair anyone with them.
    extra_protocols: tuple[str, ...] = ()
    # Where a student measures Eq. 3's losses: "val" (its validation data, the paper),
    # "probe" (the public probe set, every category) or "lacked" (the probe's problems of
    # the categories it lacks): the experiment's ``reward``/``probe_scope``.
    reward: str = "probe"
    probe_per_category: int = 2
    # Below _stop's 10 s before SIGKILL: Ctrl-C lets each agent cut its round and checkpoint.
    stop_grace_s: float = 5.0


#: Dev overlay schedule (``peerlm up --overlay``): short hops and leases so a handful of
#: agents build the overlay within seconds; the build starts ``OVERLAY_STARTUP_S`` after the
#: configurations are written, when the agents have loaded their models and joined.
DEV_OVERLAY_PROTOCOL: Mapping[str, Any] = MappingProxyType(
    {
        "zone_cap": 4,
        "ttl_radius": 1,
        "hop_time": 0.3,
        "max_neighbours": 8,
        "replication": 2,
        "heartbeat_interval": 0.5,
        "lease_duration": 2.0,
        "epoch_period": 3600.0,
        "query_timeout": 6.0,
    }
)
#: Seconds from writing the agents' configuration to the overlay's first build (genesis).
#: Every agent must have joined by then, or nobody is placed until the next epoch: on a
#: loaded 2-core machine agents took 33 s to join (CI, 2026-11-24) and 76 s beside seven
#: other jobs (a test run the same day), so 120.
OVERLAY_STARTUP_S = 120.0
#: How much longer than the startup an agent waits for its placement (a loaded machine).
OVERLAY_PLACEMENT_SLACK_S = 90.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_slice_files(
    out: Path, data_dir: Path, world: Any, agents: list[str]
) -> list[dict[str, Path]]:
    """Per agent, the held-out test problems of each slice (own, lacked, public skills) as
    JSONL under ``out/<agent>/``: what the final table's before -> after columns measure.
    The test set is interleaved by category, so any prefix an agent evaluates covers the
    slice's categories in proportion."""
    from peerlm.agent import read_jsonl, write_jsonl

    test = read_jsonl(data_dir / "test.jsonl")
    files: list[dict[str, Path]] = []
    for i, name in enumerate(agents):
        mine: dict[str, Path] = {}
        for slice_name in ("own", "lacked", "public"):
            problems = [p for p in test if world.slice_of(i, p.category) == slice_name]
            if problems:
                path = out / name / f"{slice_name}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_jsonl(path, problems)
                mine[slice_name] = path
        files.append(mine)
    return files


def _write_reward_files(
    out: Path, data_dir: Path, world: Any, agents: list[str], plan: RealPlan, seed: int
) -> list[Path | None]:
    """Per agent, the problems its reward is measured on (``plan.reward``): None for its
    validation data, else a probe set of fresh bank problems (``probe_problems``), whole or
    of the agent's lacked categories, under ``out/<agent>/``.

    Each agent's probe is drawn from a seed of its own (the world seed and its name): a
    teacher that knew a student's probe problems could tune its answers to them and
    inflate the reward the CPM learns from (docs/experiment.md, "The reward"); with
    draws of its own it can only teach the skill. Private only while the world seed is:
    the draw is a public function of (seed, name), reproducible on purpose.
    ``run-experiment`` shares one probe among its clients, as its Oracle pairing measures
    everyone's gain on it."""
    import hashlib

    from peerlm.agent import CATEGORIES, probe_problems, read_jsonl, write_jsonl

    if plan.reward == "val":
        return [None] * len(agents)
    data = [data_dir / "test.jsonl", data_dir / "transfer.jsonl"]
    data += sorted((data_dir / "clients").glob("*/*.jsonl"))
    taken = [problem for path in data for problem in read_jsonl(path)]
    files: list[Path | None] = []
    for i, name in enumerate(agents):
        own_seed = int(hashlib.sha256(f"peerlm-probe/{seed}/{name}".encode()).hexdigest()[:12], 16)
        probe = probe_problems(plan.probe_per_category, own_seed, taken, CATEGORIES)
        mine = [
            p for p in probe if plan.reward == "probe" or world.slice_of(i, p.category) == "lacked"
        ]
        path = out / name / "reward_probe.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        # An agent that lacks nothing measures on the whole probe (as in the experiment).
        write_jsonl(path, mine or probe)
        files.append(path)
    return files


def _prepare_real(
    fed: DevFederation,
    agents: list[str],
    rounds: int,
    seed: int,
    plan: RealPlan,
    console: Console | None,
) -> AgentArgv:
    """Build (or reuse) models and the default world's data; write one config per agent."""
    from peerlm.agent import build_federation_data
    from peerlm.app.cli_models import build_with_progress, models_cache_dir

    size: Literal["tiny", "micro"] = "micro" if plan.size == "micro" else "tiny"
    # The shared cache: a first `up` builds what `run-experiment` and later `up`s reuse.
    models_dir = models_cache_dir(size)
    if console:
        console.print(f"building or reusing {plan.size} models in {models_dir} ...")
    # Model seed 0 whatever the run's seed: runs with other seeds share the cached models
    # (the run seed still drives the data, the adapters and the batches).
    build_with_progress(models_dir, ARCHS, size, console or Console(stderr=True, quiet=True))
    data_dir = fed.root / "data"
    manifest = build_federation_data(data_dir, len(agents), alpha=plan.alpha, seed=seed)
    slice_files = _write_slice_files(fed.root / "eval", data_dir, manifest.world, agents)
    public_file = _write_public_pairs(data_dir, manifest.world)
    reward_files = _write_reward_files(
        fed.root / "eval", data_dir, manifest.world, agents, plan, seed
    )
    configs = fed.root / "agents"
    configs.mkdir(parents=True, exist_ok=True)
    # With the overlay every agent serves on a known port, and all bootstrap through agent-0.
    ports = [_free_port() if plan.overlay else 0 for _ in agents]
    protocol = {**DEV_OVERLAY_PROTOCOL, "genesis_time": time.time() + OVERLAY_STARTUP_S}
    for i, name in enumerate(agents):
        t = fed.tls(name)
        client = data_dir / "clients" / str(i)
        config: dict[str, Any] = {
            "federation": FEDERATION,
            "listen": f"127.0.0.1:{ports[i]}",
            "state_dir": str(fed.root / "agents" / name),
            "model": str(models_dir / (plan.family or ARCHS[i % len(ARCHS)])),
            "device": "cpu",
            "train_file": str(client / "train.jsonl"),
            "val_file": str(client / "val.jsonl"),
            "transfer_file": str(data_dir / "transfer.jsonl"),
            "transfer_sha256": manifest.transfer_sha256,
            "public_file": str(public_file),
            "reward_file": None if reward_files[i] is None else str(reward_files[i]),
            "rounds": rounds,
            "round_timeout_s": plan.round_timeout_s,
            "local_steps": plan.local_steps,
            "transfer_limit": plan.transfer_limit,
            "eval_limit": plan.eval_limit,
            "eval_slice_files": {k: str(v) for k, v in slice_files[i].items()},
            "max_new_tokens": plan.max_new_tokens,
            "stop_grace_s": plan.stop_grace_s,
            "seed": seed + i,
            "log_format": "json",
            "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
        }
        if executed := agent_protocols(plan):
            config["protocols"] = executed
        if plan.overlay:
            config["overlay"] = {
                "enabled": True,
                "bootstrap": [f"{agents[0]}@127.0.0.1:{ports[0]}"],
                "protocol": protocol,
                "k": 2,
                # Rounds start once the first build (at genesis) has placed the agent, so
                # short micro-model rounds cannot all pass before there is anyone to pull.
                "placement_wait_s": OVERLAY_STARTUP_S + OVERLAY_PLACEMENT_SLACK_S,
                "aggregation": plan.aggregation,
                "aggregate_once": plan.one_shot,
            }
        (configs / f"{name}.yaml").write_text(json.dumps(config, indent=2))

    return agent_argv(configs)


def agent_protocols(plan: RealPlan) -> list[str] | None:
    """The protocols an agent of ``plan`` names in its config: those on by default and the
    plan's extra ones; None (the agent's own default) when the plan has no extra one."""
    if not plan.extra_protocols:
        return None
    return [*protocol_names(on_by_default=True), *plan.extra_protocols]


def _write_public_pairs(data_dir: Path, world: Any) -> Path:
    """D_pub of OnePeFT's HKA: the transfer problems of the world's public categories with
    their references (public in this world, like the paper's Alpaca); never private ones."""
    from peerlm.agent import read_jsonl, write_jsonl

    public = [
        p
        for p in read_jsonl(data_dir / "transfer.jsonl")
        if p.category in set(world.public_categories)
    ]
    path = data_dir / "public_pairs.jsonl"
    write_jsonl(path, public)
    return path


def _before_after(r: Mapping[str, Any], slice_name: str, metric: str, fmt: str) -> str:
    before = r.get("slices_before", {}).get(slice_name, {}).get(metric)
    after = r.get("slices_after", {}).get(slice_name, {}).get(metric)
    if before is None:
        return "-"
    return f"{before:{fmt}}→{after:{fmt}}" if after is not None else f"{before:{fmt}}→?"


def _peer_slot(r: Mapping[str, Any]) -> str:
    """Integrations the agent's peer slot holds and, per slice, the share of its problems
    the router sent there at the end (``integration: separate``); "-" without a slot."""
    shares = [
        f"{name} {v['peer_share']:.2f}"
        for name, v in r.get("slices_after", {}).items()
        if isinstance(v, Mapping) and "peer_share" in v
    ]
    n = r.get("peer_slot_integrations")
    if not n and not shares:
        return "-"
    return f"{n or 0}" + (f" (routed {', '.join(shares)})" if shares else "")


def _agent_rows(r: Mapping[str, Any]) -> list[tuple[str, str]]:
    """One agent's figures as (label, value): the table's columns, or the narrow layout's
    lines. KB include the overlay's adapter pulls (received) and serves (sent)."""
    rewards = r.get("rewards", [])
    received = int(r.get("bytes_received", 0)) + int(r.get("overlay_bytes_received", 0))
    sent = int(r.get("bytes_sent", 0)) + int(r.get("overlay_bytes_sent", 0))
    return [
        ("model", Path(str(r.get("model", "simulated"))).name),
        ("lacked pass@1", _before_after(r, "lacked", "pass1", ".2f")),
        ("lacked NLL", _before_after(r, "lacked", "nll", ".3f")),
        ("own pass@1", _before_after(r, "own", "pass1", ".2f")),
        ("own NLL", _before_after(r, "own", "nll", ".3f")),
        ("val pass@1", f"{r.get('pass_at_1_before', 0):.2f}→{r.get('pass_at_1_after', 0):.2f}"),
        ("exch s/t", f"{r.get('exchanges', r.get('as_student', 0))}/{r.get('as_teacher', 0)}"),
        ("rewards", f"{len(rewards)}, mean {sum(rewards) / len(rewards):.4f}" if rewards else "0"),
        ("pulled", str(r.get("adapters_pulled", 0))),
        ("peer slot", _peer_slot(r)),
        ("KB sent/recv", f"{sent / 1024:.0f}/{received / 1024:.0f}"),
        ("errors", "; ".join(r.get("errors", [])) or "-"),
    ]


#: Below this console width the final report is one block per agent instead of a table.
WIDE_TABLE_COLUMNS = 140


def _table(result: dict[str, Any]) -> Table:
    """The final table, one row per agent (wide consoles)."""
    table = Table(
        title=f"peerlm dev federation: {result['rounds']} rounds in {result['seconds']} s"
    )
    agents = result["agents"]
    labels = [label for label, _ in _agent_rows(agents[0] if agents else {})]
    table.add_column("agent")
    for label in labels:
        table.add_column(label, justify="left" if label in ("model", "errors") else "right")
    for r in agents:
        table.add_row(r.get("name", "?"), *(value for _, value in _agent_rows(r)))
    return table


def _vertical(result: dict[str, Any]) -> str:
    """The final report for narrow consoles, pipes and files: one block per agent."""
    lines = [f"peerlm dev federation: {result['rounds']} rounds in {result['seconds']} s"]
    for r in result["agents"]:
        lines.append(f"{r.get('name', '?')}:")
        lines += [f"  {label:<14} {value}" for label, value in _agent_rows(r)]
    return "\n".join(lines)


def _print_report(console: Console, result: dict[str, Any]) -> None:
    if console.is_terminal and console.width >= WIDE_TABLE_COLUMNS:
        console.print(_table(result))
    else:
        console.print(_vertical(result), highlight=False, soft_wrap=True)


def _refuse_with_fedproxy(**given: bool) -> None:
    """--fedproxy runs model-hosting cohort agents that play only the cohort's rounds: the
    options of the CPM-directed, overlay, FedWave and simulated federations mean nothing
    there, and --resume is not offered (each run starts a new cohort)."""
    wrong = [f"--{name.replace('_', '-')}" for name, set_ in given.items() if set_]
    if wrong:
        raise typer.BadParameter(
            f"--fedproxy runs a FedProxy cohort (an owner and its members, cohort rounds "
            f"only): leave out {', '.join(wrong)}"
        )


#: ``peerlm up``'s options (typer reads each from its parameter's annotation).
_AgentsOption = Annotated[
    int | None,
    typer.Option(
        "--agents",
        "-n",
        min=2,
        help="Number of agents (default 4; --workflow: one per stage; --fedproxy: the "
        "owner and its members, default 3).",
    ),
]
_RoundsOption = Annotated[int, typer.Option("--rounds", "-r", min=1, help="Rounds per agent.")]
_StateDirOption = Annotated[Path, typer.Option(help="Where CA, databases and logs live.")]
_SeedOption = Annotated[int, typer.Option(help="Seed of data partition, models and learning.")]
_SimulatedOption = Annotated[
    bool, typer.Option(help="Synthetic-learning agents instead of model-hosting ones.")
]
_MicroOption = Annotated[
    bool, typer.Option(help="Micro models (seconds to build; for smoke tests).")
]
_HeterogeneityOption = Annotated[str, typer.Option(help="--simulated only: high or low.")]
_ResumeOption = Annotated[
    bool,
    typer.Option(help="Keep the CPM database and agent checkpoints of the last run."),
]
_MetricsPortOption = Annotated[int | None, typer.Option(help="CPM /metrics port.")]
_OverlayOption = Annotated[
    bool,
    typer.Option(
        help="Agents are overlay nodes (bootstrap: agent-0) and pull and aggregate their "
        "K most similar peers' adapters each round (SemanticDFL)."
    ),
]
_FamilyOption = Annotated[
    str | None,
    typer.Option(
        help=f"One model family for every agent ({', '.join(ARCHS)}); default round-robin. "
        "Adapters aggregate only within a family: with mixed families the overlay's "
        "pulls are refused (counted) by design."
    ),
]
_AggregationOption = Annotated[
    str,
    typer.Option(
        help="With --overlay, what the pulled adapters become: one of "
        + ", ".join(
            f"{e} ({lookup(e).paper}: {lookup(e).summary})"
            for e in protocol_names(overlay_aggregation=True)
        )
        + "."
    ),
]
_OneShotOption = Annotated[
    bool,
    typer.Option(
        "--one-shot",
        help="With --overlay, OnePeFT's one-shot mode: each agent pulls and aggregates its "
        "neighbours' adapters once after joining, then only trains locally and publishes "
        "its signature.",
    ),
]
_ProtocolsOption = Annotated[
    str,
    typer.Option(
        help=f"The CPM's protocol menu K_rec, comma-separated: {', '.join(protocol_names())} "
        f"(docs/matchmaker.md). {', '.join(protocol_names(admissibility='same_space'))} are "
        "recommended only between agents of one parameter space: combine with --family."
    ),
]
_RewardOption = Annotated[
    str,
    typer.Option(
        help="Where a student measures its Eq. 3 reward: val (its validation data, the "
        "paper), probe (a labelled public probe of every category) or lacked (the "
        "probe's problems of the categories it lacks); docs/experiment.md."
    ),
]
_MergeSendersOption = Annotated[
    int,
    typer.Option(
        min=1,
        max=16,
        help="Most senders one CPM merge directive "
        f"({', '.join(protocol_names(co_senders=True))}) "
        "names: the teacher and up to this many minus one co-senders (docs/matchmaker.md).",
    ),
]
_CoSenderScoringOption = Annotated[
    str,
    typer.Option(
        help="How the CPM picks a merge directive's co-senders (with --merge-senders > "
        "1): pair (each by its own pair UCB) or group (the group as one arm).",
    ),
]
_RewardNormaliserOption = Annotated[
    str,
    typer.Option(
        help="How the CPM normalises rewards before the bandit learns them: robust "
        "(median/MAD over the last 256 rewards; docs/security.md) or zscore (the paper's "
        "running z-score, winsorised).",
    ),
]
_WorkflowOption = Annotated[
    bool,
    typer.Option(
        "--workflow",
        help="A FedWave value chain instead: one expert agent per stage of the bundled "
        "code chain (specify, implement, test), exchanging routers and VCLayers over "
        "mTLS and aggregating the router each round (docs/fedwave.md).",
    ),
]
_FedproxyOption = Annotated[
    bool,
    typer.Option(
        "--fedproxy",
        help="A FedProxy cohort instead: agent 'owner' holds the full model (--family, "
        "default gpt2), compresses it to a proxy by Block Influence and runs --rounds "
        "cohort rounds with the other agents as its members (pull the proxy, train it "
        "with PCR, the owner merges by H-TIES) over mTLS (docs/fedproxy.md).",
    ),
]
_ProxyRatioOption = Annotated[
    float | None,
    typer.Option(
        "--proxy-ratio",
        help="With --fedproxy, the compression ratio κ: the share of the owner's blocks "
        "removed, in [0, 1) (default 0.5).",
    ),
]
_RoundDeadlineOption = Annotated[
    float | None,
    typer.Option(
        "--round-deadline",
        help="With --fedproxy, seconds the owner collects a round's updates before it "
        "merges what arrived (default 180; round 1 also waits for the members to start).",
    ),
]
_AsJsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


@dataclass(frozen=True)
class _UpOptions:
    """``peerlm up``'s options as given (:func:`up_command`)."""

    agents: int | None
    rounds: int
    state_dir: Path
    seed: int
    simulated: bool
    micro: bool
    heterogeneity: str
    resume: bool
    metrics_port: int | None
    overlay: bool
    family: str | None
    aggregation: str
    one_shot: bool
    protocols: str
    reward: str
    merge_senders: int
    co_sender_scoring: str
    reward_normaliser: str
    workflow: bool
    fedproxy: bool
    proxy_ratio: float | None
    round_deadline: float | None
    as_json: bool

    @property
    def size(self) -> Literal["tiny", "micro"]:
        return "micro" if self.micro else "tiny"


def up_command(
    agents: _AgentsOption = None,
    rounds: _RoundsOption = 5,
    state_dir: _StateDirOption = Path("state/dev-federation"),
    seed: _SeedOption = 0,
    simulated: _SimulatedOption = False,
    micro: _MicroOption = False,
    heterogeneity: _HeterogeneityOption = "high",
    resume: _ResumeOption = False,
    metrics_port: _MetricsPortOption = None,
    overlay: _OverlayOption = False,
    family: _FamilyOption = None,
    aggregation: _AggregationOption = DEFAULT_OVERLAY_AGGREGATION,
    one_shot: _OneShotOption = False,
    protocols: _ProtocolsOption = DEFAULT_PROTOCOL,
    reward: _RewardOption = RealPlan.reward,
    merge_senders: _MergeSendersOption = 1,
    co_sender_scoring: _CoSenderScoringOption = "pair",
    reward_normaliser: _RewardNormaliserOption = "robust",
    workflow: _WorkflowOption = False,
    fedproxy: _FedproxyOption = False,
    proxy_ratio: _ProxyRatioOption = None,
    round_deadline: _RoundDeadlineOption = None,
    as_json: _AsJsonOption = False,
) -> None:
    """Start a local federation (dev CA, CPM, N agents) on loopback with real mTLS."""
    opts = _UpOptions(**locals())
    # Every flag is checked before anything is touched: a typo must not cost the last run's
    # database and checkpoints.
    menu = _checked_menu(opts)
    names = _agent_names(opts, menu)
    console = None if as_json else Console(stderr=True)
    fed = _fresh_state(opts, names, console)
    try:
        argv = _agent_argvs(opts, fed, names, menu, console)
        # What up wrote with an explicit mode (certificates are 0644 by design) too: the
        # whole state directory is owner-only before any process starts.
        tighten(state_dir)
        result = asyncio.run(
            _run(
                fed,
                names,
                rounds,
                argv,
                metrics_port,
                console,
                menu,
                round_of=_round_counter(opts, fed),
                merge_senders=merge_senders,
                co_sender_scoring=co_sender_scoring,
                reward_normaliser=reward_normaliser,
            )
        )
    except KeyboardInterrupt:
        if console:
            console.print("[yellow]interrupted; all processes stopped[/]")
        raise typer.Exit(code=130) from None
    except (RuntimeError, TimeoutError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    _add_summaries(opts, result)
    _print_result(opts, fed, result)
    if any(r.get("errors") for r in result["agents"]) or result["cpm_exit_code"] != 0:
        raise typer.Exit(code=1)


def _checked_menu(opts: _UpOptions) -> tuple[str, ...]:
    """The CPM's protocol menu (``--protocols``), after every option that does not depend
    on the kind of federation is checked; a wrong one is a ``BadParameter``."""
    family, simulated, overlay, reward = opts.family, opts.simulated, opts.overlay, opts.reward
    if family is not None and family not in ARCHS:
        raise typer.BadParameter(f"unknown family {family!r}; one of {', '.join(ARCHS)}")
    if simulated and (overlay or family):
        raise typer.BadParameter("--overlay and --family need model-hosting agents")
    overlay_merges = protocol_names(overlay_aggregation=True)
    if opts.aggregation not in overlay_merges:
        raise typer.BadParameter(
            f"unknown aggregation {opts.aggregation!r}; one of {', '.join(overlay_merges)}"
        )
    if reward not in ("val", "probe", "lacked"):
        raise typer.BadParameter(f"unknown reward {reward!r}; val, probe or lacked")
    if simulated and reward != RealPlan.reward:
        raise typer.BadParameter("simulated agents measure no reward: leave --reward out")
    if opts.aggregation != DEFAULT_OVERLAY_AGGREGATION and not overlay:
        raise typer.BadParameter("--aggregation applies to overlay pulls: add --overlay")
    if opts.one_shot and not overlay:
        raise typer.BadParameter("--one-shot applies to overlay pulls: add --overlay")
    menu = tuple(p.strip() for p in opts.protocols.split(",") if p.strip())
    try:
        check_names(menu)
    except ValueError:
        menu = ()
    if not menu:
        raise typer.BadParameter(
            f"--protocols {opts.protocols!r}: name each of {', '.join(protocol_names())} at "
            "most once"
        )
    if simulated and menu != (DEFAULT_PROTOCOL,):
        raise typer.BadParameter(
            f"simulated agents execute {DEFAULT_PROTOCOL} only: leave --protocols out"
        )
    _check_cpm_options(opts, menu)
    _check_fedproxy_options(opts)
    return menu


def _check_cpm_options(opts: _UpOptions, menu: tuple[str, ...]) -> None:
    """``--merge-senders``, ``--co-sender-scoring`` and ``--reward-normaliser``."""
    if opts.merge_senders != 1 and not any(lookup(p).co_senders for p in menu):
        merges = " or ".join(protocol_names(co_senders=True))
        raise typer.BadParameter(f"--merge-senders applies to merge protocols: add {merges}")
    if opts.co_sender_scoring not in ("pair", "group"):
        raise typer.BadParameter("--co-sender-scoring must be 'pair' or 'group'")
    if opts.co_sender_scoring != "pair" and opts.merge_senders == 1:
        raise typer.BadParameter("--co-sender-scoring group needs --merge-senders > 1")
    if opts.reward_normaliser not in ("zscore", "robust"):
        raise typer.BadParameter("--reward-normaliser must be 'zscore' or 'robust'")


def _check_fedproxy_options(opts: _UpOptions) -> None:
    """``--proxy-ratio`` and ``--round-deadline``: the FedProxy owner's, in range."""
    proxy_ratio, round_deadline = opts.proxy_ratio, opts.round_deadline
    if proxy_ratio is not None and not opts.fedproxy:
        raise typer.BadParameter("--proxy-ratio is the FedProxy owner's κ: add --fedproxy")
    if proxy_ratio is not None and not 0 <= proxy_ratio < 1:
        raise typer.BadParameter(f"--proxy-ratio {proxy_ratio}: κ must lie in [0, 1)")
    if round_deadline is not None and not opts.fedproxy:
        raise typer.BadParameter("--round-deadline is the FedProxy owner's: add --fedproxy")
    if round_deadline is not None and not round_deadline > 0:
        raise typer.BadParameter(f"--round-deadline {round_deadline}: must be positive seconds")


def _agent_names(opts: _UpOptions, menu: tuple[str, ...]) -> list[str]:
    """The agents of the federation the options name (a FedProxy cohort, a FedWave chain's
    stages, or ``agent-i``), after the options that kind refuses are checked."""
    agents = opts.agents
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import cohort_names

        _refuse_with_fedproxy(
            simulated=opts.simulated,
            overlay=opts.overlay,
            workflow=opts.workflow,
            resume=opts.resume,
            protocols=menu != (DEFAULT_PROTOCOL,),
            reward=opts.reward != RealPlan.reward,
            aggregation=opts.aggregation != DEFAULT_OVERLAY_AGGREGATION,
            merge_senders=opts.merge_senders != 1,
            heterogeneity=opts.heterogeneity != "high",
        )
        return cohort_names(agents if agents is not None else 3)
    if opts.workflow:
        from peerlm.app.devfed_workflow import WORKFLOW_AGENTS

        if (
            opts.simulated
            or opts.overlay
            or menu != (DEFAULT_PROTOCOL,)
            or opts.reward != RealPlan.reward
        ):
            raise typer.BadParameter(
                "--workflow runs model-hosting FedWave experts: leave out --simulated, "
                "--overlay, --protocols and --reward"
            )
        if agents is not None and agents != len(WORKFLOW_AGENTS):
            raise typer.BadParameter(
                f"--workflow runs one agent per stage of the code chain "
                f"({len(WORKFLOW_AGENTS)}): leave out --agents"
            )
        return list(WORKFLOW_AGENTS)
    return [f"agent-{i}" for i in range(agents if agents is not None else 4)]


def _fresh_state(opts: _UpOptions, names: list[str], console: Console | None) -> DevFederation:
    """The state directory, owner-only, without the last run's database and checkpoints
    (unless ``--resume``), with a certificate for every process."""
    state_dir = opts.state_dir
    # Private data, keys, the CPM database, checkpoints and logs: owner-only, for every file
    # this command and its children (which inherit the umask) write (private_state).
    tightened = make_private(state_dir)
    fed = DevFederation(state_dir)
    if not opts.resume:
        import shutil

        for suffix in ("", "-wal", "-shm"):
            (state_dir / f"cpm.db{suffix}").unlink(missing_ok=True)
        shutil.rmtree(state_dir / "agents", ignore_errors=True)
    fed.provision(names)
    if console:
        if tightened:
            console.print(f"made {tightened} files and folders of {state_dir} owner-only")
        console.print(
            f"[bold]peerlm up[/]: {len(names)} agents, {opts.rounds} rounds, state in {state_dir}"
            + (" (FedWave workflow: " + " → ".join(names) + ")" if opts.workflow else "")
            + (
                f" (FedProxy cohort: {names[0]} and {len(names) - 1} members)"
                if opts.fedproxy
                else ""
            )
        )
    return fed


def _agent_argvs(
    opts: _UpOptions,
    fed: DevFederation,
    names: list[str],
    menu: tuple[str, ...],
    console: Console | None,
) -> Any:
    """Each agent's command line, after what it needs is prepared (models, data, configs)."""
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import prepare_cohort

        return prepare_cohort(
            fed,
            names,
            opts.rounds,
            opts.seed,
            size=opts.size,
            family=opts.family or "gpt2",
            ratio=0.5 if opts.proxy_ratio is None else opts.proxy_ratio,
            round_deadline_s=opts.round_deadline,
            console=console,
            free_port=_free_port,
            stop_grace_s=RealPlan.stop_grace_s,
        )
    if opts.workflow:
        from peerlm.app.devfed_workflow import prepare_workflow

        return prepare_workflow(
            fed,
            opts.rounds,
            opts.seed,
            size=opts.size,
            family=opts.family or "gpt2",
            console=console,
            free_port=_free_port,
            stop_grace_s=RealPlan.stop_grace_s,
        )
    if opts.simulated:
        return _sim_argv(fed, names, opts.rounds, opts.seed, opts.heterogeneity)
    plan = RealPlan(
        size=opts.size,
        overlay=opts.overlay,
        family=opts.family,
        aggregation=opts.aggregation,
        one_shot=opts.one_shot,
        reward=opts.reward,
        extra_protocols=tuple(p for p in menu if not lookup(p).on_by_default),
    )
    return _prepare_real(fed, names, opts.rounds, opts.seed, plan, console)


def _round_counter(opts: _UpOptions, fed: DevFederation) -> Any:
    """What counts a FedWave chain's or a FedProxy cohort's rounds (their agents report no
    rounds to a CPM): the agents' logs; None for a CPM-directed federation."""
    if not (opts.workflow or opts.fedproxy):
        return None
    from peerlm.app.devfed_workflow import LogRounds

    # The owner's rounds closed, the members' rounds trained; FedWave's rounds done.
    events = ("fedproxy_round_merged", "fedproxy_update_ready")
    return LogRounds(
        fed.logs,
        events if opts.fedproxy else "fedwave_round_done",
        # --resume appends to the last run's logs: count this run's rounds only.
        from_end=opts.resume,
    )


def _add_summaries(opts: _UpOptions, result: dict[str, Any]) -> None:
    """A FedWave chain's router agreement and stage scores, a FedProxy cohort's summary."""
    if opts.workflow:
        from peerlm.app.devfed_workflow import router_agreement, stage_scores

        agreed, played = router_agreement(result["agents"])
        result["fedwave"] = {
            "rounds_same_router": agreed,
            "rounds_played": played,
            "stages": stage_scores(result["agents"]),
        }
    if opts.fedproxy:
        from peerlm.app.devfed_fedproxy import cohort_summary

        result["fedproxy"] = cohort_summary(result["agents"])


def _print_result(opts: _UpOptions, fed: DevFederation, result: dict[str, Any]) -> None:
    """The JSON object (``--json``), or the report of the federation's kind on stdout."""
    if opts.as_json:
        typer.echo(json.dumps(result))
    elif opts.fedproxy:
        from peerlm.app.devfed_fedproxy import print_cohort_report

        print_cohort_report(Console(), result, fed.logs)
    elif opts.workflow:
        from peerlm.app.devfed_workflow import print_workflow_report

        print_workflow_report(Console(), result, fed.logs)
    else:
        _print_report(Console(), result)
        Console().print(
            f"CPM: {result['matchmaking_rounds']} matchmaking rounds, "
            f"{result['directives_issued']} directives, {result['rewards_observed']} rewards "
            f"committed, |theta| = {result['theta_norm']:.3f}; logs in {fed.logs}"
        )
        if opts.overlay:
            Console().print(
                f"overlay: {result['adapters_pulled']} neighbour adapters integrated"
                + ("" if opts.family else "; mixed families: cross-family pulls are refused")
            )
