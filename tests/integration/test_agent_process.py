"""A real `peerlm agent` process: resume after SIGKILL, health while training, refusals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from peerlm.agent.models.tiny import build_models

from peerlm.app.devfed import AGENT_ENV
from peerlm.forkserver import ChildProcess, ForkServer
from tests.agent_harness import start_agent
from tests.cpm_harness import FEDERATION, CpmProcess, Pki

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class World:
    tmp: Path
    pki: Pki
    cpm: CpmProcess
    models: Path
    data: Path
    transfer_sha256: str
    forks: ForkServer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, agent_forks: ForkServer) -> Iterator[World]:
    from peerlm.agent.tasks.dataset import build_federation_data

    tmp = tmp_path_factory.mktemp("agent")
    models = tmp / "models"
    build_models(models, ("gpt2",), size="micro")
    manifest = build_federation_data(tmp / "data", 2, seed=0)
    # a0, a1: the original tests; a2, a3: the SIGTERM tests (one CPM remembers each name's
    # last round, so every test that submits profiles needs names of its own).
    pki = Pki.create(tmp, agents=4)
    cpm = CpmProcess(pki, tmp / "cpm.db", tmp, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"}).start()
    yield World(tmp, pki, cpm, models, tmp / "data", manifest.transfer_sha256, agent_forks)
    cpm.terminate()


def _config(w: World, name: str, state: Path, **overrides: object) -> Path:
    t = w.pki.tls(name)
    client = w.data / "clients" / "0"
    config = {
        "federation": FEDERATION,
        "listen": "127.0.0.1:0",
        "cpm": w.cpm.target,
        "state_dir": str(state),
        "model": str(w.models / "gpt2"),
        "device": "cpu",
        "train_file": str(client / "train.jsonl"),
        "val_file": str(client / "val.jsonl"),
        "transfer_file": str(w.data / "transfer.jsonl"),
        "transfer_sha256": w.transfer_sha256,
        "rounds": 3,
        "round_timeout_s": 0.5,
        "local_steps": 2,
        "eval_limit": 2,
        "transfer_limit": 4,
        "max_new_tokens": 16,
        "log_format": "json",
        "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
    }
    config.update(overrides)
    path = state.parent / f"{name}-{state.name}.yaml"
    state.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def _start(w: World, config: Path, log: Path) -> ChildProcess:
    return start_agent(w.forks, config, log)


def _events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _run_together(
    w: World, folder: str, names: tuple[str, ...], **overrides: object
) -> tuple[list[dict[str, Any]], list[dict[str, object]]]:
    """Run agents ``names`` side by side to their end (exit 0 asserted); their summaries
    and every log event."""
    procs, logs = [], []
    for name in names:
        state = w.tmp / folder / name / "state"
        config = _config(w, name, state, **overrides)
        logs.append(w.tmp / folder / name / f"{name}.log")
        procs.append(_start(w, config, logs[-1]))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]
    summaries = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return summaries, [e for log in logs for e in _events(log)]


def _wait_for(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_agent_resumes_at_the_saved_round_after_sigkill(world: World) -> None:
    state = world.tmp / "resume" / "state"
    config = _config(world, "a0", state)
    log = world.tmp / "resume" / "a0.log"
    proc = _start(world, config, log)
    checkpoints = state / "checkpoints"
    # The checkpoint is written before the round's "round_done" line: wait for both, so the
    # kill cannot land between them.
    _wait_for(
        lambda: (
            (
                any(checkpoints.glob("round-000001"))
                and any(e.get("event") == "round_done" for e in _events(log))
            )
            or proc.poll() is not None
        ),
        240,
        "first checkpoint",
    )
    assert proc.poll() is None, log.read_text()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first_run = [e for e in _events(log) if e.get("event") == "round_done"]
    done_before = max(int(e["round"]) for e in first_run)  # type: ignore[call-overload]

    proc = _start(world, config, log)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["rounds_completed"] == 3
    events = _events(log)
    restored = [e for e in events if e.get("event") == "checkpoint_restored"]
    assert restored and int(restored[-1]["round"]) >= done_before  # type: ignore[call-overload]
    second_rounds = [
        int(e["round"])  # type: ignore[call-overload]
        for e in events[events.index(restored[-1]) :]
        if e.get("event") == "round_trained"
    ]
    assert second_rounds and second_rounds[0] == int(restored[-1]["round"]) + 1  # type: ignore[call-overload]


def _wait_round_started(log: Path, proc: ChildProcess) -> None:
    _wait_for(
        lambda: (
            any(e.get("event") == "round_started" for e in _events(log)) or proc.poll() is not None
        ),
        240,
        "round 1 started",
    )
    assert proc.poll() is None, log.read_text()[-2000:]


def test_sigterm_cuts_training_at_a_step_after_the_grace_and_exits_0(world: World) -> None:
    """SIGTERM mid-training: the grace runs out, training stops at a step boundary, the round
    is checkpointed, the process exits 0, and a restart resumes after that round."""
    state = world.tmp / "sigterm" / "state"
    config = _config(world, "a2", state, local_steps=1_000_000, rounds=3, stop_grace_s=1.0)
    log = world.tmp / "sigterm" / "a2.log"
    proc = _start(world, config, log)
    try:
        _wait_round_started(log, proc)
        time.sleep(0.5)  # inside the million-step training call
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["rounds_completed"] == 1 and summary["interrupted"] is True
    kinds = [e.get("event") for e in _events(log)]
    for kind in ("stop_requested", "stop_grace_over", "training_interrupted", "round_done"):
        assert kind in kinds, kind
    assert kinds.index("stop_grace_over") < kinds.index("training_interrupted")
    assert (state / "checkpoints" / "LATEST").read_text().strip() == "round-000001"

    # The checkpoint is a clean one: a restart resumes at round 2.
    config = _config(world, "a2", state, local_steps=2, rounds=2, stop_grace_s=1.0)
    proc = _start(world, config, log)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["rounds_completed"] == 2


def test_sigterm_within_the_grace_finishes_the_round(world: World) -> None:
    state = world.tmp / "sigterm-grace" / "state"
    config = _config(world, "a3", state, local_steps=20, rounds=50, stop_grace_s=600.0)
    log = world.tmp / "sigterm-grace" / "a3.log"
    proc = _start(world, config, log)
    try:
        _wait_round_started(log, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    # The round in progress was finished whole (not cut), then the agent stopped.
    assert summary["interrupted"] is False
    done = [e for e in _events(log) if e.get("event") == "round_done"]
    assert summary["rounds_completed"] == len(done) >= 1
    assert summary["rounds_completed"] < 50
    kinds = [e.get("event") for e in _events(log)]
    assert "stop_requested" in kinds and "stop_grace_over" not in kinds


def _menu_world(
    world: World, folder: str, protocols: list[str], env: dict[str, str] | None = None
) -> Iterator[World]:
    """A CPM of its own recommending ``protocols`` (K_rec), with fresh agent names."""
    tmp = world.tmp / folder
    pki = Pki.create(tmp, agents=4)
    cpm = CpmProcess(
        pki,
        tmp / "cpm.db",
        tmp,
        {
            "PEERLM_CPM_ROUND_INTERVAL_S": "3600",
            "PEERLM_CPM_PROTOCOLS": json.dumps(protocols),
            **(env or {}),
        },
    ).start()
    yield World(tmp, pki, cpm, world.models, world.data, world.transfer_sha256, world.forks)
    cpm.terminate()


@pytest.fixture(scope="module")
def logits_world(world: World) -> Iterator[World]:
    """Text and logits AKD (K_rec = akd, akd_logits); akd_logits is admissible only between
    agents of one parameter space."""
    yield from _menu_world(world, "logits", ["akd", "akd_logits"])


def test_logits_mode_between_agents_with_one_tokenizer(logits_world: World) -> None:
    """Two gpt2 agents that execute akd_logits only: the directive asks for logits, the
    student announces the teacher's tokenizer, so the package is logits and the student
    distils at the scheduled T."""
    summaries, events = _run_together(
        logits_world, "same", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        protocols=["akd_logits"],
    )  # fmt: skip
    assert sum(s["exchanges"] for s in summaries) >= 1
    built = [e for e in events if e.get("event") == "package_built"]
    assert built and all(e["mode"] == "logits" and e["protocol"] == "akd_logits" for e in built)
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert integrated and all(e["mode"] == "logits" for e in integrated)
    # Table 6: T from 2.5 (round 1) to 1.5 (round 2 of 2).
    assert {float(e["temperature"]) for e in integrated} <= {2.5, 1.5}


def test_logits_mode_falls_back_to_text_for_another_tokenizer(logits_world: World) -> None:
    """A gpt2 and a qwen2 agent that both want logits (``akd_mode: logits``): their
    parameter spaces differ, so the CPM can only recommend text AKD, and the teacher, asked
    for logits by its own setting, sends text to the other tokenizer."""
    w = logits_world
    build_models(w.models, ("qwen2",), size="micro")
    procs, logs = [], []
    for name, arch in (("a2", "qwen2"), ("a3", "gpt2")):
        state = w.tmp / f"mixed-{name}" / "state"
        config = _config(
            w, name, state, rounds=3, round_timeout_s=120, local_steps=2,
            model=str(w.models / arch), akd_mode="logits",
        )  # fmt: skip
        logs.append(w.tmp / f"mixed-{name}" / f"{name}.log")
        procs.append(_start(logits_world, config, logs[-1]))
    for p, log in zip(procs, logs, strict=True):
        p.communicate(timeout=600)
        assert p.returncode == 0, log.read_text()[-3000:]
    events = [e for log in logs for e in _events(log)]
    built = [e for e in events if e.get("event") == "package_built"]
    assert built and all(e["wanted"] == "logits" and e["mode"] == "text" for e in built)
    assert all(e["protocol"] == "akd" for e in built)  # akd_logits is inadmissible here
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert integrated and all(e["mode"] == "text" for e in integrated)


@pytest.fixture(scope="module")
def merge_world(world: World) -> Iterator[World]:
    """Merges only (K_rec = pmix, svd_hka)."""
    yield from _menu_world(world, "merge", ["pmix", "svd_hka"])


def test_merge_directives_pull_the_teachers_adapter_and_report_eq3(merge_world: World) -> None:
    """Two gpt2 agents of one parameter space under a merge-only menu. The
    CPM pairs them with pmix or svd_hka; the student pulls the teacher's adapter, merges it
    by that protocol and reports Eq. 3, which the CPM takes into its bandit."""
    w = merge_world
    summaries, events = _run_together(
        w, "pair", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        public_file=str(w.data / "transfer.jsonl"), overlay={"hka_steps": 1},
    )  # fmt: skip
    merged = sum(sum(s["merges_by_protocol"].values()) for s in summaries)
    assert merged >= 1 and sum(s["exchanges"] for s in summaries) == merged
    assert all(set(s["merges_by_protocol"]) <= {"pmix", "svd_hka"} for s in summaries)
    assert not [e for e in events if e.get("event") == "package_built"]  # no AKD at all
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert len(integrated) == merged
    assert all(e["protocol"] in ("pmix", "svd_hka") for e in integrated)
    sent = [e for e in events if e.get("event") == "adapter_sent"]
    assert {(e["peer"]) for e in sent} <= {"a0", "a1"} and sent
    # The CPM committed each merge's reward into its bandit.
    committed = [
        r
        for e in _events(w.tmp / "cpm.log")
        if e.get("event") == "rewards_committed"
        for r in e["rewards"]  # type: ignore[attr-defined]
    ]
    assert len(committed) == merged


@pytest.fixture(scope="module")
def fedsa_world(world: World) -> Iterator[World]:
    """The FedSA-LoRA baseline only (K_rec = fedsa, off by default: the agents name it)."""
    yield from _menu_world(world, "fedsa", ["fedsa"])


def test_a_fedsa_directive_is_executed_end_to_end(fedsa_world: World) -> None:
    """A protocol added by one catalogue entry and one module: two gpt2 agents that name
    fedsa are paired with it by the CPM, the student pulls the teacher's adapter, averages
    the A factors and reports Eq. 3, which the CPM commits."""
    w = fedsa_world
    summaries, events = _run_together(
        w, "pair", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        protocols=["fedsa"],
    )  # fmt: skip
    merged = sum(s["merges_by_protocol"].get("fedsa", 0) for s in summaries)
    assert merged >= 1 and sum(s["exchanges"] for s in summaries) == merged
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert len(integrated) == merged and all(e["protocol"] == "fedsa" for e in integrated)
    committed = [
        r
        for e in _events(w.tmp / "cpm.log")
        if e.get("event") == "rewards_committed"
        for r in e["rewards"]  # type: ignore[attr-defined]
    ]
    assert len(committed) == merged


def test_health_answers_while_a_training_step_runs(world: World) -> None:
    state = world.tmp / "health" / "state"
    config = _config(world, "a1", state, local_steps=400, rounds=1)
    log = world.tmp / "health" / "a1.log"
    proc = _start(world, config, log)
    try:
        _wait_for(
            lambda: (
                any(e.get("event") == "agent_ready" for e in _events(log))
                or proc.poll() is not None
            ),
            120,
            "agent ready",
        )
        ready = next(e for e in _events(log) if e.get("event") == "agent_ready")
        endpoint = str(ready["endpoint"])
        latencies = asyncio.run(_probe_health(world, endpoint, seconds=4.0))
        training = not any(e.get("event") == "round_trained" for e in _events(log))
        assert training, "training finished before the probe; raise local_steps"
        assert latencies and max(latencies) < 2.0
        # The bound: the health RPC answers within 200 ms while training runs.
        assert statistics.median(latencies) < 0.2, latencies
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


async def _probe_health(world: World, endpoint: str, seconds: float) -> list[float]:
    channel = world.pki.channel(endpoint, "a0")
    stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
    out: list[float] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            out.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
    finally:
        await channel.close()
    return out


def test_agent_refuses_a_different_transfer_set(world: World) -> None:
    state = world.tmp / "hash" / "state"
    config = _config(world, "a0", state, transfer_sha256="0" * 64)
    code, stderr = _run_to_exit(world, config)
    assert code == 2
    assert "transfer set" in stderr


def _run_to_exit(w: World, config: Path) -> tuple[int, str]:
    """An agent process that is expected to stop at start (a refused configuration): its
    exit code and standard error."""
    err_path = config.with_suffix(".stderr")
    with err_path.open("w") as err:
        proc = w.forks.spawn(
            [sys.executable, "-m", "peerlm", "agent", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **AGENT_ENV},
        )
    code = proc.wait(120)
    return code, err_path.read_text()


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("", "reward_file"),
        # Malformed: not JSON, a problem without its reference, a line over the reader's bound.
        ("{not json\n", "probe.jsonl:1"),
        ('{"prompt": "def f():"}\n', "probe.jsonl:1"),
        ('{"prompt": "' + "x" * 2_000_000 + '"}\n', "probe.jsonl:1"),
    ],
    ids=["empty", "not_json", "missing_field", "huge_line"],
)
def test_agent_refuses_an_empty_or_malformed_reward_file(
    world: World, content: str, named: str
) -> None:
    """A probe with nothing to measure on, or one that cannot be read, is a configuration
    error at start (exit 2, the file and line named), not a round that silently measures
    nothing or a crash mid-run."""
    probe = world.tmp / "reward" / "probe.jsonl"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(content)
    config = _config(world, "a0", world.tmp / "reward" / "state", reward_file=str(probe))
    code, stderr = _run_to_exit(world, config)
    assert code == 2
    assert named in stderr


def test_package_request_without_directive_is_refused(world: World) -> None:
    """A peer asking an agent for a package it was never directed to give gets refused."""
    state = world.tmp / "refuse" / "state"
    config = _config(world, "a1", state, local_steps=200, rounds=1)
    log = world.tmp / "refuse" / "a1.log"
    proc = _start(world, config, log)
    try:
        _wait_for(
            lambda: (
                any(e.get("event") == "agent_ready" for e in _events(log))
                or proc.poll() is not None
            ),
            120,
            "agent ready",
        )
        endpoint = str(next(e for e in _events(log) if e.get("event") == "agent_ready")["endpoint"])
        from peerlm.agent.peer.client import PeerExchangeError, fetch_package

        from tests.node_contexts import kit_context

        async def attempt() -> None:
            await fetch_package(
                kit_context(world.pki.root, "a0"),
                endpoint,
                "ab" * 16,
                expect="a1",
                max_bytes=1 << 20,
                timeout_s=5,
            )

        with pytest.raises(PeerExchangeError) as e:
            asyncio.run(attempt())
        assert e.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


FEDWAVE = {
    "workflow": {
        "stages": [
            {"name": "specify", "agents": ["a0"]},
            {"name": "implement", "agents": ["a1"]},
        ]
    },
    "router": {"top_k": 2},
}


def test_a_fedwave_agent_serves_its_parts_to_the_workflow_only(world: World) -> None:
    """An agent configured with a workflow serves round 0's router and VCLayer on its peer
    port to the workflow's agents (refusing others) and shows in ``peerlm status``; one not
    listed in the workflow refuses to start."""
    from peerlm.agent.fedwave.exchange import ShapeBounds
    from peerlm.agent.fedwave.exchange_client import pull_round
    from peerlm.agent.fedwave.params import VCLayerSettings
    from peerlm.agent.fedwave.router import MoERouter
    from peerlm.agent.fedwave.router_codec import router_shapes
    from peerlm.agent.fedwave.settings import FedWaveSettings
    from peerlm.agent.fedwave.workflow import Workflow

    from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc
    from tests.node_contexts import kit_context

    base = world.tmp / "fedwave"
    stray = _config(world, "a3", base / "stray", fedwave=FEDWAVE)
    refused = subprocess.run(
        [sys.executable, "-m", "peerlm", "agent", "--config", str(stray)],
        capture_output=True, text=True, timeout=180, env={**os.environ, **AGENT_ENV},
    )  # fmt: skip
    assert refused.returncode != 0
    assert "not listed in any stage of fedwave.workflow" in refused.stdout + refused.stderr

    config = _config(world, "a1", base / "state", local_steps=200, rounds=1, fedwave=FEDWAVE)
    log = base / "a1.log"
    proc = _start(world, config, log)
    try:
        _wait_for(
            lambda: (
                any(e.get("event") == "agent_ready" for e in _events(log))
                or proc.poll() is not None
            ),
            120,
            "agent ready",
        )
        endpoint = str(next(e for e in _events(log) if e.get("event") == "agent_ready")["endpoint"])
        ready = next(e for e in _events(log) if e.get("event") == "fedwave_ready")
        assert (ready["stage"], ready["published_round"]) == ("implement", 0)
        workflow = Workflow.model_validate(FEDWAVE["workflow"])
        settings = FedWaveSettings.model_validate(FEDWAVE)

        async def pulls() -> tuple[object, grpc.StatusCode | None]:
            from transformers import AutoConfig

            width = int(AutoConfig.from_pretrained(world.models / "gpt2").hidden_size)
            bounds = ShapeBounds(
                router_shapes=router_shapes(MoERouter(width, 2, settings.router)),
                hidden_size=width,
                vclayer=VCLayerSettings(),
            )
            parts = await pull_round(
                kit_context(world.pki.root, "a0"), workflow, "a0", 0, {"a1": endpoint}, bounds,
                deadline_s=30,
            )  # fmt: skip
            outsider = kit_context(world.pki.root, "a2")
            async with outsider.dial(endpoint) as peer:
                stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
                request = fedwave_pb2.PullPartRequest(round=0, kind=fedwave_pb2.PART_KIND_ROUTER)
                try:
                    async for _ in stub.PullPart(request, timeout=10):
                        pass
                except grpc.aio.AioRpcError as err:
                    return parts, err.code()
            return parts, None

        parts, outsider_code = asyncio.run(pulls())
        assert outsider_code == grpc.StatusCode.PERMISSION_DENIED
        assert not parts.missing and not parts.rejected  # type: ignore[attr-defined]
        assert parts.routers["a1"].n_samples > 0  # type: ignore[attr-defined]
        assert sorted(parts.vclayers) == ["a1"]  # type: ignore[attr-defined]
        # Every agent of the workflow starts from the same router.
        same = settings.initial_router(parts.vclayers["a1"].hidden_size).state_dict()  # type: ignore[attr-defined]
        assert all(torch_equal(same[k], v) for k, v in parts.routers["a1"].state.items())  # type: ignore[attr-defined]
        out = subprocess.run(
            [sys.executable, "-m", "peerlm", "status", "--fedwave", endpoint,
             "--pki-dir", str(world.pki.root), "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        row = json.loads(out.stdout)["fedwave"][0]
        assert (row["agent"], row["stage"], row["rounds"]) == ("a1", "implement", [0])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def scope_world(world: World) -> Iterator[World]:
    """Text AKD for agents with a teach scope, fresh names."""
    yield from _menu_world(world, "scope", ["akd"])


def test_a_teacher_without_shown_skill_answers_no_prompt(scope_world: World) -> None:
    """``teach_scope: competent`` over the wire: with a bound no validation result can reach
    (1.0), a teacher answers no prompt of X_u, the empty package travels and decodes, and
    the student's peer slot takes no step (an exchange all the same). Under
    ``reward_scope: answered`` the empty package is measured on nothing of the probe: its
    losses are unchanged and its reward is Eq. 3's KB penalty alone."""
    probe = scope_world.tmp / "scope" / "probe.jsonl"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(
        "".join((scope_world.data / "transfer.jsonl").read_text().splitlines(True)[:6])
    )
    summaries, events = _run_together(
        scope_world, "scope", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        teach_scope="competent", teach_min_pass=1.0, reward_file=str(probe),
        reward_scope="answered",
    )  # fmt: skip
    assert sum(s["exchanges"] for s in summaries) >= 1
    built = [e for e in events if e.get("event") == "package_built"]
    assert built and all(e["prompts"] == 0 for e in built)
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert integrated
    for e in integrated:
        assert e["loss_pre"] == e["loss_post"] and e["steps"] == 0
        assert e["reward"] == pytest.approx(-0.001 * float(e["kilobytes"]), abs=1e-4)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def multi_merge_world(world: World) -> Iterator[World]:
    """Merges only, and a merge directive names up to three senders (merge_senders=3)."""
    tmp = world.tmp / "multi"
    pki = Pki.create(tmp, agents=4)
    cpm = CpmProcess(
        pki,
        tmp / "cpm.db",
        tmp,
        {
            "PEERLM_CPM_ROUND_INTERVAL_S": "3600",
            "PEERLM_CPM_PROTOCOLS": json.dumps(["pmix", "svd_hka"]),
            "PEERLM_CPM_MERGE_SENDERS": "3",
        },
    ).start()
    yield World(tmp, pki, cpm, world.models, world.data, world.transfer_sha256, world.forks)
    cpm.terminate()


def test_a_merge_directive_with_co_senders_pulls_each_sender(multi_merge_world: World) -> None:
    """Three gpt2 agents of one space: the CPM pairs two of them and names the third as a
    co-sender of the merge (it is otherwise unmatched); the student pulls the teacher's and
    the co-sender's adapters, merges what it can use and reports one reward per directive."""
    w = multi_merge_world
    summaries, events = _run_together(
        w, "three", ("a0", "a1", "a2"), rounds=2, round_timeout_s=120, local_steps=2,
        public_file=str(w.data / "transfer.jsonl"), overlay={"hka_steps": 1},
    )  # fmt: skip
    merged = sum(sum(s["merges_by_protocol"].values()) for s in summaries)
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert merged >= 1 and len(integrated) == merged
    for e in integrated:
        senders = [*e["merged"], *e["skipped"]]  # type: ignore[misc]
        assert len(senders) == 2 and len(set(senders)) == 2 and e["teacher"] in senders
        assert e["teacher"] in e["merged"]  # type: ignore[operator]
    # Both adapters of a directive were pulled (the co-sender serves without a directive).
    assert any(len(e["merged"]) == 2 for e in integrated)  # type: ignore[arg-type]
    committed = [
        r
        for e in _events(w.tmp / "cpm.log")
        if e.get("event") == "rewards_committed"
        for r in e["rewards"]  # type: ignore[attr-defined]
    ]
    assert len(committed) == merged


@pytest.fixture(scope="module")
def slot_world(world: World) -> Iterator[World]:
    """Text AKD only, fresh names: the peer slot's test."""
    yield from _menu_world(world, "slot", ["akd"])


def _checkpoint(state: Path) -> Any:
    from peerlm.agent.checkpoint import CheckpointStore

    restored = CheckpointStore(state / "checkpoints").load_latest()
    assert restored is not None
    return restored


def test_after_an_akd_exchange_the_own_adapter_is_own_training_alone(slot_world: World) -> None:
    """``integration: separate`` over the wire: two agents with the same data, seed and
    configuration exchange by text AKD. Whatever each learnt from the other is in its peer
    slot; its own adapter is exactly what own-data training alone produced, so the two own
    adapters are equal (training is seeded per round), and a student's slot differs."""
    w = slot_world
    summaries, events = _run_together(
        w, "slot", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        acceptance_margin=None,
    )  # fmt: skip
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    learnt = [e for e in integrated if int(e["steps"]) > 0]  # type: ignore[call-overload]
    assert learnt
    a0, a1 = (_checkpoint(w.tmp / "slot" / name / "state") for name in ("a0", "a1"))
    assert a0.round == a1.round == 2
    assert a0.tensors.keys() == a1.tensors.keys()
    assert all(torch_equal(a0.tensors[k], a1.tensors[k]) for k in a0.tensors)
    # Every lesson that took a step is one slot integration, and nothing else is.
    assert sum(s["peer_slot_integrations"] for s in summaries) == len(learnt)
    for summary, ck in zip(summaries, (a0, a1), strict=True):
        assert ck.state["peer_slot"]["integrations"] == summary["peer_slot_integrations"]
        if summary["peer_slot_integrations"] >= 1:
            slot = ck.extras["peer_slot"]
            assert not all(torch_equal(slot[k], ck.tensors[k]) for k in ck.tensors)


@pytest.fixture(scope="module")
def self_check_world(world: World) -> Iterator[World]:
    """Text AKD only, fresh names: the self-checking teacher's test."""
    yield from _menu_world(world, "selfcheck", ["akd"])


def test_a_self_checking_teacher_sends_only_what_passed_and_the_slot_learns_no_empty_package(
    self_check_world: World,
) -> None:
    """``teach_self_check`` over the wire: each package holds exactly the answers that passed
    their prompt's example in the teacher's sandbox, and the counter says how many failed.
    A package left empty is an exchange all the same, but its student's peer slot takes no
    step and counts no integration."""
    w = self_check_world
    summaries, events = _run_together(
        w, "selfcheck", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2,
        acceptance_margin=None, teach_self_check=True,
    )  # fmt: skip
    checked = [e for e in events if e.get("event") == "teacher_self_checked"]
    built = [e for e in events if e.get("event") == "package_built"]
    assert checked and len(built) == len(checked)
    for c in checked:
        # Every X_u prompt of the bank shows an example, so every answer was run.
        assert c["checked"] == c["answers"] and c["sent"] == c["answers"] - c["failed"]
    assert sorted(e["prompts"] for e in built) == sorted(c["sent"] for c in checked)
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert integrated
    learnt = [e for e in integrated if int(e["steps"]) > 0]  # type: ignore[call-overload]
    assert sum(s["peer_slot_integrations"] for s in summaries) == len(learnt)
    if not any(e["prompts"] for e in built):  # every answer failed: nothing was learnt
        assert not learnt and all(s["peer_slot_integrations"] == 0 for s in summaries)


@pytest.fixture(scope="module")
def per_student_world(world: World) -> Iterator[World]:
    """A CPM of its own that pairs per student (``pairing: per_student``)."""
    yield from _menu_world(world, "per-student", ["akd"], {"PEERLM_CPM_PAIRING": "per_student"})


@pytest.fixture(scope="module")
def two_teachers_world(world: World) -> Iterator[World]:
    """A CPM of its own that gives every student two teachers a round; it matches only when
    all three agents have submitted, so every student has two others to learn from."""
    yield from _menu_world(
        world,
        "two-teachers",
        ["akd"],
        {
            "PEERLM_CPM_PAIRING": "per_student",
            "PEERLM_CPM_TEACHERS_PER_STUDENT": "2",
            "PEERLM_CPM_MIN_QUORUM": "3",
        },
    )


def test_a_student_of_two_teachers_learns_from_both_in_one_round(
    two_teachers_world: World,
) -> None:
    """Three agents under ``teachers_per_student: 2``: the round's matchmaking gives each
    agent four directives, as the teacher of the two others and as their student. Each
    serves one package generation to both its students, learns both lessons in the round
    (one after the other, into its peer slot) and reports a reward for each directive."""
    summaries, events = _run_together(
        two_teachers_world, "tt", ("a0", "a1", "a2"), rounds=1, round_timeout_s=180,
        local_steps=2,
    )  # fmt: skip
    for summary in summaries:
        assert summary["exchanges"] == summary["as_teacher"] == 2, summary
        assert len(summary["rewards"]) == 2
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    assert len(integrated) == 6 and {int(e["round"]) for e in integrated} == {1}  # type: ignore[call-overload]
    # Six distinct directives, each student's two from two distinct teachers.
    assert len({e["directive"] for e in integrated}) == 6
    assert Counter(e["teacher"] for e in integrated) == {"a0": 2, "a1": 2, "a2": 2}
    assert not [e for e in events if e.get("event") == "directive_skipped"]


def test_a_per_student_round_makes_each_agent_a_teacher_and_a_student(
    per_student_world: World,
) -> None:
    """Two agents under ``pairing: per_student``: every matchmaking gives each agent two
    directives, as the teacher of the other and as its student. Each acts on both in the
    same round: it serves the other its package (one generation for the round's
    directives) and learns from the other's, and reports the reward of its student
    directive; nothing is left for the next round."""
    w = per_student_world
    summaries, events = _run_together(
        w, "ps", ("a0", "a1"), rounds=2, round_timeout_s=120, local_steps=2
    )
    for summary in summaries:
        assert summary["exchanges"] == summary["as_teacher"] == 2, summary
        assert len(summary["rewards"]) == 2
    taught = [e for e in events if e.get("event") == "directive_teacher"]
    integrated = [e for e in events if e.get("event") == "exchange_integrated"]
    built = [e for e in events if e.get("event") == "package_built"]
    assert len(taught) == len(integrated) == len(built) == 4
    # A teacher's round: its directive as teacher and the other's package, in one round.
    assert sorted(int(e["round"]) for e in taught) == [1, 1, 2, 2]  # type: ignore[call-overload]
    assert not [e for e in events if e.get("event") == "directive_skipped"]
