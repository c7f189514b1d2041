"""A member of another CA, for the refusal tests: same federation name, same member name."""

from __future__ import annotations

from pathlib import Path

import grpc

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role


def foreign_member_credentials(
    directory: Path, federation: str, name: str, *, trust: Path | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials presenting ``name``'s certificate from a fresh CA in
    ``directory``; the server is trusted through ``trust`` (a ``ca.crt``; default the
    foreign CA itself), so the call reaches the server's certificate check."""
    init_ca(directory, federation=federation)
    issue_certificate(directory, Role.AGENT, name)
    return grpc.ssl_channel_credentials(
        root_certificates=(trust or directory / "ca.crt").read_bytes(),
        private_key=(directory / f"{name}.key").read_bytes(),
        certificate_chain=(directory / f"{name}.crt").read_bytes(),
    )
