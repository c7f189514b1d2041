"""Node contexts for tests: a process's identity and connections from a test PKI kit."""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog
from prometheus_client import CollectorRegistry

from peerlm.config import GrpcLimits
from peerlm.metrics import new_registry
from peerlm.node import NodeContext
from peerlm.pki.identity import PeerIdentity, Role
from peerlm.pki.proof import SenderCheck
from peerlm.security.credentials import TlsFiles
from peerlm.security.mode import SecurityMode


def kit_context(
    pki: Path,
    name: str,
    *,
    component: str = "agent",
    role: Role = Role.AGENT,
    limits: GrpcLimits | None = None,
    registry: CollectorRegistry | None = None,
    listen: str | None = None,
) -> NodeContext:
    """The mTLS context of member ``name`` of the CA directory ``pki``."""
    return NodeContext.create(
        component=component,
        role=role,
        federation="unused-with-a-certificate",
        tls=TlsFiles.from_directory(pki, name),
        insecure_dev=False,
        limits=limits or GrpcLimits(),
        log=structlog.get_logger("test"),
        registry=registry,
        listen=listen,
    )


def dev_context(
    federation: str,
    name: str,
    *,
    role: Role = Role.AGENT,
    limits: GrpcLimits | None = None,
    registry: CollectorRegistry | None = None,
) -> NodeContext:
    """An insecure-dev context (no certificate) naming itself ``name``."""
    return NodeContext.create(
        component=role.value,
        role=role,
        federation=federation,
        tls=None,
        insecure_dev=True,
        limits=limits or GrpcLimits(),
        log=structlog.get_logger("test"),
        registry=registry,
        dev_name=name,
    )


def credentials_context(
    credentials: grpc.ChannelCredentials,
    identity: PeerIdentity,
    *,
    limits: GrpcLimits | None = None,
    registry: CollectorRegistry | None = None,
    sender_check: SenderCheck | None = None,
) -> NodeContext:
    """A context presenting hand-made ``credentials`` (e.g. a certificate of a foreign CA,
    which :meth:`NodeContext.create` would refuse to load) under ``identity``, checking
    sender proofs with ``sender_check`` only."""
    return NodeContext(
        component=identity.role.value,
        identity=identity,
        mode=SecurityMode.MTLS,
        tls=None,
        limits=limits or GrpcLimits(),
        registry=registry if registry is not None else new_registry(),
        log=structlog.get_logger("test"),
        credentials=credentials,
        sender_check=sender_check,
    )
