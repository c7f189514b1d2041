"""OverlaySettings: protocol overrides are OverlayParams fields; bootstrap entries are checked."""

from __future__ import annotations

import dataclasses

import pytest
from peerlm.overlay.main import parse_bootstrap
from peerlm.overlay.params import OverlayParams

from peerlm.config import ConfigError, OverlayProtocolSettings, OverlaySettings, load_settings


def test_every_protocol_override_is_an_overlay_parameter() -> None:
    names = {f.name for f in dataclasses.fields(OverlayParams)}
    assert set(OverlayProtocolSettings.model_fields) <= names


def test_overrides_reach_the_parameters() -> None:
    settings = load_settings(
        OverlaySettings,
        None,
        {"protocol.zone_cap": 4, "protocol.lease_duration": 2.5, "protocol.genesis_time": 10.0},
    )
    params = OverlayParams(**settings.protocol.overrides())
    assert (params.zone_cap, params.lease_duration, params.genesis_time) == (4, 2.5, 10.0)
    assert params.replication == OverlayParams().replication


def test_inconsistent_overrides_fail_in_the_parameters() -> None:
    settings = load_settings(
        OverlaySettings, None, {"protocol.heartbeat_interval": 3.0, "protocol.lease_duration": 2.0}
    )
    with pytest.raises(ValueError, match="lease_duration > heartbeat_interval"):
        OverlayParams(**settings.protocol.overrides())


@pytest.mark.parametrize("entry", ["no-port", "bad name@127.0.0.1:1", "n0@127.0.0.1:99999", "@:1"])
def test_bad_bootstrap_entries_are_refused(entry: str) -> None:
    with pytest.raises(ConfigError):
        load_settings(OverlaySettings, None, {"bootstrap": (entry,)})


def test_bootstrap_entries_parse() -> None:
    settings = load_settings(OverlaySettings, None, {"bootstrap": ("n0@127.0.0.1:5", "[::1]:6")})
    assert parse_bootstrap(settings.bootstrap) == [("n0", "127.0.0.1:5"), (None, "[::1]:6")]
    # A node's own address is dropped, so one list serves the first node too.
    assert parse_bootstrap(settings.bootstrap, "[::1]:6") == [("n0", "127.0.0.1:5")]


def test_name_must_be_a_certificate_name() -> None:
    with pytest.raises(ConfigError):
        load_settings(OverlaySettings, None, {"name": "../x"})
