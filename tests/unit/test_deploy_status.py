"""`peerlm status` and `peerlm health` against a real CPM process on loopback with mTLS."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from peerlm.wire.v1 import cpm_pb2
from tests.cpm_harness import FEDERATION, CpmProcess, Pki

pytestmark = [pytest.mark.integration]

PEERLM = [sys.executable, "-m", "peerlm"]


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pki, CpmProcess]]:
    tmp = tmp_path_factory.mktemp("status")
    pki = Pki.create(tmp, agents=2)
    cpm = CpmProcess(pki, tmp / "cpm.db", tmp).start()
    try:
        asyncio.run(_profiles(pki, cpm.target))
        yield pki, cpm
    finally:
        cpm.terminate()


async def _profiles(pki: Pki, target: str) -> None:
    for name in ("a0", "a1"):
        channel, stub = pki.stub(target, name)
        await stub.SubmitProfile(
            cpm_pb2.SubmitProfileRequest(
                round=3, features=[0.1] * 32, peer_endpoint="localhost:50061"
            ),
            timeout=10,
        )
        await channel.close(None)


def _peerlm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PEERLM, *args], capture_output=True, text=True, timeout=60)


def test_status_json_shows_agents_and_summary(federation: tuple[Pki, CpmProcess]) -> None:
    pki, cpm = federation
    out = _peerlm("status", "--cpm", cpm.target, "--pki-dir", str(pki.root), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cpm"] == cpm.target and data["profiles_received"] == 2
    agents = {a["name"]: a for a in data["agents"]}
    assert set(agents) == {"a0", "a1"}
    assert agents["a0"]["last_round"] == 3
    assert agents["a0"]["peer_endpoint"] == "localhost:50061"
    assert agents["a0"]["last_profile_at"] is not None
    assert 0 <= agents["a0"]["last_profile_age_s"] < 600
    for key in ("pairings_in_flight", "rewards_observed", "reward_mean", "reward_std"):
        assert key in data


def test_status_table_with_explicit_files(federation: tuple[Pki, CpmProcess]) -> None:
    pki, cpm = federation
    tls = pki.tls("admin")
    out = _peerlm(
        "status", "--cpm", cpm.target, "--ca-cert", str(tls.ca_cert), "--cert", str(tls.cert),
        "--key", str(tls.key),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "pairings in flight" in out.stdout and "a1" in out.stdout
    assert "s ago" in out.stdout


def test_status_refuses_a_non_admin_certificate(federation: tuple[Pki, CpmProcess]) -> None:
    pki, cpm = federation
    out = _peerlm("status", "--cpm", cpm.target, "--pki-dir", str(pki.root), "--name", "a0")
    assert out.returncode == 1
    assert "refused this call for our role" in out.stderr


def test_status_usage_errors(federation: tuple[Pki, CpmProcess], tmp_path: Path) -> None:
    pki, cpm = federation
    out = _peerlm("status", "--cpm", cpm.target, "--cert", "x.crt")
    assert out.returncode == 2 and "missing --ca-cert, --key" in out.stderr
    out = _peerlm("status", "--cpm", "no-port", "--pki-dir", str(pki.root))
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
    out = _peerlm("status", "--cpm", cpm.target, "--pki-dir", str(tmp_path))
    assert out.returncode == 2 and "not found" in out.stderr


def test_status_of_an_unreachable_cpm(federation: tuple[Pki, CpmProcess]) -> None:
    pki, _ = federation
    out = _peerlm("status", "--cpm", "127.0.0.1:1", "--pki-dir", str(pki.root), "--timeout", "2")
    assert out.returncode == 1 and "CPM 127.0.0.1:1" in out.stderr


def _config(tmp_path: Path, pki: Pki, listen: str) -> Path:
    tls = pki.tls("cpm")
    path = tmp_path / "cpm.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "federation": FEDERATION,
                "listen": listen,
                "tls": {"ca_cert": str(tls.ca_cert), "cert": str(tls.cert), "key": str(tls.key)},
            }
        )
    )
    return path


def test_health_of_a_serving_cpm_from_its_own_config(
    federation: tuple[Pki, CpmProcess], tmp_path: Path
) -> None:
    pki, cpm = federation
    config = _config(tmp_path, pki, f"0.0.0.0:{cpm.port}")
    out = _peerlm("health", "--component", "cpm", "--config", str(config), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["status"] == "SERVING" and data["target"] == f"127.0.0.1:{cpm.port}"
    named = _peerlm(
        "health", "--config", str(config), "--service", "peerlm.v1.Matchmaker", "--json"
    )
    assert named.returncode == 0 and json.loads(named.stdout)["serving"]


@pytest.mark.slow
def test_health_fails_when_nothing_listens_or_the_config_is_wrong(
    federation: tuple[Pki, CpmProcess], tmp_path: Path
) -> None:
    pki, _ = federation
    config = _config(tmp_path, pki, "127.0.0.1:1")
    out = _peerlm("health", "--config", str(config), "--timeout", "1")
    assert out.returncode == 1 and "unreachable" in out.stderr
    out = _peerlm("health", "--component", "nonsense")
    assert out.returncode == 2 and "unknown component" in out.stderr
    out = _peerlm("health", "--config", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "not found" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: 127.0.0.1:1\ntls: {cert: /nope.crt}\n")
    out = _peerlm("health", "--config", str(bad))
    assert out.returncode == 2 and "missing" in out.stderr
    # Plaintext (insecure-dev) probes only loopback targets: the one security decision.
    dev = tmp_path / "dev.yaml"
    dev.write_text("listen: 127.0.0.1:1\ninsecure_dev: true\n")
    out = _peerlm("health", "--config", str(dev), "--target", "10.9.8.7:50051")
    assert out.returncode == 2 and "loopback" in out.stderr, out.stderr
    out = _peerlm("health", "--config", str(dev), "--timeout", "1")
    assert out.returncode == 1 and "unreachable" in out.stderr
