"""Lazy package faces: a subsystem exports names whose modules load on first use.

A subsystem's ``__init__`` lists what other packages may use; importing the package must
stay cheap (``import peerlm.overlay`` loads no torch), so each name is imported from its
module only when first read (PEP 562 module ``__getattr__``) and then cached.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``exports`` (public name ->
    (module, attribute))."""

    def getattr_(name: str) -> Any:
        try:
            module, attr = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), attr)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return getattr_, dir_
