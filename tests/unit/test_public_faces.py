"""Each subsystem's public face: every exported name resolves, and importing the package is
cheap (the heavy libraries load only with the names that need them)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACES = {
    "peerlm.agent": ("agent", ["peerlm", "bench", "services", "overlay"]),
    "peerlm.overlay": ("overlay", ["peerlm", "bench", "services", "agent"]),
    "peerlm.services.cpm": ("services/cpm", ["peerlm", "bench", "agent", "overlay"]),
}


@pytest.mark.parametrize("package", sorted(FACES))
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_importing_the_faces_loads_no_torch_or_grpc() -> None:
    code = (
        "import sys, peerlm.agent, peerlm.overlay, peerlm.services.cpm; "
        "print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_no_package_reaches_into_another_subsystems_modules() -> None:
    """Outside a subsystem (other subsystems, the application layer, benchmarks) only its
    package face is imported (tests may reach in)."""
    offending = []
    for package, (own, users) in FACES.items():
        for folder in users:
            for path in (ROOT / folder).rglob("*.py"):
                if "wire" in path.parts or path.is_relative_to(ROOT / own):
                    continue
                for node in ast.walk(ast.parse(path.read_text())):
                    if (
                        isinstance(node, ast.ImportFrom)
                        and node.module
                        and node.module.startswith(package + ".")
                    ):
                        offending.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
    assert not offending, offending


def test_every_name_imported_from_a_face_is_exported() -> None:
    """A lazy face answers any attribute for mypy (module ``__getattr__``), so a name missing
    from it only fails when the import runs; this walks every import of a face instead."""
    missing = []
    faces = {name: set(importlib.import_module(name).__all__) for name in FACES}
    for folder in ("peerlm", "bench", "services", "agent", "overlay", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if "wire" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in faces:
                    own = ROOT / FACES[node.module][0]
                    for alias in node.names:
                        inside = path.is_relative_to(own) or path.is_relative_to(ROOT / "tests")
                        # Inside the subsystem (and in tests) a submodule may be imported.
                        if inside and importlib.util.find_spec(f"{node.module}.{alias.name}"):
                            continue
                        if alias.name not in faces[node.module]:
                            where = f"{path.relative_to(ROOT)}:{node.lineno}"
                            missing.append(f"{where} {node.module}.{alias.name}")
    assert not missing, missing
