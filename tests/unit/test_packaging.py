"""The wheel carries every subpackage under the peerlm namespace, and the wire is current."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = [
    "peerlm",
    "peerlm.wire.v1.cpm_pb2_grpc",
    "peerlm.wire.v1.peer_pb2_grpc",
    "peerlm.wire.v1.overlay_pb2_grpc",
    "peerlm.pki.ca",
    "peerlm.security.authz",
    "peerlm.services.cpm",
    "peerlm.services.cpm.server",
    "peerlm.agent.simulated",
    "peerlm.overlay",
    "peerlm.cli",
]


@pytest.mark.slow
def test_wheel_imports_every_subpackage(tmp_path: Path) -> None:
    # Build from a clean copy: setuptools reuses a stale build/lib, which would hide a
    # package missing from pyproject.toml.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv",
            "build",
            "*.egg-info",
            ".git",
            "state",
            "__pycache__",
            ".*_cache",
            ".hypothesis",
        ),
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("peerlm-*.whl")
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(unpacked)
    assert "peerlm/py.typed" in names
    assert any(n.startswith("peerlm/services/cpm/") for n in names)
    assert not any(n.startswith(("services/", "agent/", "overlay/")) for n in names)
    code = (
        "import importlib, sys\n"
        f"mods = {SUBPACKAGES!r}\n"
        "for m in mods:\n"
        "    mod = importlib.import_module(m)\n"
        f"    assert mod.__file__.startswith({str(unpacked)!r}), (m, mod.__file__)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_generated_wire_code_is_current() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/gen-proto"), "--check"],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_compose_file_is_valid_and_refers_to_real_files() -> None:
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "cpm" in compose["services"]
    for svc in compose["services"].values():
        build = svc.get("build", {})
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).exists()
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./deploy/"):
                assert (ROOT / host).exists(), host
