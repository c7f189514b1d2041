"""The wheel carries every subpackage under the peerlm namespace, and the wire is current."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _source_packages() -> set[str]:
    """Every package of the source tree under its import name (pyproject's package-dir)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    found: set[str] = set()
    for name, directory in mapping.items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return found


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
    # Import every module the wheel holds, found by walking it (not a hand-written list),
    # and check that every package of the source tree is among them.
    code = (
        "import importlib, json, pkgutil\n"
        "import peerlm\n"
        "packages = ['peerlm']\n"
        "for info in pkgutil.walk_packages(peerlm.__path__, 'peerlm.'):\n"
        "    if info.name.endswith('.__main__'):\n"  # runs the CLI when imported
        "        continue\n"
        "    mod = importlib.import_module(info.name)\n"
        f"    assert mod.__file__.startswith({str(unpacked)!r}), (info.name, mod.__file__)\n"
        "    if info.ispkg:\n"
        "        packages.append(info.name)\n"
        "print(json.dumps(packages))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(json.loads(out.stdout.strip().splitlines()[-1]))
    expected = _source_packages()
    assert {"peerlm.agent.tasks", "peerlm.agent.models", "peerlm.services.cpm"} <= expected
    assert expected <= imported, f"missing from the wheel: {sorted(expected - imported)}"


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
