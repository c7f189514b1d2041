"""FedProxy's cohort in real `peerlm agent` processes: an owner and two members configured by
their `fedproxy` sections, over mTLS on 127.0.0.1, beside the agents' own rounds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peerlm.agent.fedproxy.proxy import build_proxy
from peerlm.agent.models.tiny import SHIPPED_DIR
from transformers import AutoModelForCausalLM, AutoTokenizer

from peerlm.forkserver import ForkServer
from tests.agent_harness import start_agent
from tests.cpm_harness import FEDERATION, CpmProcess, Pki
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class World:
    tmp: Path
    pki: Pki
    cpm: CpmProcess
    model: Path
    proxy: Path
    data: Path
    transfer_sha256: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from peerlm.agent.tasks.dataset import build_federation_data

    tmp = tmp_path_factory.mktemp("fedproxy-agents")
    # The shipped tiny gpt2 (4 blocks); the proxy keeps blocks 0 and 3 (what BI keeps).
    model = SHIPPED_DIR / "tiny" / "gpt2"
    full = AutoModelForCausalLM.from_pretrained(model)
    proxy = tmp / "proxy"
    build_proxy(full, (0, 3), ratio=0.5).save_pretrained(proxy)
    AutoTokenizer.from_pretrained(model).save_pretrained(proxy)
    manifest = build_federation_data(tmp / "data", 2, seed=0)
    pki = Pki.create(tmp, agents=3)
    cpm = CpmProcess(pki, tmp / "cpm.db", tmp, {"PEERLM_CPM_ROUND_INTERVAL_S": "3600"}).start()
    yield World(tmp, pki, cpm, model, proxy, tmp / "data", manifest.transfer_sha256)
    cpm.terminate()


def _config(w: World, name: str, port: int, client: int, fedproxy: dict[str, object]) -> Path:
    t = w.pki.tls(name)
    data = w.data / "clients" / str(client)
    config = {
        "federation": FEDERATION,
        "listen": f"127.0.0.1:{port}",
        "cpm": w.cpm.target,
        "state_dir": str(w.tmp / name / "state"),
        "model": str(w.model),
        "device": "cpu",
        "train_file": str(data / "train.jsonl"),
        "val_file": str(data / "val.jsonl"),
        "transfer_file": str(w.data / "transfer.jsonl"),
        "transfer_sha256": w.transfer_sha256,
        "rounds": 1,
        "round_timeout_s": 0.5,
        "local_steps": 1,
        "eval_limit": 1,
        "transfer_limit": 2,
        "max_new_tokens": 8,
        "log_format": "json",
        "tls": {"ca_cert": str(t.ca_cert), "cert": str(t.cert), "key": str(t.key)},
        "fedproxy": {"enabled": True, "rounds": 2, "round_deadline_s": 240, **fedproxy},
    }
    path = w.tmp / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return path


def _events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_an_owner_and_two_member_agents_run_their_cohort_rounds(
    world: World, agent_forks: ForkServer
) -> None:
    ports = {name: free_port() for name in ("a0", "a1", "a2")}
    at = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    configs = {
        "a0": _config(
            world,
            "a0",
            ports["a0"],
            0,
            {
                "owner": True,
                "cohort": {"a1": at["a1"], "a2": at["a2"]},
                "proxy_path": str(world.proxy),
                "fused_path": str(world.tmp / "fused"),
            },
        ),
    }
    for i, name in enumerate(("a1", "a2")):
        configs[name] = _config(
            world,
            name,
            ports[name],
            i,
            {
                "owner_name": "a0",
                "owner_address": at["a0"],
                "local_steps": 2,
                "proxy_path": str(world.tmp / name / "proxy"),
            },
        )
    procs, logs = {}, {}
    for name, config in configs.items():
        logs[name] = world.tmp / f"{name}.log"
        procs[name] = start_agent(agent_forks, config, logs[name])
    summaries = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, logs[name].read_text()[-3000:]
            summaries[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name in ("a0", "a1", "a2"):
        assert summaries[name]["fedproxy_rounds"] == 2, logs[name].read_text()[-3000:]
        assert not [e for e in summaries[name]["errors"] if "fedproxy" in e]
    merged = [e for e in _events(logs["a0"]) if e.get("event") == "fedproxy_round_merged"]
    assert [e["round"] for e in merged] == [1, 2]
    assert all(e["merged"] == ["a1", "a2"] and e["outcome"] == "complete" for e in merged)
    # Both members end with the owner's final merge (round 3), kept where configured.
    final = [
        AutoModelForCausalLM.from_pretrained(world.tmp / name / "proxy").state_dict()
        for name in ("a1", "a2")
    ]
    start = AutoModelForCausalLM.from_pretrained(world.proxy).state_dict()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert any(not torch.equal(final[0][k], start[k]) for k in start)
    for name in ("a1", "a2"):
        kinds = [e.get("event") for e in _events(logs[name])]
        assert kinds.count("fedproxy_update_ready") == 2
    # The owner wrote its final proxy fused into its full model: block 3 is the proxy's 1.
    fused = AutoModelForCausalLM.from_pretrained(world.tmp / "fused").state_dict()
    key = "transformer.h.{}.mlp.c_fc.weight"
    assert torch.equal(fused[key.format(3)], final[0][key.format(1)])
    assert not torch.equal(fused[key.format(3)], start[key.format(1)])
