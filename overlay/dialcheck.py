"""Dial only addresses bound to a certified identity.

Addresses of other nodes reach a node through protocol messages (peer exchange, joins,
candidates) from any member, so an address is a claim. Before a :class:`PeerPool` sends
anything to ``(node_id, address)`` it opens one TLS connection to the address with the
node's own client certificate, reads the server's certificate after the handshake, and
requires that it chains to the federation CA and names ``node_id`` (role agent or
overlay, this federation). grpc.aio does not expose the server's certificate to a client,
so the check is a separate handshake through :mod:`ssl` (standard library); it runs once
per (node, address) and is cached while the pool keeps the destination.

What it does not close: a process that takes over the port after the check (the verified
node went away and another member bound the port) is dialled by gRPC, which only checks
that the certificate is a federation member's with the address as a SAN; such a member
receives messages addressed to another node, which it must refuse (``wrong_recipient``).
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections.abc import Awaitable, Callable

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from peerlm.config import parse_host_port
from peerlm.pki.identity import Role, identity_from_certificate_pem
from peerlm.security.credentials import TlsFiles

__all__ = ["AddressCheck", "AddressVerifier", "CertifiedAddressVerifier"]


class AddressCheck(enum.Enum):
    """The outcome of checking one (node, address) claim."""

    CERTIFIED = "certified"
    """The server at the address holds ``node_id``'s certificate."""
    MISMATCH = "mismatch"
    """Something answered, but not with ``node_id``'s certificate: never dial it."""
    UNREACHABLE = "unreachable"
    """Nothing to check yet (refused, timed out): may be retried like a failed delivery."""


AddressVerifier = Callable[[str, str], Awaitable[AddressCheck]]

_NODE_ROLES = frozenset({Role.AGENT, Role.OVERLAY})


class CertifiedAddressVerifier:
    """Checks that the server at ``address`` presents ``node_id``'s certificate."""

    def __init__(self, tls: TlsFiles, federation: str, timeout_s: float = 5.0) -> None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca_cert))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        context.set_alpn_protocols(["h2"])  # what a gRPC server expects to negotiate
        self._context = context
        self._federation = federation
        self._timeout_s = timeout_s

    async def __call__(self, node_id: str, address: str) -> AddressCheck:
        """CERTIFIED, MISMATCH or UNREACHABLE for the claim "``node_id`` is at ``address``"."""
        try:
            host, port = parse_host_port(address)
        except ValueError:
            return AddressCheck.MISMATCH
        try:
            async with asyncio.timeout(self._timeout_s):
                _reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._context, server_hostname=host.strip("[]")
                )
        except ssl.SSLError:
            return AddressCheck.MISMATCH  # not our CA, or not a SAN for this address
        except (OSError, TimeoutError):
            return AddressCheck.UNREACHABLE
        try:
            tls = writer.get_extra_info("ssl_object")
            der = tls.getpeercert(binary_form=True) if tls is not None else None
        finally:
            writer.close()
        if not der:
            return AddressCheck.MISMATCH
        pem = x509.load_der_x509_certificate(der).public_bytes(Encoding.PEM)
        try:
            identity = identity_from_certificate_pem(pem)
        except ValueError:
            return AddressCheck.MISMATCH
        certified = (
            identity.name == node_id
            and identity.role in _NODE_ROLES
            and identity.federation == self._federation
        )
        return AddressCheck.CERTIFIED if certified else AddressCheck.MISMATCH
