"""A hostile member of a FedWave workflow against running expert agents (bad
input): real ``peerlm agent`` processes on loopback mTLS, and beside them a4, holding a
real certificate of the federation and listed in the workflow's last stage, serving parts
made to harm (the product's :class:`FedWaveExchangeService` fed hostile blobs, as
tests/security builds its hostile servers): a router with NaN, of the wrong number of
experts, of finite-but-huge values (1e30), oversized; VCLayers likewise. The honest agents
refuse each part (counted with its reason), conclude every round with the same router among
themselves and never average a4's."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from peerlm.agent import Problem, build_code_chain, transfer_set_sha256, write_jsonl
from peerlm.agent.fedwave.exchange import PartKind, PartStore
from peerlm.agent.fedwave.exchange_service import FedWaveExchangeService, serve_fedwave
from peerlm.agent.fedwave.router import MoERouter
from peerlm.agent.fedwave.router_codec import encode_router
from peerlm.agent.fedwave.settings import FedWaveSettings
from peerlm.agent.fedwave.vclayer import VCLayer, encode_vclayer
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.tiny import build_models
from transformers import AutoConfig

from peerlm.forkserver import ForkServer
from tests.agent_harness import start_agent
from tests.cpm_harness import FEDERATION, CpmProcess, Pki
from tests.integration.test_fedwave_agents import (
    _events,
    _scrape,
    _stage_problems,
    _value,
    _wait_for,
)
from tests.node_contexts import kit_context
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOSTILE = "a3"
WORKFLOW = {
    "stages": [
        {"name": "specify", "agents": ["a0"]},
        {"name": "implement", "agents": ["a1"]},
        {"name": "test", "agents": ["a2", HOSTILE]},
    ]
}
HONEST = ("a0", "a1", "a2")
ROUNDS = 4
DEADLINE_S = 30.0
N_SAMPLES = 8


def _scaled(module: torch.nn.Module, value: float | None) -> torch.nn.Module:
    """``module`` with every parameter multiplied by ``value`` (None: set to NaN)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.full_like(p, float("nan")) if value is None else p * value)
    return module


def hostile_parts(settings: FedWaveSettings, hidden: int) -> dict[int, dict[PartKind, bytes]]:
    """Per round, what a4 serves: round 0 an honest router (round 0's are only counted) and
    a huge VCLayer; then NaN, the wrong shape, 1e30, oversized, for both kinds."""
    vc = settings.vclayer
    stage = "test"

    def router(width: int = hidden, experts: int = 3, value: float | None = 1.0) -> MoERouter:
        return _scaled(MoERouter(width, experts, settings.router), value)  # type: ignore[return-value]

    def layer(width: int = hidden, value: float | None = 1.0) -> VCLayer:
        return _scaled(VCLayer(width, vc), value)  # type: ignore[return-value]

    r, v = PartKind.ROUTER, PartKind.VCLAYER
    return {
        0: {
            r: encode_router(settings.initial_router(hidden), n_samples=N_SAMPLES, round=0),
            v: encode_vclayer(layer(value=1e30), stage=stage),
        },
        1: {
            r: encode_router(router(value=None), n_samples=N_SAMPLES, round=1),
            v: encode_vclayer(layer(value=None), stage=stage),
        },
        2: {
            r: encode_router(router(experts=2), n_samples=N_SAMPLES, round=2),
            v: encode_vclayer(layer(width=hidden // 2), stage=stage),
        },
        3: {
            # The largest n_i the codec takes, so that weight alone cannot dilute it.
            r: encode_router(router(value=1e30), n_samples=N_SAMPLES * 1000, round=3),
            v: encode_vclayer(layer(value=1e30), stage=stage),
        },
        4: {
            r: encode_router(router(width=hidden * 8), n_samples=N_SAMPLES, round=4),
            v: encode_vclayer(layer(width=hidden * 8), stage=stage),
        },
    }


class HostileServer:
    """a4's FedWaveExchange on loopback mTLS, serving ``parts`` (every round published at
    start), on a thread of its own until :meth:`stop`."""

    def __init__(self, pki: Path, workflow: Workflow, parts: dict[int, dict[PartKind, bytes]]):
        self._pki, self._workflow, self._parts = pki, workflow, parts
        self.port = free_port()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        ctx = kit_context(self._pki, HOSTILE)
        store = PartStore(keep_rounds=len(self._parts))
        for round_, parts in sorted(self._parts.items()):
            store.publish(round_, parts)
        service = FedWaveExchangeService(
            self._workflow, HOSTILE, store, chunk_bytes=64 * 1024, registry=ctx.registry,
            signer=ctx.signer,
        )  # fmt: skip
        server = await serve_fedwave(ctx, service, listen=f"127.0.0.1:{self.port}")
        self._ready.set()
        await self._stop.wait()
        await server.stop(1)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), "the hostile server did not start"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def agent_config(
    tmp: Path, pki: Pki, cpm: CpmProcess, name: str, peers: dict[str, str], metrics_port: int,
    models: Path, data: Path, transfer: list[Problem], *, rounds: int, deadline_s: float,
    workflow: dict[str, Any],
) -> Path:  # fmt: skip
    """Write agent ``name``'s configuration (its stage's examples from ``data``); its path."""
    t = pki.tls(name)
    own = data / name
    config = {
        "federation": FEDERATION,
        "listen": peers[name],
        "cpm": cpm.target,
        "metrics_port": metrics_port,
        "state_dir": str(tmp / "state" / name),
        "model": str(models / "gpt2"),
        "device": "cpu",
        "train_file": str(own / "train.jsonl"),
        "val_file": str(own / "val.jsonl"),
        "transfer_file": str(data / "transfer.jsonl"),
        "transfer_sha256": transfer_set_sha256([p.prompt for p in transfer]),
        "rounds": rounds,
        "local_steps": 1,
        "batch_size": 4,
        "max_length": 96,
        "log_format": "json",
        "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
        "fedwave": {"workflow": workflow, "peers": peers, "round_deadline_s": deadline_s},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return path


def write_stage_data(data: Path, workflow: Workflow, names: tuple[str, ...]) -> list[Problem]:
    """Each agent's stage examples and held-out examples, and the transfer set; the latter."""
    chain = build_code_chain(workflow, per_stage=N_SAMPLES, n_test=2, n_public=1, seed=0)
    transfer = [Problem("public/0", "public", chain.public[0], "", "", "stage_output")]
    write_jsonl(data / "transfer.jsonl", transfer)
    for name in names:
        index = workflow.stage_index(name)
        stage = workflow.stages[index].name
        write_jsonl(data / name / "train.jsonl", _stage_problems(chain.of_agent(name), stage))
        held_out = [item.example(index, stage) for item in chain.test]
        write_jsonl(data / name / "val.jsonl", _stage_problems(held_out, stage))
    return transfer


def test_honest_experts_refuse_a_hostile_members_parts_and_keep_one_router(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    models = tmp_path / "models"
    build_models(models, ("gpt2",), size="micro")
    hidden = int(AutoConfig.from_pretrained(models / "gpt2").hidden_size)
    pki = Pki.create(tmp_path, agents=4)
    workflow = Workflow.model_validate(WORKFLOW)
    settings = FedWaveSettings(workflow=workflow)
    hostile = HostileServer(pki.root, workflow, hostile_parts(settings, hidden))
    hostile.start()
    cpm = CpmProcess(pki, tmp_path / "cpm.db", tmp_path, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"})
    cpm.start()
    data = tmp_path / "data"
    transfer = write_stage_data(data, workflow, HONEST)
    peers = {a: f"127.0.0.1:{free_port()}" for a in HONEST}
    peers[HOSTILE] = f"127.0.0.1:{hostile.port}"
    metrics_ports = {a: free_port() for a in HONEST}
    procs, logs, scraped = {}, {}, {}
    try:
        for name in HONEST:
            config = agent_config(
                tmp_path, pki, cpm, name, peers, metrics_ports[name], models, data, transfer,
                rounds=ROUNDS, deadline_s=DEADLINE_S, workflow=WORKFLOW,
            )  # fmt: skip
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = start_agent(agent_forks, config, logs[name])
        for name in HONEST:
            # Scraped while it lingers after its last round (waiting for a4 to pull, which
            # it never does: up to the round's deadline).
            _wait_for(
                lambda name=name: (  # type: ignore[misc]
                    any(
                        e.get("event") == "fedwave_round_done" and e.get("round") == ROUNDS
                        for e in _events(logs[name])
                    )
                    or procs[name].poll() is not None
                ),
                300,
                f"{name} round {ROUNDS}",
            )
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]
            scraped[name] = _scrape(metrics_ports[name])
        outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        cpm.terminate()
        hostile.stop()
    summaries = {}
    for name, out in outs.items():
        assert procs[name].returncode == 0, logs[name].read_text()[-3000:]
        summaries[name] = json.loads(out.strip().splitlines()[-1])
        assert not summaries[name]["errors"], summaries[name]["errors"]
    reports = {name: s["fedwave"] for name, s in summaries.items()}
    # a4's routers of rounds 1-4, refused at every honest agent, each for its reason.
    router_reasons = {"non_finite": 1, "shape": 1, "norm": 1, "too_large": 1}
    # a1 (implement) alone pulls the test stage's VCLayers: a4's of rounds 0-4.
    vclayer_reasons = {"norm": 2, "non_finite": 1, "shape": 1, "too_large": 1}
    for name, report in reports.items():
        expected = dict(router_reasons)
        if name == "a1":
            for reason, n in vclayer_reasons.items():
                expected[reason] = expected.get(reason, 0) + n
        assert report["parts_rejected"] == expected, (name, report)
        assert report["rounds"] == ROUNDS and report["members"] == [3] * ROUNDS, report
        for reason, n in router_reasons.items():
            got = _value(
                scraped[name], "peerlm_agent_fedwave_rejected_parts_total",
                kind="router", reason=reason,
            )  # fmt: skip
            assert got == n, (name, reason, got)
        # Never averaged: no round's aggregate lists a4.
        members = [
            e["members"] for e in _events(logs[name]) if e.get("event") == "fedwave_round_done"
        ]
        assert len(members) == ROUNDS and all(HOSTILE not in m for m in members), members
    for reason, n in vclayer_reasons.items():
        got = _value(
            scraped["a1"], "peerlm_agent_fedwave_rejected_parts_total",
            kind="vclayer", reason=reason,
        )  # fmt: skip
        assert got == n, (reason, got)
    for name, summary in summaries.items():
        # The parts served and pulled are the FedWave run's traffic, in the summary: every
        # honest agent served its routers to the two others and pulled theirs (and a4's
        # refused ones, taken off the wire all the same).
        fw = summary["fedwave"]
        assert fw["bytes_sent"]["router"] > 0 and fw["bytes_received"]["router"] > 0, fw
        assert summary["bytes_sent"] == sum(fw["bytes_sent"].values()), summary
        assert summary["bytes_received"] == sum(fw["bytes_received"].values()), summary
        sent = sum(
            _value(scraped[name], "peerlm_agent_fedwave_bytes_sent_total", kind=k)
            for k in ("router", "vclayer")
        )
        assert 0 < sent <= summary["bytes_sent"], (name, sent)
    digests = {tuple(r["router_sha256"]) for r in reports.values()}
    assert len(digests) == 1, reports  # every honest agent, every round: the same bits
