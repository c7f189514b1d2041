"""Transport security: the security-mode decision, mTLS credentials and authorisation."""

from peerlm.security.authz import (
    DEV_IDENTITY_METADATA_KEY,
    HEALTH_AND_REFLECTION_METHODS,
    AuthInterceptor,
    TlsFailureCounter,
    TlsFailureInterceptor,
    current_identity,
    describe_rpc_error,
    dev_identity_metadata,
    use_identity,
)
from peerlm.security.credentials import TlsFiles, channel_credentials, server_credentials
from peerlm.security.mode import (
    SecurityConfigError,
    SecurityMode,
    is_loopback,
    is_loopback_target,
    resolve_channel_security,
    resolve_security,
)

__all__ = [
    "DEV_IDENTITY_METADATA_KEY",
    "HEALTH_AND_REFLECTION_METHODS",
    "AuthInterceptor",
    "SecurityConfigError",
    "SecurityMode",
    "TlsFailureCounter",
    "TlsFailureInterceptor",
    "TlsFiles",
    "channel_credentials",
    "current_identity",
    "describe_rpc_error",
    "dev_identity_metadata",
    "is_loopback",
    "is_loopback_target",
    "resolve_channel_security",
    "resolve_security",
    "server_credentials",
    "use_identity",
]
