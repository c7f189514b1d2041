"""Federation identities: who a peer is, as written in its certificate.

Principle 2 of the design: *identity is the certificate*. Every certificate the federation CA
issues carries exactly one URI SAN of the form ``spiffe://<federation>/<role>/<name>``; the
role and name a server acts on come from that URI (after the TLS stack has verified the chain)
and never from a message field.

Agent and overlay certificates also carry the member's **overlay identity key**: the 32-byte
Ed25519 public key of its ECVRF (``peerlm.overlay.vrf``), in a non-critical extension
(:data:`VRF_PUBLIC_KEY_OID`). The TLS key cannot serve, being ECDSA P-256 because gRPC's TLS
stack cannot use Ed25519 leaves; so the CA certifies a second key, and the certificate that
authenticates a peer's connection also fixes the key its VRF outputs must verify under.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509

__all__ = [
    "FEDERATION_PATTERN",
    "NAME_PATTERN",
    "VRF_PUBLIC_KEY_LEN",
    "VRF_PUBLIC_KEY_OID",
    "VRF_SECRET_KEY_LEN",
    "PeerIdentity",
    "Role",
    "certificate_hosts",
    "certificate_hosts_pem",
    "host_listed",
    "identity_from_certificate",
    "identity_from_certificate_pem",
    "load_vrf_secret",
    "parse_spiffe_uri",
    "spiffe_uris",
    "validate_federation",
    "validate_name",
    "vrf_public_key_extension",
    "vrf_public_key_from_certificate",
    "vrf_public_key_from_certificate_pem",
]

# Names become file names (``D/<name>.crt``), so the first character may not be a dot (no
# ``.``/``..``/hidden files) and no separator can appear. 63 characters keeps a name usable
# as a DNS label too.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# A federation is a SPIFFE trust domain: the SPIFFE spec allows lowercase letters, digits,
# dots, dashes and underscores only (trust domains are compared case-sensitively).
FEDERATION_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")

_SPIFFE_SCHEME = "spiffe"

# The overlay identity (ECVRF) public key extension. The OID is in the ITU-T X.667 arc for
# UUID-derived identifiers, 2.25.<UUID as an integer>, here UUID
# b1a7be81-8437-4b5b-a32a-e463a49addba: usable without registration and unique by
# construction, whereas any number under 1.3.6.1.4.1 (private enterprises) is assigned by
# IANA to someone else unless registered. The value (extnValue) is the DER encoding of
#   PeerlmVrfPublicKey ::= OCTET STRING (SIZE (32))  -- an RFC 8032 Ed25519 public key
# i.e. the bytes 04 20 followed by the 32 key bytes, as RFC 5280 wants DER inside extnValue.
VRF_PUBLIC_KEY_OID = x509.ObjectIdentifier("2.25.236144332748481951959812282602573454778")
VRF_PUBLIC_KEY_LEN = 32
VRF_SECRET_KEY_LEN = 32
_VRF_EXTENSION_PREFIX = bytes((0x04, VRF_PUBLIC_KEY_LEN))


class Role(StrEnum):
    """What a certificate holder may act as; the authorisation policy is keyed on it."""

    CPM = "cpm"
    AGENT = "agent"
    OVERLAY = "overlay"
    ADMIN = "admin"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid peer name, else raise ``ValueError`` saying why."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"invalid peer name {name!r}: use 1-63 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def validate_federation(federation: str) -> str:
    """Return ``federation`` if it is a valid trust-domain name, else raise ``ValueError``."""
    if not FEDERATION_PATTERN.fullmatch(federation):
        raise ValueError(
            f"invalid federation name {federation!r}: use 1-63 characters from a-z 0-9 . _ -, "
            "starting with a lowercase letter or digit"
        )
    return federation


def _parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        allowed = ", ".join(r.value for r in Role)
        raise ValueError(f"unknown role {value!r}: expected one of {allowed}") from None


@dataclass(frozen=True)
class PeerIdentity:
    """A federation member: ``spiffe://<federation>/<role>/<name>``.

    Construction validates every part, so an instance is always well formed.

    ``vrf_public_key`` is the member's certified overlay identity (ECVRF) key when its
    certificate carries one. It is a credential attached to the identity, not part of it:
    equality and hashing look at the SPIFFE ID only, so an identity parsed from a certificate
    equals one built from its federation, role and name.
    """

    federation: str
    role: Role
    name: str
    vrf_public_key: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_federation(self.federation)
        # Accept a plain string that names a role (e.g. from JSON) but store the enum.
        object.__setattr__(self, "role", _parse_role(str(self.role)))
        validate_name(self.name)
        key = self.vrf_public_key
        if key is not None and (not isinstance(key, bytes) or len(key) != VRF_PUBLIC_KEY_LEN):
            raise ValueError(f"a VRF public key is {VRF_PUBLIC_KEY_LEN} bytes")

    @property
    def spiffe_uri(self) -> str:
        """The SPIFFE ID this identity is written as in a certificate's URI SAN."""
        return f"{_SPIFFE_SCHEME}://{self.federation}/{self.role.value}/{self.name}"

    def __str__(self) -> str:
        return self.spiffe_uri


def parse_spiffe_uri(uri: str) -> PeerIdentity:
    """Parse ``spiffe://<federation>/<role>/<name>``; raise ``ValueError`` saying what is wrong."""
    # Reject anything urlsplit would silently normalise or drop (queries, fragments, ports,
    # user info, whitespace) so that exactly one spelling maps to each identity.
    if any(ch.isspace() for ch in uri):
        raise ValueError(f"invalid SPIFFE ID {uri!r}: contains whitespace")
    parts = urlsplit(uri)
    if parts.scheme != _SPIFFE_SCHEME:
        raise ValueError(f"invalid SPIFFE ID {uri!r}: scheme must be 'spiffe://'")
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise ValueError(f"invalid SPIFFE ID {uri!r}: query and fragment are not allowed")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ValueError(f"invalid SPIFFE ID {uri!r}: user info and ports are not allowed")
    if not parts.netloc:
        raise ValueError(f"invalid SPIFFE ID {uri!r}: missing federation (trust domain)")
    segments = parts.path.split("/")[1:] if parts.path.startswith("/") else []
    if len(segments) != 2:
        raise ValueError(
            f"invalid SPIFFE ID {uri!r}: expected exactly two path segments '/<role>/<name>'"
        )
    role_text, name = segments
    try:
        federation = validate_federation(parts.netloc)
        role = _parse_role(role_text)
        validate_name(name)
    except ValueError as err:
        raise ValueError(f"invalid SPIFFE ID {uri!r}: {err}") from None
    return PeerIdentity(federation=federation, role=role, name=name)


def spiffe_uris(certificate: x509.Certificate) -> list[str]:
    """All ``spiffe://`` URI SANs of ``certificate`` (empty when it has none)."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
    return [u for u in uris if u.lower().startswith(f"{_SPIFFE_SCHEME}:")]


def identity_from_certificate(certificate: x509.Certificate) -> PeerIdentity:
    """The identity in ``certificate``: exactly one SPIFFE URI SAN, else ``ValueError``.

    ``vrf_public_key`` comes from the VRF extension (:func:`vrf_public_key_from_certificate`).

    This does not verify the certificate chain; callers rely on the TLS handshake (or
    ``cryptography`` verification) for that.
    """
    uris = spiffe_uris(certificate)
    if not uris:
        raise ValueError("certificate has no spiffe:// URI SAN, so it names no federation peer")
    if len(uris) > 1:
        raise ValueError(f"certificate has {len(uris)} spiffe:// URI SANs; exactly one is required")
    identity = parse_spiffe_uri(uris[0])
    vrf_key = vrf_public_key_from_certificate(certificate)
    if vrf_key is None:
        return identity
    return PeerIdentity(identity.federation, identity.role, identity.name, vrf_key)


def _load_pem(pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as err:
        raise ValueError(f"not a PEM X.509 certificate: {err}") from None


def identity_from_certificate_pem(pem: bytes) -> PeerIdentity:
    """Parse a PEM certificate and return its identity (see :func:`identity_from_certificate`).

    The identity's ``vrf_public_key`` is filled from the certificate's VRF extension, if any;
    a malformed one is a ``ValueError`` like any other defect of the identity.
    """
    return identity_from_certificate(_load_pem(pem))


# -- the hosts a certificate may serve as --------------------------------------------------------


def certificate_hosts(certificate: x509.Certificate) -> frozenset[str]:
    """The DNS names (lower case) and IP addresses (canonical text) of ``certificate``'s
    SANs: the hosts a TLS client dialling it accepts it for."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    names = {str(n).lower() for n in san.get_values_for_type(x509.DNSName)}
    names |= {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    return frozenset(names)


def certificate_hosts_pem(pem: bytes) -> frozenset[str]:
    """:func:`certificate_hosts` of a PEM certificate; ``ValueError`` if it does not parse."""
    return certificate_hosts(_load_pem(pem))


def host_listed(host: str, listed: frozenset[str] | set[str]) -> bool:
    """Whether a TLS client dialling ``host`` (a name, an IP address, or ``[IPv6]``) would
    accept a certificate whose SAN hosts are ``listed`` (:func:`certificate_hosts`): an IP
    address must be listed as one, a name exactly or under one leftmost wildcard label."""
    text = host.strip("[]").lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(text)) in listed
    except ValueError:
        pass
    if text in listed:
        return True
    # One wildcard label, as TLS name checks allow (``*.example.org``).
    _, _, parent = text.partition(".")
    return bool(parent) and f"*.{parent}" in listed


# -- the overlay identity (VRF) key -------------------------------------------------------------


def vrf_public_key_extension(public_key: bytes) -> x509.UnrecognizedExtension:
    """The certificate extension that certifies ``public_key`` (add it as non-critical)."""
    if not isinstance(public_key, bytes) or len(public_key) != VRF_PUBLIC_KEY_LEN:
        raise ValueError(f"a VRF public key is {VRF_PUBLIC_KEY_LEN} bytes")
    return x509.UnrecognizedExtension(VRF_PUBLIC_KEY_OID, _VRF_EXTENSION_PREFIX + public_key)


def vrf_public_key_from_certificate(certificate: x509.Certificate) -> bytes | None:
    """The 32-byte VRF public key certified by ``certificate``; None when it has none.

    Raises ``ValueError`` when the extension is present but is not a 32-byte OCTET STRING.
    Like :func:`identity_from_certificate`, this does not verify the certificate chain.
    """
    try:
        extension = certificate.extensions.get_extension_for_oid(VRF_PUBLIC_KEY_OID)
    except x509.ExtensionNotFound:
        return None
    value = extension.value
    raw = value.value if isinstance(value, x509.UnrecognizedExtension) else b""
    if len(raw) != len(_VRF_EXTENSION_PREFIX) + VRF_PUBLIC_KEY_LEN or not raw.startswith(
        _VRF_EXTENSION_PREFIX
    ):
        raise ValueError(
            f"malformed VRF public key extension ({VRF_PUBLIC_KEY_OID.dotted_string}): "
            f"expected a DER OCTET STRING of {VRF_PUBLIC_KEY_LEN} bytes"
        )
    return raw[len(_VRF_EXTENSION_PREFIX) :]


def vrf_public_key_from_certificate_pem(pem: bytes) -> bytes | None:
    """:func:`vrf_public_key_from_certificate` for a PEM certificate."""
    return vrf_public_key_from_certificate(_load_pem(pem))


def load_vrf_secret(path: Path | str) -> bytes:
    """Read a 32-byte VRF secret key (``<name>.vrf.key``, raw bytes, an RFC 8032 seed).

    Refuses, naming the file, one that is missing (``FileNotFoundError``), that group or
    others may access in any way (``PermissionError``: it must be ``0600`` or stricter, like
    an SSH key), that is not a regular file, or that is not exactly 32 bytes (``ValueError``).
    The mode is checked on the opened file, so a symlink (as Kubernetes mounts secrets) is
    judged by its target.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"VRF secret key {path} not found; `peerlm ca issue` writes <name>.vrf.key for "
            "agent and overlay certificates"
        ) from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"VRF secret key {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise PermissionError(
                f"VRF secret key {path} has mode {mode:04o}, readable or writable by group or "
                f"others; restrict it with `chmod 600 {path}`"
            )
        data = handle.read(VRF_SECRET_KEY_LEN + 1)
    if len(data) != VRF_SECRET_KEY_LEN:
        size = f"{len(data)} bytes" if len(data) <= VRF_SECRET_KEY_LEN else "more than 32 bytes"
        raise ValueError(
            f"VRF secret key {path} holds {size}; it must be exactly {VRF_SECRET_KEY_LEN} bytes"
        )
    return data
