"""Federation PKI: CA creation, issuing, SPIFFE identities, inspection and the ``ca`` CLI."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta
from ipaddress import ip_address
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given
from hypothesis import strategies as st
from peerlm.overlay import vrf
from typer.testing import CliRunner

from peerlm.app.cli_ca import app
from peerlm.pki.ca import (
    VRF_ROLES,
    init_ca,
    inspect_certificate,
    issue_certificate,
    load_ca,
    sign_leaf_certificate,
    vrf_key_path,
)
from peerlm.pki.identity import (
    VRF_PUBLIC_KEY_OID,
    PeerIdentity,
    Role,
    identity_from_certificate_pem,
    load_vrf_secret,
    parse_spiffe_uri,
    vrf_public_key_from_certificate_pem,
)

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)
FEDERATIONS = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _leaf_with_uris(
    directory: Path,
    uris: list[str],
    extensions: list[x509.ExtensionType] | None = None,
) -> bytes:
    """A certificate from the CA in ``directory`` with arbitrary URI SANs (PEM)."""
    ca = load_ca(directory)
    now = datetime.now(UTC)
    cert = sign_leaf_certificate(
        ca,
        public_key=ec.generate_private_key(ec.SECP256R1()).public_key(),
        common_name="odd",
        uris=uris,
        not_valid_before=now - timedelta(minutes=1),
        not_valid_after=now + timedelta(days=1),
    )
    if extensions:
        # Re-sign with the extra extensions (sign_leaf_certificate only adds well-formed ones).
        builder = (
            x509.CertificateBuilder()
            .subject_name(cert.subject)
            .issuer_name(cert.issuer)
            .public_key(cert.public_key())
            .serial_number(cert.serial_number)
            .not_valid_before(cert.not_valid_before_utc)
            .not_valid_after(cert.not_valid_after_utc)
        )
        for extension in cert.extensions:
            builder = builder.add_extension(extension.value, critical=extension.critical)
        for extra in extensions:
            builder = builder.add_extension(extra, critical=False)
        assert isinstance(ca.private_key, ec.EllipticCurvePrivateKey)
        cert = builder.sign(ca.private_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM)


# -- CA -------------------------------------------------------------------------------------


def test_init_ca_writes_a_constrained_root(tmp_path: Path) -> None:
    files = init_ca(tmp_path / "ca", federation="acme")
    assert files.federation == "acme"
    assert files.cert == tmp_path / "ca" / "ca.crt"
    assert _mode(files.key) == 0o600
    cert = _cert(files.cert)
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert not usage.value.digital_signature
    cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://acme"]
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "acme"
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert load_ca(tmp_path / "ca").federation == "acme"


def test_init_ca_refuses_to_overwrite(tmp_path: Path) -> None:
    init_ca(tmp_path)
    before = (tmp_path / "ca.key").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        init_ca(tmp_path)
    assert (tmp_path / "ca.key").read_bytes() == before


def test_init_ca_refuses_when_only_the_key_exists(tmp_path: Path) -> None:
    (tmp_path / "ca.key").write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        init_ca(tmp_path)
    assert not (tmp_path / "ca.crt").exists()
    assert (tmp_path / "ca.key").read_bytes() == b"precious"


@pytest.mark.parametrize("federation", ["", "Acme", "a/b", "-x", "x" * 64, "fed:1"])
def test_init_ca_rejects_bad_federation_names(tmp_path: Path, federation: str) -> None:
    with pytest.raises(ValueError, match="federation"):
        init_ca(tmp_path, federation=federation)
    assert not any(tmp_path.iterdir())


def test_ed25519_ca_signs_ec_members(tmp_path: Path) -> None:
    init_ca(tmp_path, key_type="ed25519")
    ca_cert = _cert(tmp_path / "ca.crt")
    assert isinstance(ca_cert.public_key(), ed25519.Ed25519PublicKey)
    issued = issue_certificate(tmp_path, Role.AGENT, "a1")
    leaf = _cert(issued.cert)
    leaf.verify_directly_issued_by(ca_cert)
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)


def test_ed25519_member_certificates_are_refused(tmp_path: Path) -> None:
    init_ca(tmp_path)
    with pytest.raises(ValueError, match="Ed25519"):
        issue_certificate(tmp_path, Role.AGENT, "a1", key_type="ed25519")
    assert not (tmp_path / "a1.key").exists()


# -- issuing --------------------------------------------------------------------------------


def test_issue_certificate_contents(tmp_path: Path) -> None:
    init_ca(tmp_path, federation="acme")
    issued = issue_certificate(
        tmp_path, Role.CPM, "cpm-1", sans=["localhost", "127.0.0.1", "::1", "cpm.example.org"]
    )
    assert issued.identity == PeerIdentity("acme", Role.CPM, "cpm-1")
    assert issued.cert == tmp_path / "cpm-1.crt"
    assert _mode(issued.key) == 0o600
    leaf, ca = _cert(issued.cert), _cert(tmp_path / "ca.crt")
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://acme/cpm/cpm-1"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "cpm.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ip_address("127.0.0.1"), ip_address("::1")]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_agreement and not usage.key_cert_sign
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "cpm-1"
    key = serialization.load_pem_private_key(issued.key.read_bytes(), password=None)
    assert key.public_key() == leaf.public_key()


def test_issue_adds_no_implicit_sans(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issued = issue_certificate(tmp_path, Role.AGENT, "a1")
    san = _cert(issued.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [type(n) for n in san] == [x509.UniformResourceIdentifier]


def test_issue_refuses_to_overwrite(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_certificate(tmp_path, Role.AGENT, "a1")
    before = (tmp_path / "a1.key").read_bytes()
    with pytest.raises(FileExistsError, match=r"a1\.crt"):
        issue_certificate(tmp_path, Role.OVERLAY, "a1")
    assert (tmp_path / "a1.key").read_bytes() == before


def test_issue_without_a_ca_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="peerlm ca init"):
        issue_certificate(tmp_path, Role.AGENT, "a1")


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "a b", "é", "x" * 64, "-a", "ca"])
def test_issue_rejects_unsafe_names(tmp_path: Path, name: str) -> None:
    init_ca(tmp_path)
    with pytest.raises(ValueError):
        issue_certificate(tmp_path, Role.AGENT, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key"]


def test_issue_rejects_bad_san_before_writing(tmp_path: Path) -> None:
    init_ca(tmp_path)
    with pytest.raises(ValueError, match="SAN"):
        issue_certificate(tmp_path, Role.AGENT, "a1", sans=[" "])
    assert not (tmp_path / "a1.key").exists()


def test_issue_lifetime_is_clamped_to_the_ca(tmp_path: Path) -> None:
    init_ca(tmp_path, days=10)
    issued = issue_certificate(tmp_path, Role.AGENT, "a1", days=365)
    assert _cert(issued.cert).not_valid_after_utc == _cert(tmp_path / "ca.crt").not_valid_after_utc


def test_issue_with_explicit_validity(tmp_path: Path) -> None:
    init_ca(tmp_path)
    start = datetime(2020, 1, 1, tzinfo=UTC)
    end = datetime(2020, 2, 1, tzinfo=UTC)
    issued = issue_certificate(
        tmp_path, Role.AGENT, "old", not_valid_before=start, not_valid_after=end
    )
    leaf = _cert(issued.cert)
    assert (leaf.not_valid_before_utc, leaf.not_valid_after_utc) == (start, end)
    with pytest.raises(ValueError, match="before it becomes valid"):
        issue_certificate(tmp_path, Role.AGENT, "bad", not_valid_before=end, not_valid_after=start)


@pytest.mark.parametrize("name", ["a1.vrf", "A.VRF"])
def test_issue_refuses_names_that_shadow_a_vrf_key(tmp_path: Path, name: str) -> None:
    init_ca(tmp_path)
    with pytest.raises(ValueError, match="VRF key file"):
        issue_certificate(tmp_path, Role.CPM, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key"]


# -- the overlay identity (VRF) key ---------------------------------------------------------


@pytest.mark.parametrize("role", sorted(VRF_ROLES))
def test_issue_writes_a_vrf_key_and_certifies_it(tmp_path: Path, role: Role) -> None:
    init_ca(tmp_path)
    issued = issue_certificate(tmp_path, role, "n1")
    assert issued.vrf_key == vrf_key_path(tmp_path, "n1") == tmp_path / "n1.vrf.key"
    assert _mode(issued.vrf_key) == 0o600
    secret = load_vrf_secret(issued.vrf_key)
    assert len(secret) == 32

    pem = issued.cert.read_bytes()
    extension = _cert(issued.cert).extensions.get_extension_for_oid(VRF_PUBLIC_KEY_OID)
    assert not extension.critical
    assert isinstance(extension.value, x509.UnrecognizedExtension)
    certified = vrf_public_key_from_certificate_pem(pem)
    assert certified == vrf.public_key(secret)
    assert extension.value.value == b"\x04\x20" + certified  # DER OCTET STRING
    assert identity_from_certificate_pem(pem).vrf_public_key == certified
    assert issued.identity.vrf_public_key == certified

    # What the overlay does with it: a proof made with the file's key verifies against the
    # key the certificate (hence the CA) vouches for, and only for the input it was made for.
    pi = vrf.prove(secret, b"epoch 3 seed")
    assert vrf.verify(certified, pi, b"epoch 3 seed") == vrf.proof_to_hash(pi)
    assert vrf.verify(certified, pi, b"epoch 4 seed") is None


def test_each_issue_gets_its_own_vrf_key(tmp_path: Path) -> None:
    init_ca(tmp_path)
    a = issue_certificate(tmp_path, Role.AGENT, "a1")
    b = issue_certificate(tmp_path, Role.AGENT, "a2")
    assert a.identity.vrf_public_key != b.identity.vrf_public_key
    assert load_vrf_secret(tmp_path / "a1.vrf.key") != load_vrf_secret(tmp_path / "a2.vrf.key")


@pytest.mark.parametrize("role", [Role.CPM, Role.ADMIN])
def test_roles_outside_the_overlay_get_no_vrf_key(tmp_path: Path, role: Role) -> None:
    init_ca(tmp_path)
    issued = issue_certificate(tmp_path, role, "x1")
    assert issued.vrf_key is None and not (tmp_path / "x1.vrf.key").exists()
    pem = issued.cert.read_bytes()
    assert vrf_public_key_from_certificate_pem(pem) is None
    assert identity_from_certificate_pem(pem).vrf_public_key is None
    assert inspect_certificate(issued.cert).vrf_public_key is None


def test_reissue_never_overwrites_the_vrf_key(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_certificate(tmp_path, Role.AGENT, "a1")
    files = ("a1.crt", "a1.key", "a1.vrf.key")
    before = {f: (tmp_path / f).read_bytes() for f in files}
    with pytest.raises(FileExistsError, match="already exists"):
        issue_certificate(tmp_path, Role.AGENT, "a1")
    # Even with the certificate and TLS key gone, a leftover VRF key is never replaced.
    (tmp_path / "a1.crt").unlink()
    (tmp_path / "a1.key").unlink()
    with pytest.raises(FileExistsError, match=r"a1\.vrf\.key"):
        issue_certificate(tmp_path, Role.OVERLAY, "a1")
    assert (tmp_path / "a1.vrf.key").read_bytes() == before["a1.vrf.key"]
    assert not (tmp_path / "a1.crt").exists() and not (tmp_path / "a1.key").exists()


def test_a_failed_write_leaves_no_partial_kit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import peerlm.pki.ca as ca_module

    init_ca(tmp_path)
    real = ca_module._write_exclusive

    def fail_on_certificate(path: Path, data: bytes, mode: int) -> None:
        if path.suffix == ".crt":
            raise OSError("disk full")
        real(path, data, mode)

    monkeypatch.setattr(ca_module, "_write_exclusive", fail_on_certificate)
    with pytest.raises(OSError, match="disk full"):
        issue_certificate(tmp_path, Role.AGENT, "a1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key"]


def test_vrf_extension_round_trips_through_sign_leaf_certificate(tmp_path: Path) -> None:
    init_ca(tmp_path)
    ca = load_ca(tmp_path)
    now = datetime.now(UTC)
    key = bytes(range(32))
    cert = sign_leaf_certificate(
        ca,
        public_key=ec.generate_private_key(ec.SECP256R1()).public_key(),
        common_name="o1",
        uris=["spiffe://peerlm/overlay/o1"],
        not_valid_before=now,
        not_valid_after=now + timedelta(days=1),
        vrf_public_key=key,
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    assert vrf_public_key_from_certificate_pem(pem) == key
    parsed = identity_from_certificate_pem(pem)
    assert parsed.vrf_public_key == key
    # The key is an attribute of the identity, not part of it.
    assert parsed == PeerIdentity("peerlm", Role.OVERLAY, "o1")
    assert hash(parsed) == hash(PeerIdentity("peerlm", Role.OVERLAY, "o1"))
    with pytest.raises(ValueError, match="32 bytes"):
        sign_leaf_certificate(
            ca,
            public_key=ec.generate_private_key(ec.SECP256R1()).public_key(),
            common_name="o2",
            uris=[],
            not_valid_before=now,
            not_valid_after=now + timedelta(days=1),
            vrf_public_key=key[:31],
        )


@pytest.mark.parametrize(
    "value",
    [b"", bytes(32), b"\x04\x20" + bytes(31), b"\x04\x21" + bytes(33), b"\x05\x20" + bytes(32)],
)
def test_malformed_vrf_extensions_are_errors(tmp_path: Path, value: bytes) -> None:
    init_ca(tmp_path)
    pem = _leaf_with_uris(
        tmp_path,
        ["spiffe://peerlm/agent/a1"],
        [x509.UnrecognizedExtension(VRF_PUBLIC_KEY_OID, value)],
    )
    with pytest.raises(ValueError, match="malformed VRF public key extension"):
        vrf_public_key_from_certificate_pem(pem)
    with pytest.raises(ValueError, match="malformed VRF public key extension"):
        identity_from_certificate_pem(pem)
    path = tmp_path / "odd.crt"
    path.write_bytes(pem)
    with pytest.raises(ValueError, match=r"odd\.crt: malformed VRF"):
        inspect_certificate(path)


def test_vrf_public_key_from_non_pem_is_an_error() -> None:
    with pytest.raises(ValueError, match="PEM"):
        vrf_public_key_from_certificate_pem(b"not a certificate")


def test_peer_identity_checks_the_vrf_key_length() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PeerIdentity("peerlm", Role.AGENT, "a1", vrf_public_key=bytes(31))
    assert PeerIdentity("peerlm", Role.AGENT, "a1", bytes(32)).vrf_public_key == bytes(32)


def test_load_vrf_secret_refusals(tmp_path: Path) -> None:
    path = tmp_path / "k.vrf.key"
    with pytest.raises(FileNotFoundError, match="peerlm ca issue"):
        load_vrf_secret(path)
    path.write_bytes(bytes(range(32)))
    for mode in (0o640, 0o604, 0o620, 0o602, 0o644, 0o660):
        path.chmod(mode)
        with pytest.raises(PermissionError, match=rf"mode 0{mode:o}.*chmod 600"):
            load_vrf_secret(path)
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert load_vrf_secret(path) == bytes(range(32))
    path.chmod(0o600)
    for size, words in ((31, "31 bytes"), (0, "0 bytes"), (33, "more than 32 bytes")):
        path.write_bytes(bytes(size))
        with pytest.raises(ValueError, match=words):
            load_vrf_secret(path)
    (tmp_path / "dir.vrf.key").mkdir(mode=0o700)
    with pytest.raises((ValueError, IsADirectoryError)):
        load_vrf_secret(tmp_path / "dir.vrf.key")


def test_load_vrf_secret_follows_symlinks_to_a_private_file(tmp_path: Path) -> None:
    target = tmp_path / "real.key"
    target.write_bytes(bytes(32))
    target.chmod(0o600)
    link = tmp_path / "link.vrf.key"
    link.symlink_to(target)
    assert load_vrf_secret(str(link)) == bytes(32)
    target.chmod(0o644)
    with pytest.raises(PermissionError):
        load_vrf_secret(link)


# -- identities -----------------------------------------------------------------------------


@given(federation=FEDERATIONS, role=st.sampled_from(Role), name=NAMES)
def test_spiffe_round_trip(federation: str, role: Role, name: str) -> None:
    identity = PeerIdentity(federation, role, name)
    assert identity.spiffe_uri == f"spiffe://{federation}/{role.value}/{name}"
    assert parse_spiffe_uri(identity.spiffe_uri) == identity


@given(name=st.text(max_size=70))
def test_names_are_valid_exactly_when_they_match_the_pattern(name: str) -> None:
    import re

    valid = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name) is not None
    try:
        PeerIdentity("peerlm", Role.AGENT, name)
    except ValueError:
        assert not valid
    else:
        assert valid
        # Safe as a file name: a single path component that is not . or ..
        assert Path(name).name == name and name not in {".", ".."}


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("https://peerlm/agent/a1", "scheme"),
        ("spiffe://peerlm/agent", "two path segments"),
        ("spiffe://peerlm/agent/a1/extra", "two path segments"),
        ("spiffe://peerlm/agent/", "invalid peer name"),
        ("spiffe://peerlm/wizard/a1", "unknown role"),
        ("spiffe:///agent/a1", "missing federation"),
        ("spiffe://Peerlm/agent/a1", "federation"),
        ("spiffe://peerlm:443/agent/a1", "ports"),
        ("spiffe://user@peerlm/agent/a1", "user info"),
        ("spiffe://peerlm/agent/a1?x=1", "query"),
        ("spiffe://peerlm/agent/a1#f", "fragment"),
        ("spiffe://peerlm/agent/..", "invalid peer name"),
        ("spiffe://peerlm/agent/a%2Fb", "invalid peer name"),
        ("spiffe://peerlm/agent/a 1", "whitespace"),
        ("", "scheme"),
    ],
)
def test_parse_spiffe_uri_rejections(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_spiffe_uri(uri)


def test_identity_accepts_role_strings() -> None:
    identity = PeerIdentity("peerlm", "agent", "a1")  # type: ignore[arg-type]
    assert identity.role is Role.AGENT
    with pytest.raises(ValueError, match="unknown role"):
        PeerIdentity("peerlm", "wizard", "a1")  # type: ignore[arg-type]


def test_identity_from_certificate_pem(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issued = issue_certificate(tmp_path, Role.OVERLAY, "sp-1")
    assert identity_from_certificate_pem(issued.cert.read_bytes()) == PeerIdentity(
        "peerlm", Role.OVERLAY, "sp-1"
    )
    # The CA names only the federation (spiffe://peerlm), which is not a peer identity.
    with pytest.raises(ValueError, match="two path segments"):
        identity_from_certificate_pem((tmp_path / "ca.crt").read_bytes())
    with pytest.raises(ValueError, match="exactly one"):
        identity_from_certificate_pem(
            _leaf_with_uris(tmp_path, ["spiffe://peerlm/agent/a", "spiffe://peerlm/admin/b"])
        )
    with pytest.raises(ValueError, match="no spiffe"):
        identity_from_certificate_pem(_leaf_with_uris(tmp_path, ["https://example.org/"]))
    with pytest.raises(ValueError, match="PEM"):
        identity_from_certificate_pem(b"not a certificate")


# -- inspect --------------------------------------------------------------------------------


def test_inspect_certificate(tmp_path: Path) -> None:
    init_ca(tmp_path, federation="acme")
    issued = issue_certificate(tmp_path, Role.AGENT, "a1", sans=["10.0.0.7", "a1.local"])
    info = inspect_certificate(issued.cert)
    assert info.identity == PeerIdentity("acme", Role.AGENT, "a1")
    assert info.sans == ("URI:spiffe://acme/agent/a1", "IP:10.0.0.7", "DNS:a1.local")
    assert info.subject == "CN=a1"
    assert "O=acme" in info.issuer
    assert not info.expired and not info.is_ca
    assert info.key_type == "ec-secp256r1"
    assert len(info.sha256_fingerprint) == 64
    assert info.vrf_public_key is not None
    assert info.vrf_public_key == vrf_public_key_from_certificate_pem(issued.cert.read_bytes())
    as_json = info.to_json_dict()
    assert as_json["identity"] == "spiffe://acme/agent/a1" and as_json["role"] == "agent"
    assert as_json["vrf_public_key"] == info.vrf_public_key.hex()
    json.dumps(as_json)

    ca_info = inspect_certificate(tmp_path / "ca.crt")
    assert ca_info.is_ca and ca_info.identity is None
    assert ca_info.vrf_public_key is None and ca_info.to_json_dict()["vrf_public_key"] is None


def test_inspect_flags_expired_certificates(tmp_path: Path) -> None:
    init_ca(tmp_path)
    now = datetime.now(UTC)
    issued = issue_certificate(
        tmp_path,
        Role.AGENT,
        "old",
        not_valid_before=now - timedelta(days=2),
        not_valid_after=now - timedelta(days=1),
    )
    assert inspect_certificate(issued.cert).expired


def test_inspect_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        inspect_certificate(tmp_path / "nope.crt")
    (tmp_path / "junk.crt").write_text("junk")
    with pytest.raises(ValueError, match="not a PEM certificate"):
        inspect_certificate(tmp_path / "junk.crt")


# -- CLI ------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_init_issue_inspect(tmp_path: Path) -> None:
    result = runner.invoke(app, ["init", "--dir", str(tmp_path), "--federation", "acme"])
    assert result.exit_code == 0, result.output
    assert "acme" in result.stdout
    result = runner.invoke(
        app,
        [
            *("issue", "--dir", str(tmp_path), "--role", "agent", "--name", "a1"),
            *("--san", "127.0.0.1", "--san", "localhost", "--days", "30"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "spiffe://acme/agent/a1" in result.stdout
    assert _mode(tmp_path / "a1.key") == 0o600
    assert _mode(tmp_path / "a1.vrf.key") == 0o600
    vrf_hex = vrf.public_key(load_vrf_secret(tmp_path / "a1.vrf.key")).hex()
    assert f"{tmp_path / 'a1.vrf.key'}" in result.stdout and vrf_hex in result.stdout

    result = runner.invoke(app, ["inspect", str(tmp_path / "a1.crt"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["identity"] == "spiffe://acme/agent/a1"
    assert data["sans"] == ["URI:spiffe://acme/agent/a1", "IP:127.0.0.1", "DNS:localhost"]
    assert data["expired"] is False
    assert data["vrf_public_key"] == vrf_hex

    result = runner.invoke(app, ["inspect", str(tmp_path / "a1.crt")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "spiffe://acme/agent/a1" in result.stdout
    assert "a1" in result.stdout
    assert "VRF public key" in result.stdout and vrf_hex in result.stdout

    result = runner.invoke(app, ["issue", "--dir", str(tmp_path), "--role", "cpm", "--name", "c"])
    assert result.exit_code == 0, result.output
    assert "VRF" not in result.stdout
    result = runner.invoke(app, ["inspect", str(tmp_path / "c.crt")])
    assert result.exit_code == 0, result.output
    assert "VRF" not in result.stdout


def test_cli_init_ed25519(tmp_path: Path) -> None:
    result = runner.invoke(app, ["init", "--dir", str(tmp_path), "--key-type", "ed25519"])
    assert result.exit_code == 0, result.output
    assert inspect_certificate(tmp_path / "ca.crt").key_type == "ed25519"


def _assert_usage_error(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.output


def test_cli_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    d = str(tmp_path)
    _assert_usage_error(["issue", "--dir", d, "--role", "agent", "--name", "a1"], "peerlm ca init")
    _assert_usage_error(["init", "--dir", d, "--key-type", "rsa"], "unknown key type")
    _assert_usage_error(["init", "--dir", d, "--federation", "Bad Name"], "federation")
    assert runner.invoke(app, ["init", "--dir", d]).exit_code == 0
    _assert_usage_error(["init", "--dir", d], "already exists")
    _assert_usage_error(["issue", "--dir", d, "--role", "wizard", "--name", "a1"], "unknown role")
    _assert_usage_error(["issue", "--dir", d, "--role", "agent", "--name", "../x"], "invalid peer")
    assert (
        runner.invoke(app, ["issue", "--dir", d, "--role", "agent", "--name", "a1"]).exit_code == 0
    )
    _assert_usage_error(["issue", "--dir", d, "--role", "agent", "--name", "a1"], "already exists")
    _assert_usage_error(["inspect", str(tmp_path / "missing.crt")], "not found")
