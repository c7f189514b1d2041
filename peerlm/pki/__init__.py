"""Federation PKI: identities (SPIFFE IDs in certificates) and the federation CA."""

from peerlm.pki.ca import (
    CaFiles,
    CertificateInfo,
    IssuedFiles,
    KeyType,
    LoadedCa,
    init_ca,
    inspect_certificate,
    issue_certificate,
    load_ca,
)
from peerlm.pki.identity import (
    PeerIdentity,
    Role,
    identity_from_certificate,
    identity_from_certificate_pem,
    parse_spiffe_uri,
)

__all__ = [
    "CaFiles",
    "CertificateInfo",
    "IssuedFiles",
    "KeyType",
    "LoadedCa",
    "PeerIdentity",
    "Role",
    "identity_from_certificate",
    "identity_from_certificate_pem",
    "init_ca",
    "inspect_certificate",
    "issue_certificate",
    "load_ca",
    "parse_spiffe_uri",
]
