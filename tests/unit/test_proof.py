"""Sender proofs (peerlm.pki.proof): what passes and every way a proof can fail."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.pki.proof import (
    PROOF_CERTIFICATE_METADATA,
    PROOF_SIGNATURE_METADATA,
    ProofError,
    ProofSigner,
    SenderCheck,
    digest_statement,
    transfer_statement,
    verify_member_certificate,
)

PAYLOAD = b"package bytes" * 50


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root, foreign = tmp_path_factory.mktemp("ca"), tmp_path_factory.mktemp("foreign")
    init_ca(root, federation="acme")
    init_ca(foreign, federation="acme")
    for name in ("teacher", "student"):
        issue_certificate(root, Role.AGENT, name)
    issue_certificate(root, Role.OVERLAY, "sp0")
    issue_certificate(foreign, Role.AGENT, "teacher")
    return root, foreign


def _signer(directory: Path, name: str) -> ProofSigner:
    pem = (directory / f"{name}.crt").read_bytes()
    return ProofSigner.from_pem(pem, (directory / f"{name}.key").read_bytes())


def _check(root: Path, federation: str = "acme") -> SenderCheck:
    return SenderCheck.from_pem((root / "ca.crt").read_bytes(), federation)


def _statement(recipient: str = "student", payload: bytes = PAYLOAD) -> bytes:
    return transfer_statement("package", "d" * 32, recipient, payload)


def _reason(check: SenderCheck, metadata: object, statement: bytes, sender: str) -> str:
    with pytest.raises(ProofError) as err:
        check.verify(metadata, statement, sender=sender)  # type: ignore[arg-type]
    return err.value.reason


def test_a_valid_proof_names_the_sender(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    metadata = _signer(root, "teacher").metadata(_statement())
    identity = _check(root).verify(metadata, _statement(), sender="teacher")
    assert (identity.name, identity.role, identity.federation) == ("teacher", Role.AGENT, "acme")


def test_every_failure_has_its_reason(pki: tuple[Path, Path]) -> None:
    root, foreign = pki
    check = _check(root)
    good = _signer(root, "teacher").metadata(_statement())
    assert _reason(check, (), _statement(), "teacher") == "missing"
    assert _reason(check, None, _statement(), "teacher") == "missing"
    assert _reason(check, good[:1], _statement(), "teacher") == "missing"
    # Another member of the federation answered.
    assert _reason(check, good, _statement(), "someone-else") == "wrong_sender"
    # A member of the right name but another role.
    overlay = _signer(root, "sp0").metadata(_statement())
    assert _reason(check, overlay, _statement(), "sp0") == "wrong_sender"
    # Other bytes, or a proof made out to another recipient (replayed to us).
    assert _reason(check, good, _statement(payload=b"other"), "teacher") == "bad_signature"
    assert _reason(check, good, _statement(recipient="mallory"), "teacher") == "bad_signature"
    # A certificate of another CA with the right name; garbage; another federation.
    forged = _signer(foreign, "teacher").metadata(_statement())
    assert _reason(check, forged, _statement(), "teacher") == "bad_certificate"
    garbage = ((PROOF_CERTIFICATE_METADATA, b"\x30\x03junk"), (PROOF_SIGNATURE_METADATA, b"x"))
    assert _reason(check, garbage, _statement(), "teacher") == "bad_certificate"
    assert _reason(_check(root, "other"), good, _statement(), "teacher") == "bad_certificate"
    huge = ((PROOF_CERTIFICATE_METADATA, b"\x00" * 20_000), good[1])
    assert _reason(check, huge, _statement(), "teacher") == "bad_certificate"
    # A string where bytes belong (a non -bin key would carry text).
    text = ((PROOF_CERTIFICATE_METADATA, "pem"), good[1])
    assert _reason(check, text, _statement(), "teacher") == "missing"


def test_statements_are_framed_and_expiry_counts(pki: tuple[Path, Path]) -> None:
    root, _ = pki
    assert transfer_statement("a", "bc", "d", b"") != transfer_statement("ab", "c", "d", b"")
    with pytest.raises(ValueError, match="NUL"):
        transfer_statement("package", "x\0y", "student", b"")
    der = _signer(root, "teacher").certificate_der
    ca = _check(root).ca
    later = datetime.now(UTC) + timedelta(days=400)  # `ca issue` defaults to 365 days
    with pytest.raises(ProofError, match="not valid now"):
        verify_member_certificate(der, ca, federation="acme", now=later)
    with pytest.raises(ValueError, match="does not belong"):
        ProofSigner.from_pem(
            (root / "teacher.crt").read_bytes(), (root / "student.key").read_bytes()
        )


def test_digest_statement_is_the_transfer_statement() -> None:
    payload = b"adapter bytes"
    digest = hashlib.sha256(payload).digest()
    assert digest_statement("adapter", "3", "bob", digest) == transfer_statement(
        "adapter", "3", "bob", payload
    )
    with pytest.raises(ValueError, match="32 bytes"):
        digest_statement("adapter", "3", "bob", digest[:16])
