"""Start a real CPM process on loopback with real certificates, for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from peerlm.services.cpm import cpm_command

from peerlm.config import GrpcLimits
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.rpc import create_channel
from peerlm.security.credentials import TlsFiles, channel_credentials
from peerlm.wire.v1 import cpm_pb2_grpc

FEDERATION = "itest"


@dataclass
class Pki:
    """A federation CA with named members, plus a foreign CA for negative tests."""

    root: Path
    foreign: Path

    @classmethod
    def create(cls, tmp: Path, agents: int = 6) -> Pki:
        root, foreign = tmp / "pki", tmp / "foreign"
        init_ca(root, federation=FEDERATION)
        init_ca(foreign, federation=FEDERATION)
        issue_certificate(root, Role.CPM, "cpm", sans=["127.0.0.1", "localhost"])
        issue_certificate(root, Role.ADMIN, "admin")
        for i in range(agents):
            issue_certificate(root, Role.AGENT, f"a{i}", sans=["127.0.0.1", "localhost"])
        issue_certificate(foreign, Role.AGENT, "a0")
        return cls(root, foreign)

    def tls(self, name: str, *, foreign: bool = False) -> TlsFiles:
        d = self.foreign if foreign else self.root
        return TlsFiles(self.root / "ca.crt", d / f"{name}.crt", d / f"{name}.key")

    def channel(self, target: str, name: str, *, foreign: bool = False) -> grpc.aio.Channel:
        if foreign:
            # A member of another CA: build raw credentials, since peerlm's own loader
            # refuses a certificate that the configured CA did not issue.
            d = self.foreign
            creds = grpc.ssl_channel_credentials(
                root_certificates=(self.root / "ca.crt").read_bytes(),
                private_key=(d / f"{name}.key").read_bytes(),
                certificate_chain=(d / f"{name}.crt").read_bytes(),
            )
            return create_channel(target, GrpcLimits(), creds)
        return create_channel(target, GrpcLimits(), channel_credentials(self.tls(name)))

    def stub(
        self, target: str, name: str, *, foreign: bool = False
    ) -> tuple[grpc.aio.Channel, cpm_pb2_grpc.MatchmakerStub]:
        ch = self.channel(target, name, foreign=foreign)
        return ch, cpm_pb2_grpc.MatchmakerStub(ch)  # type: ignore[no-untyped-call]


@dataclass
class CpmProcess:
    """A ``peerlm cpm`` child process."""

    pki: Pki
    db: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = None
    listen: str = "127.0.0.1:0"
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60, *, init: bool | None = None) -> CpmProcess:
        """Start the child; ``init`` defaults to "only if the database does not exist yet"."""
        port_file = self.workdir / "cpm.port"
        port_file.unlink(missing_ok=True)
        if init is None:
            init = not self.db.exists()
        args = cpm_command(
            tls=self.pki.tls("cpm"),
            db=self.db,
            port_file=port_file,
            federation=FEDERATION,
            metrics_port=self.metrics_port,
            listen=self.listen,
            init=init,
        )
        log = (self.workdir / "cpm.log").open("ab")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **self.env}
        )
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"CPM exited {self.proc.returncode}: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("CPM did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        return self

    def log(self) -> str:
        return (self.workdir / "cpm.log").read_text(errors="replace")

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
