"""Configuration layering and the root CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peerlm.services.cpm import CpmSettings
from typer.testing import CliRunner

from peerlm import __version__
from peerlm.app.cli import app
from peerlm.config import ConfigError, explicit_settings, load_settings


def test_precedence_file_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "cpm.yaml"
    cfg.write_text("beta: 0.5\nseed: 3\nlisten: 127.0.0.1:1000\ntls:\n  cert: /from/file\n")
    monkeypatch.setenv("PEERLM_CPM_SEED", "4")
    monkeypatch.setenv("PEERLM_CPM_TLS__KEY", "/from/env")
    s = load_settings(CpmSettings, cfg, {"listen": "127.0.0.1:2000", "beta": None})
    assert s.beta == 0.5  # file
    assert s.seed == 4  # env beats file
    assert s.listen == "127.0.0.1:2000"  # flag beats file
    assert str(s.tls.cert) == "/from/file" and str(s.tls.key) == "/from/env"  # nested merge


def test_explicit_settings_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLM_CPM_SEED", "4")
    monkeypatch.setenv("PEERLM_CPM_BETA", "7")
    monkeypatch.setenv("PEERLM_CPM_TLS__KEY", "/from/env")
    assert CpmSettings().seed == 4  # what the harness must not pick up
    s = explicit_settings(CpmSettings, {"beta": 0.5})
    assert isinstance(s, CpmSettings) and type(s).__name__ == "CpmSettings"
    assert s.beta == 0.5 and s.seed == CpmSettings.model_fields["seed"].default
    assert s.tls.key is None
    with pytest.raises(ValueError, match="beta"):
        explicit_settings(CpmSettings, {"beta": -1})


def test_invalid_config_fails_fast_with_every_field(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("beta: -1\nlisten: nowhere\nunknown_key: 1\n")
    with pytest.raises(ConfigError) as e:
        load_settings(CpmSettings, cfg)
    msg = str(e.value)
    assert "beta" in msg and "listen" in msg and "unknown_key" in msg


def test_not_yaml_and_not_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "x.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(CpmSettings, bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(CpmSettings, bad)


def test_version() -> None:
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and __version__ in out.output


def test_config_show(tmp_path: Path) -> None:
    cfg = tmp_path / "cpm.yaml"
    cfg.write_text("beta: 2.0\n")
    out = CliRunner().invoke(
        app, ["config", "show", "--component", "cpm", "--config", str(cfg), "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["beta"] == 2.0
    out = CliRunner().invoke(app, ["config", "show", "--component", "nope"])
    assert out.exit_code == 2


def test_config_show_invalid(tmp_path: Path) -> None:
    cfg = tmp_path / "cpm.yaml"
    cfg.write_text("beta: -2\n")
    out = CliRunner().invoke(app, ["config", "show", "--config", str(cfg)])
    assert out.exit_code == 2


def test_federation_comes_from_the_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerlm.pki.ca import init_ca, issue_certificate
    from peerlm.pki.identity import Role

    init_ca(tmp_path, federation="acme")
    issue_certificate(tmp_path, Role.CPM, "cpm")
    tls = {"tls.ca_cert": tmp_path / "ca.crt", "tls.cert": tmp_path / "cpm.crt"}
    tls["tls.key"] = tmp_path / "cpm.key"
    # Unset: the certificate decides (the documented `peerlm cpm --cert ...` interface).
    assert load_settings(CpmSettings, None, tls).federation == "acme"
    monkeypatch.setenv("PEERLM_CPM_FEDERATION", "acme")
    assert load_settings(CpmSettings, None, tls).federation == "acme"
    # Set and different: it would refuse every peer of its own federation; fail instead.
    monkeypatch.setenv("PEERLM_CPM_FEDERATION", "peerlm")
    with pytest.raises(ConfigError, match=r"'peerlm'.*differs.*'acme'"):
        load_settings(CpmSettings, None, tls)
    # Without a certificate (or in insecure-dev) the setting stands.
    assert load_settings(CpmSettings, None, {}).federation == "peerlm"
