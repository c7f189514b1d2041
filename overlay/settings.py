"""A dedicated overlay node's settings (``peerlm overlay-node``).

``protocol`` is :class:`~peerlm.overlay.params.OverlayParams` itself, validated by its own
checks; its ``genesis_seed`` (bytes) is written and read as hex.
"""

from __future__ import annotations

from pathlib import Path

from peerlm.overlay.params import OverlayParams
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from peerlm.config import ServiceSettings, parse_host_port
from peerlm.pki.identity import validate_name

__all__ = ["OverlaySettings"]


class OverlaySettings(ServiceSettings):
    """A dedicated overlay node (``peerlm overlay-node``). ``listen`` serves the overlay."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix="PEERLM_OVERLAY_",
        env_nested_delimiter="__",
        ser_json_bytes="hex",
        val_json_bytes="hex",
    )

    listen: str = "127.0.0.1:50071"
    advertise: str | None = None
    name: str | None = None
    bootstrap: tuple[str, ...] = ()
    vrf_key: Path | None = None
    signature_file: Path | None = None
    seed: int | None = None
    protocol: OverlayParams = OverlayParams()
    # Delivery to other nodes (peerlm.overlay.transport.DeliveryPolicy).
    max_peers: int = Field(default=256, ge=1, le=65536)
    send_queue_depth: int = Field(default=1024, ge=1)
    max_batch: int = Field(default=64, ge=1, le=4096)
    deliver_timeout_s: float = Field(default=2.0, gt=0)
    deliver_retries: int = Field(default=3, ge=0, le=20)
    retry_backoff_s: float = Field(default=0.05, gt=0)
    send_max_age_s: float = Field(default=5.0, gt=0)
    # Incoming bounds and bookkeeping.
    max_receive_batch: int = Field(default=256, ge=1, le=65536)
    key_cache: int = Field(default=4096, ge=16)
    event_queue_depth: int = Field(default=1024, ge=1)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    bootstrap_retry_s: float = Field(default=1.0, gt=0)
    leave_grace_s: float = Field(default=2.0, ge=0)

    @field_validator("advertise")
    @classmethod
    def _advertise_is_host_port(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)
        return v

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap_entries(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for entry in v:
            name, _, target = entry.rpartition("@")
            if name:
                validate_name(name)
            parse_host_port(target)
        return v

    @field_validator("name")
    @classmethod
    def _name_is_certificate_name(cls, v: str | None) -> str | None:
        if v is not None:
            validate_name(v)
        return v
