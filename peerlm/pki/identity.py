"""Federation identities: who a peer is, as written in its certificate.

Principle 2 of the design: *identity is the certificate*. Every certificate the federation CA
issues carries exactly one URI SAN of the form ``spiffe://<federation>/<role>/<name>``; the
role and name a server acts on come from that URI (after the TLS stack has verified the chain)
and never from a message field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from cryptography import x509

__all__ = [
    "FEDERATION_PATTERN",
    "NAME_PATTERN",
    "PeerIdentity",
    "Role",
    "identity_from_certificate",
    "identity_from_certificate_pem",
    "parse_spiffe_uri",
    "spiffe_uris",
    "validate_federation",
    "validate_name",
]

# Names become file names (``D/<name>.crt``), so the first character may not be a dot (no
# ``.``/``..``/hidden files) and no separator can appear. 63 characters keeps a name usable
# as a DNS label too.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# A federation is a SPIFFE trust domain: the SPIFFE spec allows lowercase letters, digits,
# dots, dashes and underscores only (trust domains are compared case-sensitively).
FEDERATION_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")

_SPIFFE_SCHEME = "spiffe"


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
    """

    federation: str
    role: Role
    name: str

    def __post_init__(self) -> None:
        validate_federation(self.federation)
        # Accept a plain string that names a role (e.g. from JSON) but store the enum.
        object.__setattr__(self, "role", _parse_role(str(self.role)))
        validate_name(self.name)

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

    This does not verify the certificate chain; callers rely on the TLS handshake (or
    ``cryptography`` verification) for that.
    """
    uris = spiffe_uris(certificate)
    if not uris:
        raise ValueError("certificate has no spiffe:// URI SAN, so it names no federation peer")
    if len(uris) > 1:
        raise ValueError(f"certificate has {len(uris)} spiffe:// URI SANs; exactly one is required")
    return parse_spiffe_uri(uris[0])


def identity_from_certificate_pem(pem: bytes) -> PeerIdentity:
    """Parse a PEM certificate and return its identity (see :func:`identity_from_certificate`)."""
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError as err:
        raise ValueError(f"not a PEM X.509 certificate: {err}") from None
    return identity_from_certificate(certificate)
