"""KeyDirectory: node ids bind only to VRF keys certified by the federation CA."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from peerlm.overlay import vrf
from peerlm.overlay.transport import CertificateRefused, KeyDirectory

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role, identity_from_certificate_pem, load_vrf_secret

FED = "keys"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("keys")
    root, other = tmp / "root", tmp / "other"
    init_ca(root, federation=FED)
    init_ca(other, federation=FED)
    for name in ("me", "a", "b"):
        issue_certificate(root, Role.OVERLAY, name)
    issue_certificate(root, Role.AGENT, "agent1")
    issue_certificate(root, Role.ADMIN, "ops")
    issue_certificate(other, Role.OVERLAY, "a")
    now = datetime.now(UTC)
    issue_certificate(
        root,
        Role.OVERLAY,
        "old",
        not_valid_before=now - timedelta(days=10),
        not_valid_after=now - timedelta(days=1),
    )
    return root, other


def _der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)


def _key(d: Path, name: str) -> bytes:
    return vrf.public_key(load_vrf_secret(d / f"{name}.vrf.key"))


def _directory(root: Path, capacity: int = 16) -> KeyDirectory:
    ca = x509.load_pem_x509_certificate((root / "ca.crt").read_bytes())
    return KeyDirectory(
        federation=FED,
        ca_certificate=ca,
        own=("me", _key(root, "me"), _der(root / "me.crt")),
        capacity=capacity,
    )


def test_own_key_and_certificate_are_pinned(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    keys = _directory(root)
    assert keys.resolve("me") == _key(root, "me")
    assert keys.certificate("me") == _der(root / "me.crt")
    assert keys.resolve("a") is None and keys.certificate("a") is None
    keys.admit("me", _der(root / "a.crt"))  # a certificate "for me" never replaces my key
    assert keys.resolve("me") == _key(root, "me")


def test_attached_certificate_of_the_federation_binds_its_key(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    keys = _directory(root)
    keys.admit("a", _der(root / "a.crt"))
    keys.admit("agent1", _der(root / "agent1.crt"))
    assert keys.resolve("a") == _key(root, "a")
    assert keys.resolve("agent1") == _key(root, "agent1")
    assert keys.certificate("a") == _der(root / "a.crt")


@pytest.mark.parametrize(
    ("node_id", "cert", "why"),
    [
        ("a", "other/a.crt", "another CA"),
        ("b", "root/a.crt", "names another node"),
        ("ops", "root/ops.crt", "admin role, no VRF key"),
        ("old", "root/old.crt", "expired"),
    ],
)
def test_bad_certificates_are_refused(
    pki: tuple[Path, Path], node_id: str, cert: str, why: str
) -> None:
    root, other = pki
    path = (root if cert.startswith("root") else other) / cert.split("/", 1)[1]
    keys = _directory(root)
    with pytest.raises(CertificateRefused) as err:
        keys.admit(node_id, _der(path))
    assert err.value.reason == "bad_certificate", why
    assert keys.resolve(node_id) is None


def test_garbage_is_refused(pki: tuple[Path, Path]) -> None:
    keys = _directory(pki[0])
    with pytest.raises(CertificateRefused):
        keys.admit("a", b"\x30\x03\x02\x01\x00")


def test_handshake_identities_are_learnt(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    keys = _directory(root)
    pem = (root / "b.crt").read_bytes()
    keys.learn_authenticated(identity_from_certificate_pem(pem), pem)
    assert keys.resolve("b") == _key(root, "b")
    assert keys.certificate("b") == _der(root / "b.crt")
    admin = (root / "ops.crt").read_bytes()
    keys.learn_authenticated(identity_from_certificate_pem(admin), admin)
    assert keys.resolve("ops") is None


def test_capacity_bounds_the_directory(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    keys = _directory(root, capacity=2)
    keys.admit("a", _der(root / "a.crt"))
    keys.admit("b", _der(root / "b.crt"))
    assert keys.resolve("a") is not None  # touch a: b is now the least recently used
    keys.admit("agent1", _der(root / "agent1.crt"))
    assert len(keys) == 2
    assert keys.resolve("b") is None
    assert keys.resolve("a") is not None and keys.resolve("agent1") is not None
    assert keys.resolve("me") is not None


def test_a_directory_without_a_ca_accepts_no_attachments(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    keys = KeyDirectory(federation=FED, ca_certificate=None, own=("me", _key(root, "me"), None))
    with pytest.raises(CertificateRefused):
        keys.admit("a", _der(root / "a.crt"))
