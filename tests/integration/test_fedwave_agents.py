"""FedWave expert agents as real ``peerlm agent`` processes on loopback mTLS: the round loop
(train, publish, pull, aggregate), a late agent skipped and counted by all alike, an agent
outside the workflow refused by its certificate, the metrics."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from peerlm.agent import Problem, build_code_chain, transfer_set_sha256, write_jsonl
from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.models.tiny import build_models
from prometheus_client.parser import text_string_to_metric_families

from peerlm.forkserver import ChildProcess, ForkServer
from tests.agent_harness import start_agent
from tests.cpm_harness import FEDERATION, CpmProcess, Pki
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# a3 is in the workflow (and has an endpoint) but never starts: the late agent. a4 is a
# federation member outside the workflow.
WORKFLOW = {
    "stages": [
        {"name": "specify", "agents": ["a0"]},
        {"name": "implement", "agents": ["a1"]},
        {"name": "test", "agents": ["a2", "a3"]},
    ]
}
RUNNING = ("a0", "a1", "a2")
DEADLINE_S = 20.0
ROUNDS = 2


def _stage_problems(examples: Any, stage: str) -> list[Problem]:
    return [
        Problem(f"{e.task_id}/{stage}", stage, e.source, e.target, "", "stage_output")
        for e in examples
    ]


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(metrics: dict[Any, float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _outsider_pull(pki: Path, endpoint: str) -> grpc.StatusCode | None:
    from peerlm.wire.v1 import fedwave_pb2, fedwave_pb2_grpc
    from tests.node_contexts import kit_context

    async def pull() -> grpc.StatusCode | None:
        async with kit_context(pki, "a4").dial(endpoint) as peer:
            stub = fedwave_pb2_grpc.FedWaveExchangeStub(peer.channel)  # type: ignore[no-untyped-call]
            request = fedwave_pb2.PullPartRequest(round=1, kind=fedwave_pb2.PART_KIND_ROUTER)
            try:
                async for _ in stub.PullPart(request, timeout=10):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
        return None

    return asyncio.run(pull())


def test_experts_end_every_round_with_the_same_router_without_the_late_agent(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    models = tmp_path / "models"
    build_models(models, ("gpt2",), size="micro")
    pki = Pki.create(tmp_path, agents=5)
    cpm = CpmProcess(pki, tmp_path / "cpm.db", tmp_path, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"})
    cpm.start()
    workflow = Workflow.model_validate(WORKFLOW)
    chain = build_code_chain(workflow, per_stage=8, n_test=4, n_public=2, seed=0)
    data = tmp_path / "data"
    transfer = [
        Problem(f"public/{k}", "public", text, "", "", "stage_output")
        for k, text in enumerate(chain.public)
    ]
    write_jsonl(data / "transfer.jsonl", transfer)
    ports = {a: free_port() for a in workflow.agents}
    metrics_ports = {a: free_port() for a in RUNNING}
    peers = {a: f"127.0.0.1:{p}" for a, p in ports.items()}
    procs, logs = {}, {}
    try:
        for name in RUNNING:
            index = workflow.stage_index(name)
            stage = workflow.stages[index].name
            own = data / name
            write_jsonl(own / "train.jsonl", _stage_problems(chain.of_agent(name), stage))
            held_out = [item.example(index, stage) for item in chain.test]
            write_jsonl(own / "val.jsonl", _stage_problems(held_out, stage))
            t = pki.tls(name)
            config = {
                "federation": FEDERATION,
                "listen": peers[name],
                "cpm": cpm.target,
                "metrics_port": metrics_ports[name],
                "state_dir": str(tmp_path / "state" / name),
                "model": str(models / "gpt2"),
                "device": "cpu",
                "train_file": str(own / "train.jsonl"),
                "val_file": str(own / "val.jsonl"),
                "transfer_file": str(data / "transfer.jsonl"),
                "transfer_sha256": transfer_set_sha256([p.prompt for p in transfer]),
                "rounds": ROUNDS,
                "local_steps": 2,
                "batch_size": 4,
                "max_length": 128,
                "log_format": "json",
                "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
                "fedwave": {"workflow": WORKFLOW, "peers": peers, "round_deadline_s": DEADLINE_S},
            }
            path = tmp_path / f"{name}.yaml"
            path.write_text(json.dumps(config))
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = start_agent(agent_forks, path, logs[name])
        after_round_1 = {}
        for name in RUNNING:
            # Scraped as soon as the agent concluded round 1: it then waits at least the
            # round's deadline in round 2 for the late agent, so it is still serving.
            _wait_for(
                lambda name=name: (  # type: ignore[misc]
                    any(
                        e.get("event") == "fedwave_round_done" and e.get("round") == 1
                        for e in _events(logs[name])
                    )
                    or procs[name].poll() is not None
                ),
                240,
                f"{name} round 1",
            )
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]
            after_round_1[name] = _scrape(metrics_ports[name])
        # A member of the federation outside the workflow: refused by its certificate.
        assert _outsider_pull(pki.root, peers["a1"]) == grpc.StatusCode.PERMISSION_DENIED
        refusals = _scrape(metrics_ports["a1"])
        outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        cpm.terminate()
    for name, metrics in after_round_1.items():
        # Round 0's pulls and round 1's: the two other running agents' routers each time.
        assert _value(metrics, "peerlm_agent_fedwave_rounds_total", outcome="partial") == 1
        assert _value(metrics, "peerlm_agent_fedwave_rounds_total", outcome="complete") == 0
        assert _value(metrics, "peerlm_agent_fedwave_parts_pulled_total", kind="router") == 4
        late = _value(
            metrics, "peerlm_agent_fedwave_missing_parts_total", kind="router", reason="late"
        )
        assert late == 2, name  # a3's router of rounds 0 and 1
        assert _value(metrics, "peerlm_agent_fedwave_round") == 1
        assert _value(metrics, "peerlm_agent_fedwave_router_members_count") == 3
    assert (
        _value(
            refusals,
            "peerlm_agent_fedwave_refusals_total",
            rpc="PullPart",
            reason="not_in_workflow",
        )
        == 1
    )
    # a1 (implement) pulled its neighbours' VCLayers: specify's a0 and test's a2 each round.
    assert (
        _value(after_round_1["a1"], "peerlm_agent_fedwave_parts_pulled_total", kind="vclayer") == 4
    )
    summaries = {}
    for name, out in outs.items():
        assert procs[name].returncode == 0, logs[name].read_text()[-3000:]
        summaries[name] = json.loads(out.strip().splitlines()[-1])
    reports = {name: s["fedwave"] for name, s in summaries.items()}
    for name, report in reports.items():
        assert not summaries[name]["errors"], summaries[name]["errors"]
        assert report["rounds"] == ROUNDS and report["members"] == [3] * ROUNDS
        assert report["parts_missing"].get("late", 0) >= 3, report  # a3, every round
        assert report["heldout_before"] > 0 and report["heldout_after"] > 0
    digests = {tuple(r["router_sha256"]) for r in reports.values()}
    assert len(digests) == 1, reports  # every running agent, every round: the same bits
    assert len(set(next(iter(digests)))) == ROUNDS  # and the router changes each round


def _lone_expert(
    forks: ForkServer, tmp_path: Path, config: dict[str, Any], fedwave: dict[str, Any]
) -> tuple[ChildProcess, Path, CpmProcess]:
    """Agent a1 (implement) of the workflow started alone (its peers never listen): micro
    gpt2, its stage's examples, ``config`` and ``fedwave`` over the defaults here; the
    process, its log and the CPM (the caller terminates both)."""
    models = tmp_path / "models"
    build_models(models, ("gpt2",), size="micro")
    pki = Pki.create(tmp_path, agents=4)
    cpm = CpmProcess(pki, tmp_path / "cpm.db", tmp_path, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"})
    cpm.start()
    workflow = Workflow.model_validate(WORKFLOW)
    chain = build_code_chain(workflow, per_stage=8, n_test=2, n_public=1, seed=0)
    data = tmp_path / "data"
    transfer = [Problem("public/0", "public", chain.public[0], "", "", "stage_output")]
    write_jsonl(data / "transfer.jsonl", transfer)
    write_jsonl(data / "train.jsonl", _stage_problems(chain.of_agent("a1"), "implement"))
    held_out = [item.example(1, "implement") for item in chain.test]
    write_jsonl(data / "val.jsonl", _stage_problems(held_out, "implement"))
    peers = {a: f"127.0.0.1:{free_port()}" for a in workflow.agents}  # only a1 will listen
    t = pki.tls("a1")
    full = {
        "federation": FEDERATION,
        "listen": peers["a1"],
        "cpm": cpm.target,
        "state_dir": str(tmp_path / "state"),
        "model": str(models / "gpt2"),
        "device": "cpu",
        "train_file": str(data / "train.jsonl"),
        "val_file": str(data / "val.jsonl"),
        "transfer_file": str(data / "transfer.jsonl"),
        "local_steps": 1,
        "log_format": "json",
        "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
        **config,
        "fedwave": {"workflow": WORKFLOW, "peers": peers, **fedwave},
    }
    path = tmp_path / "a1.yaml"
    path.write_text(json.dumps(full))
    log = tmp_path / "a1.log"
    return start_agent(forks, path, log), log, cpm


def test_a_stop_cuts_a_round_waiting_for_its_peers(tmp_path: Path, agent_forks: ForkServer) -> None:
    """SIGTERM while the expert waits out a round's pulls (its peers never come): the round
    is cut when the stop grace runs out, not at the round's deadline, and the agent exits
    0 with a summary that says it was interrupted."""
    import signal

    proc, log, cpm = _lone_expert(
        agent_forks, tmp_path, {"rounds": 3, "stop_grace_s": 1}, {"round_deadline_s": 600}
    )
    try:
        _wait_for(
            lambda: (
                any(e.get("event") == "agent_ready" for e in _events(log))
                or proc.poll() is not None
            ),
            180,
            "agent ready",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)  # into round 0's pulls, which would wait 600 s for the peers
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cpm.terminate()
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] and summary["fedwave"]["rounds"] == 0
    assert any(e.get("event") == "fedwave_round_cut" for e in _events(log))
    assert took < 60, took  # the grace (1 s) plus the shutdown, not the round's 600 s


def test_an_expert_whose_other_stages_never_answer_assembles_from_what_arrived(
    tmp_path: Path, agent_forks: ForkServer
) -> None:
    """π_SFT in the daemon with the other stages down (``fedwave.assembly``): the expert's
    pulls of their adapters and VCLayers run out at the assembly's deadline, π_SFT is
    assembled from its own expert alone (both other stages missing, counted and in the
    report), no DPO step is taken (one expert makes no preference), the scores are reported
    and the agent ends cleanly."""
    proc, log, cpm = _lone_expert(
        agent_forks,
        tmp_path,
        {"rounds": 1, "batch_size": 4, "max_length": 128},
        {
            "round_deadline_s": 2,
            "assembly": {"enabled": True, "deadline_s": 2, "max_new_tokens": 8},
        },
    )
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cpm.terminate()
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert not summary["errors"], summary["errors"]
    report = summary["fedwave"]
    assembly = report["assembly"]
    assert assembly["outcome"] == "partial"
    assert assembly["missing_stages"] == ["specify", "test"]
    assert assembly["experts"] == {"implement": "a1"}
    # Every other agent's adapter and VCLayer: late at the assembly's deadline.
    assert "adapter" not in report["parts_pulled"]
    assert assembly["dpo_informative"] == 0 and assembly["dpo_losses"] == []
    assert set(report["scores"]) == {"expert_before", "expert_after", "pi_sft"}
    # π_SFT of one expert is that expert: the same greedy outputs, the same scores.
    assert report["scores"]["pi_sft"] == report["scores"]["expert_after"]
    partial = [e for e in _events(log) if e.get("event") == "fedwave_assembly_partial"]
    assert len(partial) == 1
    assert partial[0]["missing"] == {
        f"{a}/{k}": "late" for a in ("a0", "a2", "a3") for k in ("adapter", "vclayer")
    }
