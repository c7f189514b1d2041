"""Which risky modules a piece of incoming code imports (the student's package vetting).

A teacher's completions become the student's training targets: code that opens sockets,
starts processes, touches the file system or inspects the interpreter would teach the
student to write exactly that, and would later run in its sandbox. :func:`risky_imports`
finds such imports with :mod:`ast` (``import x``, ``from x import y``, ``__import__("x")``,
``importlib.import_module("x")``); a completion is often a fragment (a function body
without its ``def``), so it is parsed as written, then dedented, then inside a function,
and only when none parses does a line-based scan stand in.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Final

__all__ = ["RISKY_MODULES", "risky_imports"]

#: Top-level modules refused in incoming code, by what they reach.
RISKY_MODULES: Final[frozenset[str]] = frozenset(
    {
        # networking
        "socket", "ssl", "http", "urllib", "urllib2", "urllib3", "requests", "httpx",
        "aiohttp", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "socketserver",
        "xmlrpc", "asyncio", "select", "selectors", "websocket", "websockets", "paramiko",
        # processes and signals
        "subprocess", "multiprocessing", "os", "pty", "signal", "posix", "_posixsubprocess",
        "threading", "_thread", "concurrent", "sched",
        # the file system
        "shutil", "pathlib", "tempfile", "glob", "fileinput", "io", "_io", "zipfile",
        "tarfile", "mmap", "fcntl", "resource",
        # introspection and code loading
        "sys", "inspect", "ctypes", "_ctypes", "cffi", "gc", "builtins", "importlib",
        "imp", "marshal", "pickle", "code", "codeop", "dis", "types", "traceback",
        "pkgutil", "runpy", "site",
    }
)  # fmt: skip
_LOADERS: Final = frozenset({"__import__", "import_module"})
_LINE_IMPORT: Final = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w., ]+))", re.M)
_CALL_IMPORT: Final = re.compile(r"(?:__import__|import_module)\(\s*['\"]([\w.]+)['\"]")


def _parse(code: str) -> ast.AST | None:
    for candidate in (code, textwrap.dedent(code), "def _f():\n" + textwrap.indent(code, "    ")):
        try:
            return ast.parse(candidate)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            continue
    return None


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def risky_imports(code: str) -> list[str]:
    """The risky top-level modules ``code`` imports or loads by name, sorted; [] if none."""
    found: set[str] = set()
    tree = _parse(code)
    if tree is None:
        for match in _LINE_IMPORT.finditer(code):
            names = match.group(1) or match.group(2) or ""
            found.update(_top(n.strip().split(" ")[0]) for n in names.split(",") if n.strip())
        found.update(_top(m.group(1)) for m in _CALL_IMPORT.finditer(code))
        return sorted(found & RISKY_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_top(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(_top(node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if name in _LOADERS:
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.add(_top(first.value))
                else:
                    found.add("importlib")  # a computed module name: refuse as a loader
    return sorted(found & RISKY_MODULES)
