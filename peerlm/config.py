"""Configuration: pydantic-settings models loaded from YAML, environment and CLI flags.

Precedence, highest first: CLI flags (passed as ``overrides``), environment variables
(``PEERLM_<COMPONENT>_...``, nested fields joined by ``__``), the YAML file, defaults.
Invalid configuration fails fast with :class:`ConfigError`, whose message names every bad
field in one readable list.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

__all__ = [
    "ConfigError",
    "GrpcLimits",
    "LogFormat",
    "MiB",
    "Section",
    "ServiceSettings",
    "TlsSettings",
    "explicit_settings",
    "load_settings",
    "parse_host_port",
]

LogFormat = Literal["auto", "json", "console"]
MiB = 1024 * 1024


class ConfigError(ValueError):
    """The effective configuration is invalid; the message is meant for a person."""


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and validate the port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.removeprefix("[").removesuffix("]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port in {value!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} in {value!r} is out of range 0..65535")
    return host, port


class Section(BaseModel):
    """A frozen configuration section that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsSettings(Section):
    """Paths of the federation CA certificate and this process's certificate and key."""

    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None


class GrpcLimits(Section):
    """Every gRPC limit in one place. The reasons for each default live in peerlm.rpc."""

    max_message_bytes: int = Field(default=4 * MiB, ge=64 * 1024, le=64 * MiB)
    chunk_bytes: int = Field(default=1 * MiB, ge=16 * 1024, le=16 * MiB)
    max_concurrent_rpcs: int = Field(default=1024, ge=1)
    max_concurrent_streams: int = Field(default=256, ge=1)
    # Calls (unary or streaming) one identity may have in flight on a server: a member (or
    # an admin) cannot hold more than this of max_concurrent_rpcs, so one member's flood
    # leaves the others served. An agent needs 2 on the CPM (its feed and one call).
    max_calls_per_identity: int = Field(default=64, ge=1)
    keepalive_time_s: float = Field(default=30.0, gt=0)
    keepalive_timeout_s: float = Field(default=10.0, gt=0)
    min_ping_interval_s: float = Field(default=10.0, gt=0)
    rpc_timeout_s: float = Field(default=30.0, gt=0)
    shutdown_grace_s: float = Field(default=5.0, ge=0)


class ServiceSettings(BaseSettings):
    """Settings every gRPC process shares."""

    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__")

    federation: str = "peerlm"
    listen: str = "127.0.0.1:50051"
    insecure_dev: bool = False
    tls: TlsSettings = TlsSettings()
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    log_format: LogFormat = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: GrpcLimits = GrpcLimits()

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, v: str) -> str:
        parse_host_port(v)
        return v


S = TypeVar("S", bound=BaseSettings)
SS = TypeVar("SS", bound="ServiceSettings")


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  - {where}: {err['msg']}")
    return "\n".join(lines)


def explicit_settings(cls: type[S], values: Mapping[str, Any] | None = None) -> S:
    """``cls`` from ``values`` and its defaults alone: no environment variable, dotenv or
    secrets file is read (pydantic-settings reads them even in ``model_validate``). For a
    harness whose results must not depend on the shell it runs in (``run-experiment``).
    Raises pydantic's ``ValidationError`` for invalid values."""

    class Given(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls, settings_cls: Any, init_settings: Any, **_sources: Any
        ) -> Any:
            return (init_settings,)

    Given.__name__ = Given.__qualname__ = cls.__name__
    return Given(**dict(values or {}))


def load_settings(
    cls: type[S],
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build ``cls`` from YAML < environment < ``overrides`` (``None`` values are ignored).

    ``overrides`` keys may be dotted (``"tls.cert"``) to reach nested sections.
    """
    layered: dict[str, Any] = _read_yaml(config_file) if config_file else {}
    try:
        env_values = EnvSettingsSource(cls)()
    except Exception as exc:  # pydantic-settings raises SettingsError on bad env JSON
        raise ConfigError(f"invalid environment variable: {exc}") from None
    layered = _deep_merge(layered, env_values)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node: dict[str, Any] = {}
        cursor = node
        parts = dotted.split(".")
        for part in parts[:-1]:
            cursor[part] = {}
            cursor = cursor[part]
        cursor[parts[-1]] = value
        layered = _deep_merge(layered, node)
    origin = str(config_file) if config_file else "defaults, environment and flags"
    try:
        # model_validate skips BaseSettings' own source loading: the layering above is the
        # single place precedence is decided.
        settings = cls.model_validate(layered)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
    if isinstance(settings, ServiceSettings):
        settings = _federation_from_certificate(settings, origin)
    return settings


def _federation_from_certificate(settings: SS, origin: str) -> SS:
    """A process belongs to the federation its certificate names.

    Unset, ``federation`` is taken from the certificate (so ``peerlm cpm --cert ...`` works
    for a CA made with ``ca init --federation acme``); set and different, the process would
    refuse every peer of its own federation, so loading fails with both names instead. An
    unreadable certificate is left to the security check, which explains it.
    """
    cert = settings.tls.cert
    if cert is None or settings.insecure_dev:
        return settings
    from peerlm.pki.identity import identity_from_certificate_pem

    try:
        federation = identity_from_certificate_pem(cert.read_bytes()).federation
    except (OSError, ValueError):
        return settings
    if "federation" not in settings.model_fields_set:
        return settings.model_copy(update={"federation": federation})
    if settings.federation != federation:
        raise ConfigError(
            f"federation {settings.federation!r} (from {origin}) differs from the federation "
            f"{federation!r} of the certificate {cert}; drop the setting (the certificate "
            "decides) or use a certificate of that federation"
        )
    return settings
