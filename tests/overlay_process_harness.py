"""Real ``peerlm overlay-node`` processes on loopback with real certificates, for tests.

:class:`OverlayPki` issues a test federation (overlay nodes, an admin, a second member
``mallory`` used to send hostile messages, a ``cpm`` certificate of the wrong role, and a
foreign CA); :func:`clustered_signatures` plants a clustered population of signatures;
:class:`OverlayNodeProcess` starts one node from a YAML config with ``--port-file``;
:func:`oracle_top_k` is the brute-force answer a search must match.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from peerlm.overlay.signature import Signature, make_signature, sparse_cosine

from peerlm.config import GrpcLimits
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role, load_vrf_secret
from peerlm.rpc import create_channel
from peerlm.security.credentials import TlsFiles, channel_credentials
from peerlm.wire.v1 import overlay_pb2, overlay_pb2_grpc
from tests.ports import free_port

FEDERATION = "otest"
LOOPBACK_SANS = ("127.0.0.1", "localhost")


@dataclass
class OverlayPki:
    """A federation CA with overlay nodes, an admin, ``mallory`` (agent), ``cpm``, and a
    foreign CA that issued its own ``n0``."""

    root: Path
    foreign: Path
    nodes: list[str]

    @classmethod
    def create(cls, tmp: Path, nodes: Sequence[str]) -> OverlayPki:
        root, foreign = tmp / "pki", tmp / "foreign"
        init_ca(root, federation=FEDERATION)
        init_ca(foreign, federation=FEDERATION)
        for name in nodes:
            issue_certificate(root, Role.OVERLAY, name, sans=LOOPBACK_SANS)
        issue_certificate(root, Role.ADMIN, "ops")
        issue_certificate(root, Role.AGENT, "mallory", sans=LOOPBACK_SANS)
        issue_certificate(root, Role.CPM, "cpm")
        issue_certificate(foreign, Role.OVERLAY, nodes[0], sans=LOOPBACK_SANS)
        return cls(root, foreign, list(nodes))

    def tls(self, name: str) -> TlsFiles:
        return TlsFiles(self.root / "ca.crt", self.root / f"{name}.crt", self.root / f"{name}.key")

    def vrf_secret(self, name: str) -> bytes:
        return load_vrf_secret(self.root / f"{name}.vrf.key")

    def channel(self, target: str, name: str) -> grpc.aio.Channel:
        return create_channel(target, GrpcLimits(), channel_credentials(self.tls(name)))

    def foreign_channel(self, target: str) -> grpc.aio.Channel:
        """A member of another CA (same federation name): trusts our CA, presents its own."""
        d = self.foreign
        name = self.nodes[0]
        creds = grpc.ssl_channel_credentials(
            root_certificates=(self.root / "ca.crt").read_bytes(),
            private_key=(d / f"{name}.key").read_bytes(),
            certificate_chain=(d / f"{name}.crt").read_bytes(),
        )
        return create_channel(target, GrpcLimits(), creds)

    def anonymous_channel(self, target: str) -> grpc.aio.Channel:
        """TLS that trusts our CA but presents no client certificate."""
        creds = grpc.ssl_channel_credentials(root_certificates=(self.root / "ca.crt").read_bytes())
        return create_channel(target, GrpcLimits(), creds)

    def stub(self, target: str, name: str) -> tuple[grpc.aio.Channel, Any]:
        ch = self.channel(target, name)
        return ch, overlay_pb2_grpc.OverlayStub(ch)  # type: ignore[no-untyped-call]


def clustered_signatures(
    names: Sequence[str],
    clusters: int = 3,
    dim: int = 512,
    p: int = 48,
    noise: float = 0.35,
    seed: int = 0,
) -> dict[str, Signature]:
    """Top-P signatures of a clustered population: node ``i`` is in cluster ``i % clusters``,
    its weights are the cluster centre plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    out = {}
    for i, name in enumerate(names):
        w = centres[i % clusters] + noise * rng.normal(size=dim)
        out[name] = make_signature(w, np.abs(w), p, "otest-space")
    return out


def oracle_top_k(
    signatures: Mapping[str, Signature], querier: str, k: int, exclude: Sequence[str] = ()
) -> list[tuple[str, float]]:
    """Brute force: the ``k`` other nodes most similar to ``querier`` (ties by id)."""
    q = signatures[querier]
    scored = [
        (name, sparse_cosine(q, sig))
        for name, sig in signatures.items()
        if name != querier and name not in exclude
    ]
    scored.sort(key=lambda t: (-t[1], t[0]))
    return scored[:k]


@dataclass
class OverlayNodeProcess:
    """A ``peerlm overlay-node`` child process configured by a YAML file."""

    name: str
    workdir: Path
    settings: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        return int(self.settings["metrics_port"])

    @property
    def _port_file(self) -> Path:
        return self.workdir / f"{self.name}.port"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def spawn(self) -> OverlayNodeProcess:
        config = self.workdir / f"{self.name}.yaml"
        config.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        self._port_file.unlink(missing_ok=True)
        args = [
            sys.executable, "-m", "peerlm", "overlay-node", "--config", str(config),
            "--port-file", str(self._port_file),
        ]  # fmt: skip
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **self.env},
        )
        return self

    def wait_port(self, timeout: float = 90) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited {self.proc.returncode}: {self.log()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start: {self.log()[-3000:]}")
            time.sleep(0.05)
        self.port = int(self._port_file.read_text())
        return self.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        total = 0.0
        for line in body.splitlines():
            if line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            metric = head.split("{", 1)[0]
            if metric != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def node_settings(
    pki: OverlayPki,
    name: str,
    *,
    signature_file: Path | None,
    bootstrap: Sequence[str],
    protocol: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The YAML settings of one test node (mTLS, loopback, metrics on a free port)."""
    tls = pki.tls(name)
    settings: dict[str, Any] = {
        "federation": FEDERATION,
        "listen": "127.0.0.1:0",
        "tls": {"ca_cert": str(tls.ca_cert), "cert": str(tls.cert), "key": str(tls.key)},
        "metrics_port": free_port(),
        "log_format": "json",
        "bootstrap": list(bootstrap),
        "protocol": dict(protocol),
    }
    if signature_file is not None:
        settings["signature_file"] = str(signature_file)
    settings.update(extra or {})
    return settings


async def describe(pki: OverlayPki, target: str, caller: str = "ops") -> Any:
    ch, stub = pki.stub(target, caller)
    try:
        return await stub.Describe(overlay_pb2.DescribeRequest(), timeout=10)
    finally:
        await ch.close(None)


async def search(pki: OverlayPki, target: str, k: int) -> Any:
    ch, stub = pki.stub(target, "ops")
    try:
        return await stub.Search(overlay_pb2.SearchRequest(k=k), timeout=30)
    finally:
        await ch.close(None)
