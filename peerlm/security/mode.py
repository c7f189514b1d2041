"""The one place that decides whether a server or channel runs mTLS or insecure-dev.

Rules (design principle 2, "no silent fallback to plaintext"):

* mTLS is the default and needs all three kit files (CA certificate, certificate, key) to
  exist and load; anything missing is a :class:`SecurityConfigError` naming the piece.
* insecure-dev must be asked for explicitly and is allowed only on loopback (a listen host
  in 127.0.0.0/8, ``::1`` or ``localhost``; a channel target on such a host or a Unix
  socket). It is logged as a loud warning every time it is chosen.

Every component calls :func:`resolve_security` (servers) or :func:`resolve_channel_security`
(clients) and nothing else decides the mode, so the log line ``security_mode`` is the
complete record of what is in force.
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

from peerlm.pki.identity import identity_from_certificate
from peerlm.security.credentials import TlsFiles

__all__ = [
    "SecurityConfigError",
    "SecurityLogger",
    "SecurityMode",
    "is_loopback",
    "is_loopback_target",
    "resolve_channel_security",
    "resolve_security",
    "target_host",
]

# A certificate this close to expiry is still used but reported, so operators reissue in time.
_EXPIRY_WARNING = timedelta(days=14)


class SecurityMode(StrEnum):
    """How a server or channel is secured."""

    MTLS = "mtls"
    INSECURE_DEV = "insecure-dev"


class SecurityConfigError(ValueError):
    """The requested security configuration is unsafe or incomplete; the message says why."""


class SecurityLogger(Protocol):
    """The part of a structlog bound logger this module uses."""

    def info(self, event: str, /, **kw: Any) -> Any: ...

    def warning(self, event: str, /, **kw: Any) -> Any: ...


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen host or a dialled host) is certainly this machine only.

    True for ``localhost``, 127.0.0.0/8, ``::1`` and IPv4-mapped loopback; false for
    wildcard addresses (``0.0.0.0``, ``::``, empty), other names and anything unparsable.
    """
    text = host.strip().lower().rstrip(".")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text == "localhost":
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _split_host(hostport: str) -> str:
    if hostport.startswith("["):
        end = hostport.find("]")
        return hostport[1:end] if end != -1 else hostport
    if hostport.count(":") == 1:
        return hostport.split(":", 1)[0]
    # No port, or a bare IPv6 address (several colons, no brackets).
    return hostport


def target_host(target: str) -> list[str]:
    """The host(s) a gRPC target string dials, e.g. ``dns:///h:1`` -> ``["h"]``.

    ``ipv4:``/``ipv6:`` targets may list several comma-separated addresses; all are
    returned. A Unix socket target returns ``[]`` (there is no host).
    """
    text = target.strip()
    lowered = text.lower()
    if lowered.startswith(("unix:", "unix-abstract:")):
        return []
    if lowered.startswith("dns:"):
        rest = text[4:]
        if rest.startswith("//"):
            # dns://[authority]/host:port -- the authority is the DNS server, not the target.
            rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
        return [_split_host(rest)]
    if lowered.startswith(("ipv4:", "ipv6:")):
        return [_split_host(part) for part in text[5:].split(",") if part]
    return [_split_host(text)]


def is_loopback_target(target: str) -> bool:
    """Whether a gRPC channel target only reaches this machine (loopback or Unix socket)."""
    lowered = target.strip().lower()
    if lowered.startswith(("unix:", "unix-abstract:")):
        return True
    hosts = target_host(target)
    return bool(hosts) and all(is_loopback(h) for h in hosts)


def _check_tls(tls: TlsFiles | None, *, component: str, logger: SecurityLogger) -> str:
    """Load the kit or raise :class:`SecurityConfigError`; return our SPIFFE ID."""
    if tls is None:
        raise SecurityConfigError(
            f"{component}: mTLS needs a CA certificate, a certificate and a key, and none were "
            "configured; pass --ca-cert/--cert/--key (create them with `peerlm ca`), or "
            "--insecure-dev on a loopback address for local development"
        )
    for path, what in (
        (tls.ca_cert, "CA certificate"),
        (tls.cert, "certificate"),
        (tls.key, "key"),
    ):
        if not path.is_file():
            raise SecurityConfigError(
                f"{component}: {what} file {path} does not exist; mTLS cannot start without it "
                "(issue kits with `peerlm ca init` / `peerlm ca issue`)"
            )
    try:
        bundle = tls.load()
        identity = identity_from_certificate(bundle.certificate)
    except (OSError, ValueError) as err:
        raise SecurityConfigError(f"{component}: {err}") from None
    expires = bundle.certificate.not_valid_after_utc
    now = datetime.now(UTC)
    if expires <= now + _EXPIRY_WARNING:
        logger.warning(
            "certificate_expiry",
            component=component,
            cert=str(tls.cert),
            not_valid_after=expires.isoformat(),
            expired=expires <= now,
            fix="reissue with `peerlm ca issue`",
        )
    return identity.spiffe_uri


def _refuse_mixed(tls: TlsFiles | None, component: str) -> None:
    if tls is not None:
        # Two contradictory instructions; guessing either way could surprise the operator.
        raise SecurityConfigError(
            f"{component}: insecure-dev was requested but TLS files are configured too; "
            "drop --insecure-dev to use mTLS, or drop the TLS files"
        )


def resolve_security(
    *,
    insecure_dev: bool,
    listen_host: str,
    tls: TlsFiles | None,
    component: str,
    logger: SecurityLogger,
) -> SecurityMode:
    """Decide and log the security mode of a server listening on ``listen_host``.

    Raises :class:`SecurityConfigError` if insecure-dev is asked for on a non-loopback host,
    if it is combined with TLS files, or if mTLS is chosen and a kit file is missing or bad.
    """
    return _decide(
        insecure_dev=insecure_dev,
        local=is_loopback(listen_host),
        where={"listen_host": listen_host},
        refusal=(
            f"{component}: --insecure-dev is only allowed on a loopback address "
            f"(127.0.0.1, ::1, localhost), not on {listen_host!r}; use mTLS to listen there"
        ),
        tls=tls,
        component=component,
        logger=logger,
    )


def resolve_channel_security(
    *,
    insecure_dev: bool,
    target: str,
    tls: TlsFiles | None,
    component: str,
    logger: SecurityLogger,
) -> SecurityMode:
    """Decide and log the security mode of a client channel to ``target``.

    The same rules as :func:`resolve_security`: insecure-dev only to a loopback target or a
    Unix socket, otherwise mTLS with a complete kit.
    """
    return _decide(
        insecure_dev=insecure_dev,
        local=is_loopback_target(target),
        where={"target": target},
        refusal=(
            f"{component}: --insecure-dev may only dial loopback targets "
            f"(127.0.0.1, ::1, localhost, unix:), not {target!r}; use mTLS for it"
        ),
        tls=tls,
        component=component,
        logger=logger,
    )


def _decide(
    *,
    insecure_dev: bool,
    local: bool,
    where: dict[str, str],
    refusal: str,
    tls: TlsFiles | None,
    component: str,
    logger: SecurityLogger,
) -> SecurityMode:
    """The single decision: insecure-dev only when local and without TLS files, else mTLS
    with a complete, valid kit. Logs the mode in force."""
    if insecure_dev:
        _refuse_mixed(tls, component)
        if not local:
            raise SecurityConfigError(refusal)
        logger.warning(
            "security_mode",
            component=component,
            security_mode=SecurityMode.INSECURE_DEV.value,
            warning="INSECURE: plaintext and unauthenticated; loopback development only",
            **where,
        )
        return SecurityMode.INSECURE_DEV
    spiffe_id = _check_tls(tls, component=component, logger=logger)
    logger.info(
        "security_mode",
        component=component,
        security_mode=SecurityMode.MTLS.value,
        identity=spiffe_id,
        **where,
    )
    return SecurityMode.MTLS
