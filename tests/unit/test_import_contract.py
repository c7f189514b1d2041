"""The import contract (.importlinter) names every module it must constrain.

import-linter checks the modules a contract lists; a module added later and listed nowhere
would be unconstrained without anyone noticing. These tests keep the lists whole: every
kernel module is a source of the kernel contract, every overlay module is either sans-IO
core or named transport edge.
"""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_KERNEL = {"app", "bench", "__init__", "__main__"}


def _contract() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    return parser


def _listed(section: str, key: str) -> set[str]:
    return set(_contract()[section][key].split())


def _children(folder: Path) -> set[str]:
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    return names - {"__init__", "__pycache__"}


def test_every_kernel_module_is_a_source_of_the_kernel_contract() -> None:
    kernel = {f"peerlm.{name}" for name in _children(ROOT / "peerlm") - NOT_KERNEL}
    listed = _listed("importlinter:contract:kernel", "source_modules")
    assert kernel - listed == set(), "kernel modules missing from .importlinter"
    assert listed - kernel == set(), ".importlinter names kernel modules that do not exist"


def test_every_overlay_module_is_either_core_or_transport() -> None:
    modules = {f"peerlm.overlay.{name}" for name in _children(ROOT / "overlay")}
    core = _listed("importlinter:contract:overlay-core", "source_modules")
    transport = _listed("peerlm:overlay-transport", "modules")
    assert core & transport == set(), "a module cannot be both core and transport"
    assert modules - (core | transport) == set(), "overlay modules not classified"
    assert (core | transport) - modules == set(), ".importlinter names modules that do not exist"
