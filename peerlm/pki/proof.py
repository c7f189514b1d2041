"""Sender proofs: who streamed these bytes, proved with the sender's federation certificate.

A student dials the endpoint a teacher advertised and gRPC checks that the server's
certificate comes from the federation CA and lists the dialled host, but grpc-python shows
a client nothing of that certificate, so the client cannot check *whose* it is: any member
whose certificate lists that host could answer. The sender therefore proves it in the
response's initial metadata: its certificate (DER) and a signature, with the certificate's
key, over a statement naming what is sent, to whom, and its SHA-256. The receiver checks
that the certificate was issued by the federation CA, is valid now, names the peer it
meant to reach, and that the signature covers exactly the bytes it received.

The statement binds the recipient, so a proof cannot be replayed to another peer, and the
digest, so it cannot be moved to other bytes; a package statement also binds the directive.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from peerlm.pki.identity import PeerIdentity, Role, identity_from_certificate

__all__ = [
    "FEED_NONCE_METADATA",
    "PROOF_CERTIFICATE_METADATA",
    "PROOF_SIGNATURE_METADATA",
    "ExpectedSender",
    "ProofError",
    "ProofSigner",
    "SenderCheck",
    "digest_statement",
    "transfer_statement",
    "verify_member_certificate",
]

#: Initial-metadata keys of a proof (``-bin``: binary values).
PROOF_CERTIFICATE_METADATA: Final = "peerlm-sender-cert-bin"
PROOF_SIGNATURE_METADATA: Final = "peerlm-sender-proof-bin"
#: Request metadata: the agent's fresh nonce, which the CPM's feed proof must cover.
FEED_NONCE_METADATA: Final = "peerlm-feed-nonce"
_DOMAIN: Final = b"peerlm-transfer-proof-v1"
#: Bounds on what a receiver parses from a peer's metadata.
_MAX_CERTIFICATE_BYTES: Final = 16 * 1024
_MAX_SIGNATURE_BYTES: Final = 512


class ProofError(ValueError):
    """A missing or invalid sender proof; ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def transfer_statement(kind: str, reference: str, recipient: str, payload: bytes) -> bytes:
    """What a sender signs: ``kind`` (``package``/``adapter``), ``reference`` (directive id
    or round), the recipient's name and the payload's SHA-256, unambiguously framed."""
    return digest_statement(kind, reference, recipient, hashlib.sha256(payload).digest())


def digest_statement(kind: str, reference: str, recipient: str, sha256: bytes) -> bytes:
    """:func:`transfer_statement` from the payload's SHA-256, for callers that hold it
    already (the sender's cached digest, the receiver's incremental one): no second pass."""
    fields = (kind, reference, recipient)
    if any("\0" in f for f in fields):
        raise ValueError("statement fields must not contain NUL")
    if len(sha256) != 32:
        raise ValueError("a SHA-256 digest has 32 bytes")
    framed = b"\0".join([_DOMAIN, *(f.encode() for f in fields)])
    return framed + b"\0" + sha256


@dataclass(frozen=True)
class ProofSigner:
    """This process's certificate and key, signing transfer statements."""

    certificate_der: bytes
    key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> ProofSigner:
        """From the PEM certificate and key of a TLS kit (see ``TlsFiles.load``)."""
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
            raise ValueError("sender proofs need an ECDSA or Ed25519 key")
        cert = x509.load_pem_x509_certificate(cert_pem)
        if cert.public_key() != key.public_key():
            raise ValueError("the key does not belong to the certificate")
        return cls(cert.public_bytes(serialization.Encoding.DER), key)

    def sign(self, statement: bytes) -> bytes:
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            return self.key.sign(statement)
        return self.key.sign(statement, ec.ECDSA(hashes.SHA256()))

    def metadata(self, statement: bytes) -> tuple[tuple[str, bytes], ...]:
        """Initial metadata carrying the proof of ``statement``."""
        return (
            (PROOF_CERTIFICATE_METADATA, self.certificate_der),
            (PROOF_SIGNATURE_METADATA, self.sign(statement)),
        )


def verify_member_certificate(
    der: bytes, ca: x509.Certificate, *, federation: str, now: datetime | None = None
) -> tuple[PeerIdentity, x509.Certificate]:
    """Parse a member certificate and check it against the federation CA and the clock.

    Raises :class:`ProofError` (reason ``bad_certificate``) when it does not parse, was not
    issued by ``ca``, is outside its validity window, or names another federation.
    """
    try:
        cert = x509.load_der_x509_certificate(der)
        cert.verify_directly_issued_by(ca)
        identity = identity_from_certificate(cert)
    except (ValueError, TypeError, InvalidSignature) as err:
        raise ProofError("bad_certificate", f"certificate is not valid: {err}") from None
    moment = now or datetime.now(UTC)
    if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
        raise ProofError("bad_certificate", "certificate is not valid now")
    if identity.federation != federation:
        raise ProofError(
            "bad_certificate",
            f"certificate is {identity.spiffe_uri}, not of federation {federation!r}",
        )
    return identity, cert


@dataclass(frozen=True)
class SenderCheck:
    """What a receiver needs to check proofs: the federation CA and name."""

    ca: x509.Certificate
    federation: str

    @classmethod
    def from_pem(cls, ca_pem: bytes, federation: str) -> SenderCheck:
        return cls(x509.load_pem_x509_certificate(ca_pem), federation)

    def verify(
        self,
        metadata: Iterable[tuple[str, Any]] | None,
        statement: bytes,
        *,
        sender: str | None,
        role: Role = Role.AGENT,
    ) -> PeerIdentity:
        """Check the proof in ``metadata`` for ``statement`` from ``sender`` (by name; None
        accepts any member of ``role``, e.g. the federation's CPM, whatever its name).

        Raises :class:`ProofError`: ``missing`` (no proof), ``bad_certificate``,
        ``wrong_sender`` (a valid member, but not the one we meant to reach) or
        ``bad_signature`` (the proof does not cover these bytes for us).
        """
        found = {k: v for k, v in (metadata or ()) if k in _KEYS}
        der, signature = found.get(PROOF_CERTIFICATE_METADATA), found.get(PROOF_SIGNATURE_METADATA)
        if not isinstance(der, bytes) or not isinstance(signature, bytes):
            raise ProofError("missing", f"{sender or role.value!r} sent no proof of its identity")
        if len(der) > _MAX_CERTIFICATE_BYTES or len(signature) > _MAX_SIGNATURE_BYTES:
            raise ProofError("bad_certificate", "proof larger than any valid one")
        identity, cert = verify_member_certificate(der, self.ca, federation=self.federation)
        if (sender is not None and identity.name != sender) or identity.role is not role:
            wanted = f"{role.value} {sender!r}" if sender is not None else f"a {role.value}"
            raise ProofError(
                "wrong_sender", f"the peer at that address is {identity.spiffe_uri}, not {wanted}"
            )
        key = cert.public_key()
        try:
            if isinstance(key, ed25519.Ed25519PublicKey):
                key.verify(signature, statement)
            elif isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, statement, ec.ECDSA(hashes.SHA256()))
            else:
                raise ProofError("bad_certificate", "certificate key cannot sign proofs")
        except InvalidSignature:
            raise ProofError(
                "bad_signature", f"{identity.name!r}'s proof does not cover what was received"
            ) from None
        return identity


@dataclass(frozen=True)
class ExpectedSender:
    """Whose proof a transfer must carry: the peer we meant to reach (``sender``; None: any
    member of ``role``) and our own name, the proof's recipient."""

    check: SenderCheck
    sender: str | None
    recipient: str
    role: Role = Role.AGENT

    def verify(self, metadata: Any, kind: str, reference: str, payload: bytes) -> PeerIdentity:
        """Check ``metadata``'s proof of ``payload`` (see :func:`transfer_statement`)."""
        return self.verify_digest(metadata, kind, reference, hashlib.sha256(payload).digest())

    def verify_digest(
        self, metadata: Any, kind: str, reference: str, sha256: bytes
    ) -> PeerIdentity:
        """Check ``metadata``'s proof of the payload whose SHA-256 is ``sha256``."""
        statement = digest_statement(kind, reference, self.recipient, sha256)
        return self.check.verify(metadata, statement, sender=self.sender, role=self.role)


_KEYS: Final = frozenset({PROOF_CERTIFICATE_METADATA, PROOF_SIGNATURE_METADATA})
