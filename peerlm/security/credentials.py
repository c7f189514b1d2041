"""mTLS credentials for gRPC servers and channels, built from a federation kit.

Every process is both a server and a client, and uses one kit for both roles: the federation
CA certificate, its own certificate and its own private key. Servers *require* and verify a
client certificate; the TLS stack (BoringSSL inside gRPC core) checks the chain and expiry
during the handshake, before any Python code runs. What the certificate *says* (role, name)
is checked afterwards by :class:`peerlm.security.authz.AuthInterceptor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from peerlm.config import TlsSettings

if TYPE_CHECKING:
    from peerlm.security.mode import SecurityMode

__all__ = ["TlsBundle", "TlsFiles", "channel_credentials", "server_credentials"]

_FIX = "issue one with `peerlm ca issue --dir <ca-dir> --role <role> --name <name>`"


@dataclass(frozen=True)
class TlsBundle:
    """The PEM bytes of a kit, checked to be consistent (see :meth:`TlsFiles.load`)."""

    ca_cert: bytes
    cert: bytes
    key: bytes
    certificate: x509.Certificate


def _read(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found; {_FIX}")
    try:
        return path.read_bytes()
    except PermissionError as err:
        raise PermissionError(f"cannot read {what} {path}: {err.strerror}") from None


def _parse_certificate(data: bytes, path: Path, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as err:
        raise ValueError(f"{what} {path} is not a PEM certificate ({err}); {_FIX}") from None


def _parse_key(data: bytes, path: Path) -> PrivateKeyTypes:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"private key {path} is not an unencrypted PEM private key ({err}); {_FIX}"
        ) from None


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a federation kit: the CA certificate, our certificate and our key."""

    ca_cert: Path
    cert: Path
    key: Path

    @classmethod
    def from_directory(cls, directory: Path, name: str) -> TlsFiles:
        """The kit for ``name`` in a CA-style directory (``ca.crt``, ``<name>.crt/.key``)."""
        return cls(
            ca_cert=directory / "ca.crt",
            cert=directory / f"{name}.crt",
            key=directory / f"{name}.key",
        )

    def load(self) -> TlsBundle:
        """Read and check the three files.

        Raises ``FileNotFoundError`` naming a missing file, and ``ValueError`` when a file
        does not parse, the key does not belong to the certificate, or the certificate was
        not issued by the CA (so such mistakes surface at start-up with the file's name, not
        later as an anonymous handshake failure on the other side). Expiry is *not* checked
        here; the peer's TLS stack is the authority on time.
        """
        ca_pem = _read(self.ca_cert, "CA certificate")
        cert_pem = _read(self.cert, "certificate")
        key_pem = _read(self.key, "private key")
        ca = _parse_certificate(ca_pem, self.ca_cert, "CA certificate")
        cert = _parse_certificate(cert_pem, self.cert, "certificate")
        key = _parse_key(key_pem, self.key)
        if key.public_key() != cert.public_key():
            raise ValueError(
                f"private key {self.key} does not belong to certificate {self.cert}; "
                "use the .key file issued together with that .crt"
            )
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            raise ValueError(
                f"certificate {self.cert} was not issued by the CA in {self.ca_cert}; "
                "use the federation's ca.crt or reissue the certificate from that CA"
            ) from None
        return TlsBundle(ca_cert=ca_pem, cert=cert_pem, key=key_pem, certificate=cert)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate issued by the federation CA."""
    bundle = tls.load()
    return grpc.ssl_server_credentials(
        [(bundle.key, bundle.cert)],
        root_certificates=bundle.ca_cert,
        # Without this the server would accept anonymous TLS clients; identity is the
        # certificate, so a connection without one has no business here.
        require_client_auth=True,
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Channel credentials presenting our certificate and trusting only the federation CA.

    gRPC also checks the server certificate's DNS/IP SANs against the target host, so a
    server's certificate must list the names/addresses peers dial it by (``--san``).
    """
    bundle = tls.load()
    return grpc.ssl_channel_credentials(
        root_certificates=bundle.ca_cert,
        private_key=bundle.key,
        certificate_chain=bundle.cert,
    )


def tls_files_from_settings(tls: TlsSettings) -> TlsFiles | None:
    """The kit named in a process's ``tls`` settings; None when none of it is set.

    A partial kit is an error, never a reason to fall back to plaintext.
    """
    missing = [n for n in ("ca_cert", "cert", "key") if getattr(tls, n) is None]
    if len(missing) == 3:
        return None
    if missing:
        from peerlm.security.mode import SecurityConfigError

        raise SecurityConfigError(f"TLS settings incomplete: missing {', '.join(missing)}")
    assert tls.ca_cert is not None and tls.cert is not None and tls.key is not None
    return TlsFiles(ca_cert=tls.ca_cert, cert=tls.cert, key=tls.key)


def bind_server(
    server: grpc.aio.Server, listen: str, mode: SecurityMode, tls: TlsFiles | None
) -> int:
    """Bind ``server`` to ``listen`` in the mode :func:`resolve_security` decided; returns
    the bound port. Plaintext only in INSECURE_DEV, which that decision allows on loopback
    alone; mTLS without a kit is an error, never a fallback."""
    from peerlm.config import parse_host_port
    from peerlm.security.mode import SecurityConfigError, SecurityMode, is_loopback

    host, port = parse_host_port(listen)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if mode is SecurityMode.MTLS:
        if tls is None:
            raise SecurityConfigError("mTLS was decided but no TLS files were given")
        bound = server.add_secure_port(address, server_credentials(tls))
    else:
        # resolve_security only decides INSECURE_DEV for loopback; checked again here, where
        # the plaintext port is opened, so no other path can reach it.
        if mode is not SecurityMode.INSECURE_DEV or not is_loopback(host):
            raise SecurityConfigError(
                f"plaintext refused for {listen!r}: not insecure-dev loopback"
            )
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {listen}")
    return bound
