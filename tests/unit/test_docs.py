"""The docs stay true: every config field and every metric is documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from peerlm.agent import AgentSettings
from peerlm.overlay import OverlayParams, OverlaySettings
from peerlm.services.cpm import CpmSettings

from peerlm.config import GrpcLimits

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_is_documented() -> None:
    doc = (ROOT / "docs/configuration.md").read_text()
    for name in CpmSettings.model_fields:
        if name in ("tls", "limits"):
            continue
        assert f"`{name}`" in doc, name
    for name in AgentSettings.model_fields:
        if name in ("tls", "limits"):
            continue
        assert f"`{name}`" in doc, name
    for name in GrpcLimits.model_fields:
        assert f"`limits.{name}`" in doc, name
    for name in OverlaySettings.model_fields:
        if name in ("tls", "limits", "protocol"):
            continue
        assert f"`{name}`" in doc, name
    for field in dataclasses.fields(OverlayParams):
        assert f"`protocol.{field.name}`" in doc, field.name


def test_every_metric_is_catalogued() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    names: set[str] = set()
    for path in [
        *ROOT.glob("peerlm/**/*.py"),
        *ROOT.glob("services/**/*.py"),
        *ROOT.glob("agent/**/*.py"),
        *ROOT.glob("overlay/**/*.py"),
    ]:
        names |= set(
            re.findall(
                r'"(peerlm_[a-z_]+_(?:total|seconds|count|ratio|zscore|bytes))"', path.read_text()
            )
        )
    assert names
    for name in sorted(names):
        assert f"`{name}`" in doc, name
