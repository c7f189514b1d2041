"""``peerlm up``'s federation: real processes on loopback with real mTLS.

Creates (or reuses) a dev CA and certificates under the state directory, builds (or
reuses) the tiny models and the federation data, starts a CPM and N model-hosting agents
(``peerlm agent``) as separate processes, shows live progress from the CPM's admin stats,
and ends with a summary table (or one JSON object with ``--json``). Ctrl-C stops
everything: agents first (SIGTERM, each finishes or cuts its round and checkpoints), the
CPM last. ``--simulated`` runs synthetic-learning agents (:mod:`peerlm.app.simulated`)
instead: real processes and RPCs, no models. The command line (options, their checks, the
steps) is :mod:`peerlm.app.cli_up`; the final report, :mod:`peerlm.app.devfed_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from peerlm.app.agent_launch import agent_argv
from peerlm.app.private_state import PRIVATE_UMASK
from peerlm.forkserver import ChildProcess, ForkServer
from peerlm.node import NodeContext
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.protocols import (
    DEFAULT_OVERLAY_AGGREGATION,
    DEFAULT_PROTOCOL,
)
from peerlm.protocols import names as protocol_names
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

__all__ = ["DevFederation", "RealPlan", "prepare_real", "run_federation"]

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
    args: list[str],
    log: Path,
    stdout: int | IO[Any] | None,
    env: dict[str, str] | None = None,
    forks: ForkServer | None = None,
) -> ChildProcess:
    """Start one of the federation's processes, forked from ``forks`` where it can serve
    the command (:mod:`peerlm.forkserver`), else as a new interpreter."""
    # Owner-only whatever the umask: a log holds peers' names, rounds and errors.
    handle = os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    full_env = {**os.environ, **(env or {})}
    # Own process group: Ctrl-C in the terminal reaches only `peerlm up`, which then stops
    # the children in order (agents first, CPM last) instead of all dying at once.
    launch: Callable[..., ChildProcess] = subprocess.Popen if forks is None else forks.spawn
    with handle:
        return launch(
            args,
            stdout=stdout,
            stderr=handle,
            env=full_env,
            start_new_session=True,
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


def _stop(proc: ChildProcess, timeout: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


AgentArgv = Callable[[int, str, str], list[str]]


#: Dev pace: the CPM's timer matches whoever is waiting after this many seconds (30 in
#: production) when an agent is missing; shorter fragments rounds when agents of different
#: speeds finish apart.
DEV_ROUND_INTERVAL_S = 15.0
#: How long a simulated agent waits for a round's directive: the timer's interval and
#: slack. With the sim-agent's own default (5 s), agents that started seconds apart on a
#: loaded machine gave up rounds the CPM matched later, and played them alone.
SIM_DIRECTIVE_WAIT_S = DEV_ROUND_INTERVAL_S + 15.0


async def run_federation(
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
    pairing: str = "disjoint",
    teachers_per_student: int = 1,
    preload: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the CPM and the agents to their end; the federation's report. With ``preload``
    (the modules the agents import, :data:`AGENT_PRELOAD`) the agents are forked from one
    process that imported them once, started before the CPM so the imports overlap it."""
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
    dev_env = {
        "PEERLM_CPM_ROUND_INTERVAL_S": f"{DEV_ROUND_INTERVAL_S:g}",
        "PEERLM_CPM_PROTOCOLS": json.dumps(protocols),
    }
    if merge_senders != 1:
        dev_env["PEERLM_CPM_MERGE_SENDERS"] = str(merge_senders)
    if co_sender_scoring != "pair":
        dev_env["PEERLM_CPM_CO_SENDER_SCORING"] = co_sender_scoring
    dev_env["PEERLM_CPM_REWARD_NORMALISER"] = reward_normaliser
    # Always set: a PEERLM_CPM_* variable left in the shell must not override the flags.
    dev_env["PEERLM_CPM_PAIRING"] = pairing
    dev_env["PEERLM_CPM_TEACHERS_PER_STUDENT"] = str(teachers_per_student)
    started = time.monotonic()
    forks = None
    if preload:
        forks = ForkServer({**os.environ, **AGENT_ENV}, preload, fed.logs / "forkserver.log")
        forks.start()
    cpm = _spawn(cpm_args, fed.logs / "cpm.log", subprocess.DEVNULL, dev_env)
    procs: list[ChildProcess] = []
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
                    forks,
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
        if forks is not None:
            forks.close()
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
    procs: Sequence[ChildProcess],
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


def sim_argv(
    fed: DevFederation,
    agents: list[str],
    rounds: int,
    seed: int,
    heterogeneity: str,
    teachers_per_student: int = 1,
) -> AgentArgv:
    """The command of each simulated agent. It waits for a round's directive as long as the
    CPM's timer may take to match it (:data:`SIM_DIRECTIVE_WAIT_S`), and is told the CPM's
    ``teachers_per_student`` (a round that gives it more teachers is its error)."""

    def argv(i: int, name: str, target: str) -> list[str]:
        t = fed.tls(name)
        return [
            sys.executable, "-m", "peerlm", "sim-agent", "--name", name, "--index", str(i),
            "--peers", ",".join(agents), "--cpm", target, "--ca-cert", str(t.ca_cert),
            "--cert", str(t.cert), "--key", str(t.key), "--federation", FEDERATION,
            "--rounds", str(rounds), "--seed", str(seed), "--heterogeneity", heterogeneity,
            "--round-timeout", f"{SIM_DIRECTIVE_WAIT_S:g}",
            "--teachers-per-student", str(teachers_per_student),
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

#: What a model-hosting agent imports before it serves: about 7 CPU seconds per agent
#: (torch 1.2, peft and transformers 3.3, scikit-learn 1.8; ``python -X importtime``,
#: 2026-12-06) that ``peerlm up`` pays once for all its agents.
AGENT_PRELOAD: tuple[str, ...] = (
    "torch",
    "transformers",
    "peft",
    "sklearn.feature_extraction.text",
    "peerlm.agent.daemon",
)

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
    # Seconds from writing the configurations to the overlay's first build (--overlay-startup).
    overlay_startup_s: float = 120.0
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

    @classmethod
    def of_size(cls, size: str, **options: Any) -> RealPlan:
        """The plan of ``size``: tiny models get the defaults above, micro models
        :data:`MICRO_BUDGET`'s smaller per-round work (``options`` override either)."""
        budget = MICRO_BUDGET if size == "micro" else {}
        return cls(size=size, **{**budget, **options})


#: A micro federation's per-round work (``peerlm up --micro``): micro models are a smoke run
#: of the wiring, and what they write passes no test whatever its length, so they train,
#: answer and are evaluated on less (local steps, X_u answers, evaluation problems per slice,
#: tokens per completion). Measured on ``peerlm up --micro --overlay -n 4 -r 3 --family gpt2``
#: (2026-12-06): generation, distillation and evaluation were 40 % of the federation's CPU
#: seconds at the tiny budgets.
MICRO_BUDGET: Mapping[str, Any] = MappingProxyType(
    {"local_steps": 4, "transfer_limit": 8, "eval_limit": 6, "max_new_tokens": 24}
)


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
#: Seconds from writing the agents' configuration to the overlay's first build (genesis),
#: unless ``--overlay-startup`` says otherwise. Every agent must have joined by then, or
#: nobody is placed until the next epoch: on a loaded 2-core machine agents took 33 s to
#: join (CI, 2026-11-24) and 76 s beside seven other jobs (a test run the same day), so 120.
OVERLAY_STARTUP_S = RealPlan.overlay_startup_s
#: How much longer than the startup an agent waits for its placement (a loaded machine).
OVERLAY_PLACEMENT_SLACK_S = 90.0


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1, each free now, drawn at random outside the
    kernel's ephemeral range (``ip_local_port_range``), from which ``bind(0)`` and every
    outgoing connection take theirs. A port taken from that range is free again once this
    returns, and the kernel gave one to another process's connection before the agent bound
    it (an agent of ``up --overlay`` failed to start so, beside three test workers)."""
    import random
    import socket

    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    spans = [(a, b) for a, b in ((10_000, low - 1), (high + 1, 65_535)) if a <= b]
    pool = [port for a, b in spans for port in range(a, b + 1)]
    chosen: list[int] = []
    for port in random.SystemRandom().sample(pool, min(len(pool), 64 * n + 64)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == n:
            return chosen
    # No span outside the ephemeral range (an unusual kernel setting): the kernel's choice.
    while len(chosen) < n:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in chosen:
            chosen.append(port)
    return chosen


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


def prepare_real(
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
    ports = free_ports(len(agents)) if plan.overlay else [0] * len(agents)
    protocol = {**DEV_OVERLAY_PROTOCOL, "genesis_time": time.time() + plan.overlay_startup_s}
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
                "placement_wait_s": plan.overlay_startup_s + OVERLAY_PLACEMENT_SLACK_S,
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
