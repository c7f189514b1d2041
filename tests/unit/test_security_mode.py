"""The security-mode decision, kit loading and client-side error descriptions."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from peerlm.metrics import new_registry
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.security.authz import (
    AuthInterceptor,
    TlsFailureCounter,
    current_identity,
    describe_rpc_error,
    tls_failure_reason,
    use_identity,
)
from peerlm.security.credentials import TlsFiles, channel_credentials, server_credentials
from peerlm.security.mode import (
    SecurityConfigError,
    SecurityMode,
    is_loopback,
    is_loopback_target,
    resolve_channel_security,
    resolve_security,
    target_host,
)


class RecordingLogger:
    """Stands in for a structlog logger; records (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, /, **kw: Any) -> None:
        self.records.append(("info", event, kw))

    def warning(self, event: str, /, **kw: Any) -> None:
        self.records.append(("warning", event, kw))


@pytest.fixture
def kit(tmp_path: Path) -> TlsFiles:
    init_ca(tmp_path, federation="acme")
    issue_certificate(tmp_path, Role.AGENT, "a1")
    return TlsFiles.from_directory(tmp_path, "a1")


# -- loopback detection ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST",
        "localhost.",
        "::ffff:127.0.0.1",
    ],
)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "[::]", "", "10.0.0.1", "192.168.1.1", "example.com", "a.localhost"]
)
def test_non_loopback_hosts(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("target", "hosts"),
    [
        ("127.0.0.1:50051", ["127.0.0.1"]),
        ("localhost", ["localhost"]),
        ("[::1]:50051", ["::1"]),
        ("::1", ["::1"]),
        ("dns:///localhost:1", ["localhost"]),
        ("dns://8.8.8.8/example.com:1", ["example.com"]),
        ("dns:example.com:1", ["example.com"]),
        ("ipv4:127.0.0.1:1,127.0.0.2:2", ["127.0.0.1", "127.0.0.2"]),
        ("ipv6:[::1]:1", ["::1"]),
        ("unix:/tmp/sock", []),
    ],
)
def test_target_host(target: str, hosts: list[str]) -> None:
    assert target_host(target) == hosts


@pytest.mark.parametrize(
    ("target", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("localhost:1", True),
        ("dns:///localhost:1", True),
        ("unix:/tmp/s", True),
        ("ipv4:127.0.0.1:1,10.0.0.1:2", False),
        ("dns://127.0.0.1/example.com:1", False),
        ("0.0.0.0:1", False),
        ("example.com:443", False),
    ],
)
def test_loopback_targets(target: str, loopback: bool) -> None:
    assert is_loopback_target(target) is loopback


# -- server mode ----------------------------------------------------------------------------


def test_insecure_dev_on_loopback_is_allowed_and_loud() -> None:
    log = RecordingLogger()
    mode = resolve_security(
        insecure_dev=True, listen_host="127.0.0.1", tls=None, component="cpm", logger=log
    )
    assert mode is SecurityMode.INSECURE_DEV
    [(level, event, fields)] = log.records
    assert (level, event) == ("warning", "security_mode")
    assert fields["security_mode"] == "insecure-dev" and fields["component"] == "cpm"
    assert "INSECURE" in fields["warning"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "cpm.example.org"])
def test_insecure_dev_off_loopback_is_refused(host: str) -> None:
    with pytest.raises(SecurityConfigError, match="loopback"):
        resolve_security(
            insecure_dev=True, listen_host=host, tls=None, component="cpm", logger=RecordingLogger()
        )


def test_insecure_dev_with_tls_files_is_ambiguous(kit: TlsFiles) -> None:
    with pytest.raises(SecurityConfigError, match="TLS files are configured too"):
        resolve_security(
            insecure_dev=True, listen_host="::1", tls=kit, component="cpm", logger=RecordingLogger()
        )


def test_mtls_with_a_complete_kit(kit: TlsFiles) -> None:
    log = RecordingLogger()
    mode = resolve_security(
        insecure_dev=False, listen_host="0.0.0.0", tls=kit, component="agent", logger=log
    )
    assert mode is SecurityMode.MTLS
    [(level, event, fields)] = log.records
    assert (level, event) == ("info", "security_mode")
    assert fields["security_mode"] == "mtls" and fields["identity"] == "spiffe://acme/agent/a1"


def test_mtls_without_files_never_falls_back() -> None:
    with pytest.raises(SecurityConfigError, match="--insecure-dev"):
        resolve_security(
            insecure_dev=False,
            listen_host="127.0.0.1",
            tls=None,
            component="cpm",
            logger=RecordingLogger(),
        )


@pytest.mark.parametrize("missing", ["ca_cert", "cert", "key"])
def test_mtls_names_the_missing_file(kit: TlsFiles, missing: str) -> None:
    path: Path = getattr(kit, missing)
    path.unlink()
    with pytest.raises(SecurityConfigError, match=re.escape(str(path))):
        resolve_security(
            insecure_dev=False,
            listen_host="0.0.0.0",
            tls=kit,
            component="x",
            logger=RecordingLogger(),
        )
    with pytest.raises(SecurityConfigError, match=re.escape(str(path))):
        resolve_channel_security(
            insecure_dev=False,
            target="10.0.0.1:1",
            tls=kit,
            component="x",
            logger=RecordingLogger(),
        )


def test_mtls_rejects_inconsistent_kits(tmp_path: Path, kit: TlsFiles) -> None:
    other = tmp_path / "other"
    init_ca(other)
    issue_certificate(other, Role.AGENT, "a1")
    issue_certificate(kit.ca_cert.parent, Role.AGENT, "a2")
    log = RecordingLogger()
    cases = {
        "not issued by the CA": TlsFiles(kit.ca_cert, other / "a1.crt", other / "a1.key"),
        "does not belong": TlsFiles(kit.ca_cert, kit.cert, kit.ca_cert.parent / "a2.key"),
        "not a PEM certificate": TlsFiles(kit.ca_cert, kit.key, kit.key),
        "not an unencrypted PEM private key": TlsFiles(kit.ca_cert, kit.cert, kit.cert),
    }
    for needle, tls in cases.items():
        with pytest.raises(SecurityConfigError, match=needle):
            resolve_security(
                insecure_dev=False, listen_host="0.0.0.0", tls=tls, component="x", logger=log
            )
    assert log.records == []


def test_mtls_warns_about_an_expiring_certificate(tmp_path: Path) -> None:
    init_ca(tmp_path)
    now = datetime.now(UTC)
    issue_certificate(
        tmp_path,
        Role.AGENT,
        "old",
        not_valid_before=now - timedelta(days=30),
        not_valid_after=now - timedelta(days=1),
    )
    log = RecordingLogger()
    tls = TlsFiles.from_directory(tmp_path, "old")
    assert (
        resolve_security(insecure_dev=False, listen_host="::1", tls=tls, component="x", logger=log)
        is SecurityMode.MTLS
    )
    warning = next(r for r in log.records if r[1] == "certificate_expiry")
    assert warning[0] == "warning" and warning[2]["expired"] is True


# -- channel mode ---------------------------------------------------------------------------


def test_channel_insecure_only_to_loopback(kit: TlsFiles) -> None:
    log = RecordingLogger()
    assert (
        resolve_channel_security(
            insecure_dev=True, target="localhost:7000", tls=None, component="agent", logger=log
        )
        is SecurityMode.INSECURE_DEV
    )
    assert log.records[0][0] == "warning"
    with pytest.raises(SecurityConfigError, match="loopback"):
        resolve_channel_security(
            insecure_dev=True, target="cpm.example.org:7000", tls=None, component="a", logger=log
        )
    assert (
        resolve_channel_security(
            insecure_dev=False, target="cpm.example.org:7000", tls=kit, component="a", logger=log
        )
        is SecurityMode.MTLS
    )


# -- kits -----------------------------------------------------------------------------------


def test_tls_files_load_and_credentials(kit: TlsFiles) -> None:
    bundle = kit.load()
    assert bundle.ca_cert == kit.ca_cert.read_bytes()
    assert bundle.key == kit.key.read_bytes()
    assert isinstance(server_credentials(kit), grpc.ServerCredentials)
    assert isinstance(channel_credentials(kit), grpc.ChannelCredentials)


def test_tls_files_missing_file_message(tmp_path: Path) -> None:
    tls = TlsFiles.from_directory(tmp_path, "a1")
    with pytest.raises(FileNotFoundError, match=r"ca\.crt not found; issue one with `peerlm ca"):
        tls.load()


# -- identity context -----------------------------------------------------------------------


def test_current_identity_outside_a_call() -> None:
    with pytest.raises(RuntimeError, match="AuthInterceptor"):
        current_identity()
    me = PeerIdentity("acme", Role.ADMIN, "root")
    with use_identity(me):
        assert current_identity() == me
    with pytest.raises(RuntimeError):
        current_identity()


# -- client error descriptions --------------------------------------------------------------


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, "")


@pytest.mark.parametrize(
    ("details", "reason", "needle"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
            "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer",
            "untrusted_server",
            "do not trust the server",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom "
            "verification check failed with error: UNAUTHENTICATED: Hostname Verification "
            "Check failed.",
            "hostname_mismatch",
            "--san",
        ),
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
            "Socket closed",
            "refused_by_server",
            "did not accept our certificate",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
            "routines:OPENSSL_internal:WRONG_VERSION_NUMBER",
            "server_not_tls",
            "does not speak TLS",
        ),
    ],
)
def test_describe_tls_failures(details: str, reason: str, needle: str) -> None:
    err = _error(grpc.StatusCode.UNAVAILABLE, details)
    assert tls_failure_reason(err) == reason
    text = describe_rpc_error(err)
    assert text.startswith("TLS handshake failed") and needle in text


def test_describe_other_errors() -> None:
    refused = _error(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
        "Connection refused",
    )
    assert tls_failure_reason(refused) is None
    assert describe_rpc_error(refused).startswith("UNAVAILABLE: failed to connect")
    denied = _error(grpc.StatusCode.PERMISSION_DENIED, "role 'agent' not allowed")
    assert tls_failure_reason(denied) is None
    assert "refused this call" in describe_rpc_error(denied)
    assert "did not accept our identity" in describe_rpc_error(
        _error(grpc.StatusCode.UNAUTHENTICATED, "x")
    )


def test_interceptors_can_share_a_registry() -> None:
    registry = new_registry()
    for component in ("cpm", "overlay"):
        AuthInterceptor(
            {}, federation="acme", mode=SecurityMode.MTLS, registry=registry, component=component
        )
        TlsFailureCounter(registry, component)


async def test_bind_server_opens_plaintext_only_for_insecure_dev_on_loopback() -> None:
    import grpc

    from peerlm.security.credentials import bind_server

    server = grpc.aio.server()
    with pytest.raises(SecurityConfigError, match="plaintext refused"):
        bind_server(server, "0.0.0.0:0", SecurityMode.INSECURE_DEV, None)
    assert bind_server(server, "127.0.0.1:0", SecurityMode.INSECURE_DEV, None) > 0
    await server.stop(None)
