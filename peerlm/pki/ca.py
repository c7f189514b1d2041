"""The federation certificate authority: create it, issue role-bearing certificates, inspect.

Layout of a CA directory ``D`` (the same directory holds the issued kits)::

    D/ca.crt        the federation root, distributed to every member
    D/ca.key        its private key (mode 0600; keep it offline in production)
    D/<name>.crt     a member certificate, URI SAN spiffe://<federation>/<role>/<name>
    D/<name>.key     its private key (mode 0600)
    D/<name>.vrf.key agent and overlay members: the 32-byte Ed25519 seed of the overlay
                     identity (ECVRF) key (mode 0600), its public key certified in <name>.crt

Files are created with ``O_EXCL`` so nothing here ever overwrites a key or a certificate.
The federation name is stored in the CA certificate twice: as the subject's ``O=`` and as a
``spiffe://<federation>`` URI SAN (the SAN is what :func:`load_ca` reads back).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, get_args

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from peerlm.pki.identity import (
    VRF_SECRET_KEY_LEN,
    PeerIdentity,
    Role,
    identity_from_certificate,
    spiffe_uris,
    validate_federation,
    validate_name,
    vrf_public_key_extension,
    vrf_public_key_from_certificate,
)

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "KEY_TYPES",
    "VRF_KEY_SUFFIX",
    "VRF_ROLES",
    "CaFiles",
    "CertificateInfo",
    "IssuedFiles",
    "KeyType",
    "LoadedCa",
    "PrivateKey",
    "PublicKey",
    "generate_private_key",
    "init_ca",
    "inspect_certificate",
    "issue_certificate",
    "load_ca",
    "sign_leaf_certificate",
    "vrf_key_path",
]

KeyType = Literal["ec-p256", "ed25519"]
KEY_TYPES: tuple[str, ...] = get_args(KeyType)
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
# Backdate notBefore a little so a peer whose clock is slightly behind still accepts a
# certificate issued a moment ago.
_CLOCK_SKEW = timedelta(minutes=5)
_RESERVED_NAMES = frozenset({"ca"})
# Members that take part in the overlay get an overlay identity (VRF) key with their kit.
VRF_ROLES = frozenset({Role.AGENT, Role.OVERLAY})
VRF_KEY_SUFFIX = ".vrf.key"


@dataclass(frozen=True)
class CaFiles:
    """Where :func:`init_ca` wrote the federation root."""

    cert: Path
    key: Path
    federation: str


@dataclass(frozen=True)
class IssuedFiles:
    """Where :func:`issue_certificate` wrote a member's certificate and keys.

    ``vrf_key`` is the overlay identity key file, written for :data:`VRF_ROLES` only.
    """

    cert: Path
    key: Path
    identity: PeerIdentity
    vrf_key: Path | None = None


@dataclass(frozen=True)
class LoadedCa:
    """A CA certificate with its private key, ready to sign."""

    certificate: x509.Certificate
    private_key: PrivateKey
    federation: str


@dataclass(frozen=True)
class CertificateInfo:
    """What :func:`inspect_certificate` reports about a certificate file."""

    path: Path
    subject: str
    issuer: str
    serial: int
    sans: tuple[str, ...]
    not_valid_before: datetime
    not_valid_after: datetime
    expired: bool
    identity: PeerIdentity | None
    is_ca: bool
    key_type: str
    sha256_fingerprint: str
    vrf_public_key: bytes | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view (times in ISO 8601 UTC, serial in hex)."""
        return {
            "path": str(self.path),
            "subject": self.subject,
            "issuer": self.issuer,
            "serial": f"{self.serial:x}",
            "sans": list(self.sans),
            "not_valid_before": self.not_valid_before.isoformat(),
            "not_valid_after": self.not_valid_after.isoformat(),
            "expired": self.expired,
            "identity": self.identity.spiffe_uri if self.identity else None,
            "role": self.identity.role.value if self.identity else None,
            "name": self.identity.name if self.identity else None,
            "federation": self.identity.federation if self.identity else None,
            "is_ca": self.is_ca,
            "key_type": self.key_type,
            "sha256_fingerprint": self.sha256_fingerprint,
            "vrf_public_key": self.vrf_public_key.hex() if self.vrf_public_key else None,
        }


def generate_private_key(key_type: KeyType) -> PrivateKey:
    """A fresh private key of ``key_type``."""
    if key_type == "ec-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(f"unknown key type {key_type!r}: expected one of {', '.join(KEY_TYPES)}")


def _signature_hash(key: PrivateKey) -> hashes.SHA256 | None:
    # Ed25519 signs the message itself; cryptography requires algorithm=None for it.
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _refuse_existing(*paths: Path) -> None:
    # Checked up front so that a refusal leaves nothing half-written; O_EXCL below still
    # guarantees no overwrite if another process races us.
    for path in paths:
        if path.exists():
            raise FileExistsError(f"{path} already exists; refusing to overwrite it")


def _write_exclusive(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        if fd != -1:
            os.close(fd)
    # The umask may have stripped bits from ``mode``; make the result exact.
    os.chmod(path, mode)


def _write_kit(
    cert_path: Path, cert: x509.Certificate, secret_files: Sequence[tuple[Path, bytes]]
) -> None:
    """Write the secret files (0600), then the certificate (0644), all with ``O_EXCL``."""
    _refuse_existing(cert_path, *(path for path, _ in secret_files))
    written: list[Path] = []
    try:
        for path, data in secret_files:
            _write_exclusive(path, data, 0o600)
            written.append(path)
        _write_exclusive(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    except BaseException:
        # Keys without their certificate are useless and would block a retry. Only files
        # this call created are removed: O_EXCL failed before creating anything.
        for path in written:
            path.unlink(missing_ok=True)
        raise


def vrf_key_path(directory: Path, name: str) -> Path:
    """Where :func:`issue_certificate` writes ``name``'s VRF secret key: ``D/<name>.vrf.key``."""
    return directory / f"{name}{VRF_KEY_SUFFIX}"


def _now() -> datetime:
    return datetime.now(UTC)


def init_ca(
    directory: Path,
    federation: str = "peerlm",
    key_type: KeyType = "ec-p256",
    days: int = 3650,
) -> CaFiles:
    """Create the federation root in ``directory`` (``ca.crt`` and ``ca.key``).

    Raises ``FileExistsError`` if either file exists and ``ValueError`` for a bad federation
    name, key type or lifetime.
    """
    validate_federation(federation)
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    _refuse_existing(cert_path, key_path)

    key = generate_private_key(key_type)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),
            x509.NameAttribute(NameOID.COMMON_NAME, f"peerlm federation CA ({federation})"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + timedelta(days=days))
        # path_length=0: the root signs member certificates only, never intermediates.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"spiffe://{federation}")]),
            critical=False,
        )
        .sign(key, _signature_hash(key))
    )
    _write_kit(cert_path, cert, [(key_path, _key_pem(key))])
    return CaFiles(cert=cert_path, key=key_path, federation=federation)


def _federation_of_ca(cert: x509.Certificate, path: Path) -> str:
    for uri in spiffe_uris(cert):
        trust_domain = uri.split("://", 1)[-1].rstrip("/")
        if trust_domain and "/" not in trust_domain:
            return validate_federation(trust_domain)
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    if orgs:
        return validate_federation(str(orgs[0].value))
    raise ValueError(f"{path} names no federation (no spiffe://<federation> SAN and no O=)")


def load_ca(directory: Path) -> LoadedCa:
    """Load ``ca.crt`` and ``ca.key`` from ``directory``.

    Raises ``FileNotFoundError`` naming the missing file (and how to create it) and
    ``ValueError`` when the files do not parse, do not match or are not a CA.
    """
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    for path in (cert_path, key_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found; create a CA with `peerlm ca init --dir {directory}`"
            )
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{cert_path} is not a PEM certificate: {err}") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{key_path} is not an unencrypted PEM private key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
        raise ValueError(f"{key_path}: unsupported key type {type(key).__name__}")
    if key.public_key() != cert.public_key():
        raise ValueError(f"{key_path} does not belong to {cert_path}")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ValueError(f"{cert_path} is not a CA certificate")
    return LoadedCa(
        certificate=cert, private_key=key, federation=_federation_of_ca(cert, cert_path)
    )


def _general_name(value: str) -> x509.GeneralName:
    text = value.strip()
    if not text:
        raise ValueError("empty SAN value")
    try:
        return x509.IPAddress(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    # cryptography only accepts A-labels; say so rather than failing deep inside it.
    if not text.isascii():
        raise ValueError(f"SAN {value!r}: use the punycode (xn--) form of international names")
    return x509.DNSName(text)


def sign_leaf_certificate(
    ca: LoadedCa,
    *,
    public_key: PublicKey,
    common_name: str,
    uris: Sequence[str],
    sans: Sequence[str] = (),
    not_valid_before: datetime,
    not_valid_after: datetime,
    vrf_public_key: bytes | None = None,
) -> x509.Certificate:
    """Sign a member (leaf) certificate; the building block under :func:`issue_certificate`.

    ``uris`` are written verbatim as URI SANs and are *not* checked against the CA's
    federation; :func:`issue_certificate` is the safe entry point, this one exists for
    provisioning pipelines and for tests that need deliberately odd certificates.
    ``vrf_public_key`` (32 bytes) is certified in the non-critical VRF extension.
    """
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [_general_name(s) for s in sans]
    is_ec = isinstance(public_key, ec.EllipticCurvePublicKey)
    ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_valid_before)
        .not_valid_after(not_valid_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                # ECDH key agreement is meaningful for EC keys only.
                key_agreement=is_ec,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        # Every process is both a gRPC server and a gRPC client.
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if vrf_public_key is not None:
        # Non-critical: TLS stacks that do not know the OID must still accept the certificate.
        builder = builder.add_extension(vrf_public_key_extension(vrf_public_key), critical=False)
    return builder.sign(ca.private_key, _signature_hash(ca.private_key))


def issue_certificate(
    directory: Path,
    role: Role,
    name: str,
    sans: Sequence[str] = (),
    days: int = 365,
    *,
    not_valid_before: datetime | None = None,
    not_valid_after: datetime | None = None,
    key_type: KeyType = "ec-p256",
) -> IssuedFiles:
    """Issue ``<name>.crt``/``<name>.key`` in ``directory``, signed by the CA there.

    The certificate carries the URI SAN ``spiffe://<federation>/<role>/<name>`` plus one SAN
    per ``sans`` entry (an IP address SAN when it parses as an IP, else a DNS name); nothing
    else is added implicitly. ``not_valid_before``/``not_valid_after`` override ``days``
    (tests use them to make expired certificates). A lifetime derived from ``days`` is
    clamped to the CA's own expiry, since nothing outlives its issuer's signature.

    Member keys are always ECDSA P-256: ``key_type="ed25519"`` raises ``ValueError`` because
    gRPC's TLS stack cannot use Ed25519 leaf certificates (see docs/security.md).

    For the roles in :data:`VRF_ROLES` (agent, overlay) it also writes ``<name>.vrf.key``, a
    fresh 32-byte Ed25519 seed for the overlay's ECVRF, and certifies its public key in the
    certificate's VRF extension (:data:`peerlm.pki.identity.VRF_PUBLIC_KEY_OID`). Names
    ending in ``.vrf`` are refused, since ``<name>.vrf.key`` would be another member's file.
    """
    role = Role(role)
    validate_name(name)
    if key_type == "ed25519":
        # Measured with grpcio 1.85: BoringSSL in gRPC core does not offer Ed25519 in the TLS
        # handshake (NO_COMMON_SIGNATURE_ALGORITHMS), so such a certificate can never be used
        # by a peerlm process. An Ed25519 *CA* is fine: chain verification supports it.
        raise ValueError(
            "Ed25519 member certificates are not usable with gRPC (its TLS stack does not "
            "negotiate Ed25519 signatures); use key type ec-p256"
        )
    if name.lower() in _RESERVED_NAMES:
        raise ValueError(f"name {name!r} is reserved for the CA's own files")
    if name.lower().endswith(".vrf"):
        raise ValueError(
            f"name {name!r} is reserved: {name}.key would be the VRF key file of "
            f"{name[: -len('.vrf')]!r}"
        )
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    ca = load_ca(directory)
    identity = PeerIdentity(federation=ca.federation, role=role, name=name)
    for san in sans:  # validate before writing anything
        _general_name(san)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    vrf_path = vrf_key_path(directory, name) if role in VRF_ROLES else None
    _refuse_existing(cert_path, key_path, *([vrf_path] if vrf_path else []))

    now = _now()
    start = not_valid_before if not_valid_before is not None else now - _CLOCK_SKEW
    if not_valid_after is not None:
        end = not_valid_after
    else:
        end = min(now + timedelta(days=days), ca.certificate.not_valid_after_utc)
    if end <= start:
        raise ValueError(f"certificate would expire ({end}) before it becomes valid ({start})")
    key = generate_private_key(key_type)
    secret_files = [(key_path, _key_pem(key))]
    vrf_public_key = None
    if vrf_path is not None:
        vrf_seed = secrets.token_bytes(VRF_SECRET_KEY_LEN)
        # RFC 9381's ECVRF-EDWARDS25519 key pair is the RFC 8032 key pair of the seed.
        vrf_public_key = (
            ed25519.Ed25519PrivateKey.from_private_bytes(vrf_seed).public_key().public_bytes_raw()
        )
        secret_files.append((vrf_path, vrf_seed))
    cert = sign_leaf_certificate(
        ca,
        public_key=key.public_key(),
        common_name=name,
        uris=[identity.spiffe_uri],
        sans=sans,
        not_valid_before=start,
        not_valid_after=end,
        vrf_public_key=vrf_public_key,
    )
    _write_kit(cert_path, cert, secret_files)
    return IssuedFiles(
        cert=cert_path,
        key=key_path,
        identity=identity_from_certificate(cert),
        vrf_key=vrf_path,
    )


def _san_strings(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    out: list[str] = []
    for general_name in san:
        if isinstance(general_name, x509.UniformResourceIdentifier):
            out.append(f"URI:{general_name.value}")
        elif isinstance(general_name, x509.DNSName):
            out.append(f"DNS:{general_name.value}")
        elif isinstance(general_name, x509.IPAddress):
            out.append(f"IP:{general_name.value}")
        else:
            out.append(f"{type(general_name).__name__}:{general_name.value}")
    return tuple(out)


def _key_type_name(cert: x509.Certificate) -> str:
    key = cert.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        return f"ec-{key.curve.name}"
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "ed25519"
    return type(key).__name__


def inspect_certificate(path: Path) -> CertificateInfo:
    """Describe the PEM certificate at ``path`` (the first one, if the file holds a chain)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{path} is not a PEM certificate: {err}") from None
    try:
        identity: PeerIdentity | None = identity_from_certificate(cert)
    except ValueError:
        identity = None
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    try:
        vrf_public_key = vrf_public_key_from_certificate(cert)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    der = cert.public_bytes(serialization.Encoding.DER)
    return CertificateInfo(
        path=path,
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        serial=cert.serial_number,
        sans=_san_strings(cert),
        not_valid_before=cert.not_valid_before_utc,
        not_valid_after=cert.not_valid_after_utc,
        expired=cert.not_valid_after_utc <= _now(),
        identity=identity,
        is_ca=is_ca,
        key_type=_key_type_name(cert),
        sha256_fingerprint=hashlib.sha256(der).hexdigest(),
        vrf_public_key=vrf_public_key,
    )
