"""OverlaySettings: the protocol section is OverlayParams itself; bootstrap entries are checked."""

from __future__ import annotations

import dataclasses

import pytest
from peerlm.overlay import OverlaySettings
from peerlm.overlay.main import parse_bootstrap
from peerlm.overlay.params import OverlayParams

from peerlm.config import ConfigError, load_settings


def test_the_protocol_section_is_the_overlay_parameters() -> None:
    # One definition of every knob: the settings embed OverlayParams, not a copy of it.
    assert OverlaySettings.model_fields["protocol"].annotation is OverlayParams
    assert load_settings(OverlaySettings).protocol == OverlayParams()


def test_every_parameter_is_configurable_and_round_trips_as_json() -> None:
    changes = {"zone_cap": 9, "ap_fallback_dampings": (0.8,), "genesis_seed": b"\x00\xff" * 16}
    settings = load_settings(
        OverlaySettings, None, {f"protocol.{k}": v for k, v in changes.items()}
    )
    assert settings.protocol == OverlayParams(**changes)  # type: ignore[arg-type]
    dumped = settings.model_dump(mode="json")
    assert dumped["protocol"]["genesis_seed"] == "00ff" * 16
    assert OverlaySettings.model_validate(dumped).protocol == settings.protocol
    assert {f.name for f in dataclasses.fields(OverlayParams)} == set(dumped["protocol"])


def test_unknown_protocol_keys_and_bad_types_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"protocol\.zone_kap"):
        load_settings(OverlaySettings, None, {"protocol.zone_kap": 4})
    with pytest.raises(ConfigError, match=r"protocol\.hop_time"):
        load_settings(OverlaySettings, None, {"protocol.hop_time": "soon"})


def test_environment_reaches_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLM_OVERLAY_PROTOCOL__BEAM", "3")
    assert load_settings(OverlaySettings).protocol.beam == 3


def test_overrides_reach_the_parameters() -> None:
    settings = load_settings(
        OverlaySettings,
        None,
        {"protocol.zone_cap": 4, "protocol.lease_duration": 2.5, "protocol.genesis_time": 10.0},
    )
    params = settings.protocol
    assert (params.zone_cap, params.lease_duration, params.genesis_time) == (4, 2.5, 10.0)
    assert params.replication == OverlayParams().replication


def test_inconsistent_overrides_fail_in_the_parameters() -> None:
    # The parameters' own checks run when the settings load: a ConfigError naming them.
    with pytest.raises(ConfigError, match="lease_duration > heartbeat_interval"):
        load_settings(
            OverlaySettings,
            None,
            {"protocol.heartbeat_interval": 3.0, "protocol.lease_duration": 2.0},
        )


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
