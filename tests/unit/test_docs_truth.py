"""The docs stay true: what docs/architecture.md and the other pages cite exists in the code.

What is checked, precisely (a *span* is text between single backticks):

* **Repository paths** (every page, README.md and docs/*.md): a span or a relative link target
  whose first segment is a top-level entry of the repository (``agent/``, ``services/``,
  ``docs/``, ``.importlinter``...) must exist. ``{a,b}`` expands to each alternative and
  ``*`` globs (at least one match). Runtime paths (``state/``, ``build/``) and paths outside
  the repository (``../shared/...``) are not repository paths and are not checked.
* **docs/architecture.md, further**:
  - a span that is a bare file name (``linucb.py``, ``exchange*.py``) names a file in the
    folder of the last path cited before it in the same block (paragraph, list or table
    row), or, when the block cites none, a file somewhere in the source tree;
  - a span ``peerlm.v1.Name`` names a gRPC service of ``proto/peerlm/v1/*.proto``;
  - a span ``Service.Rpc`` (two CamelCase words) names a service and one of its rpcs;
  - a bare CamelCase span names a service, rpc or message of the protos, or a name a
    public face exports;
  - any other dotted span starting ``peerlm.`` imports: the longest importable module
    prefix, then attributes;
  - every protocol of the CPM's menu has a row in the protocol table (a line starting
    ``| `name` |``), and every row of "Where each paper lives" names code.
* **Line length**: README.md, docs/architecture.md and docs/commands.md keep lines within 200
  characters.
* **No issue numbers** in the product: no tracked ``.py``, ``.md``, ``.toml``, ``.yml`` or
  ``.yaml`` file refers to a tracker's issue by number; a reader cannot follow such a pointer,
  so the text says the thing itself.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs/architecture.md"
#: Folders a checkout holds that are made, not written: never cited as repository paths.
_GENERATED = {".git", ".venv", "build", "dist", "state", "out", ".tools", "__pycache__"}
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_FILE_EXT = re.compile(r"\.(py|md|proto|yaml|yml|toml|json|cfg)$")
_PATH_CHARS = re.compile(r"[\w./{},*+-]+")
_ISSUE_REF = re.compile(r"issues? ?#?[0-9]+", re.IGNORECASE)
_PRODUCT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml"}
MAX_LINE = 200


def _top_level() -> set[str]:
    return {
        p.name
        for p in ROOT.iterdir()
        if p.name not in _GENERATED
        and not p.name.endswith(".egg-info")
        and not p.name.endswith("_cache")
    }


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one level of braces, as the docs use)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [x for alt in match.group(1).split(",") for x in _expand(head + alt.strip() + tail)]


def _exists(path: str, base: Path = ROOT) -> bool:
    path = path.rstrip("/")
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists()


def _is_repo_path(token: str, tops: set[str]) -> bool:
    if not _PATH_CHARS.fullmatch(token) or token.startswith(("../", "/")):
        return False
    first = token.split("/", 1)[0]
    return first in tops and ("/" in token or first.startswith("."))


def _blocks(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each paragraph, list or table row of a page."""
    block: list[str] = []
    start = 1
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("|") or not line.strip() or line.startswith("#"):
            if block:
                yield start, "\n".join(block)
                block = []
            if line.startswith("|"):
                yield number, line
            continue
        if not block:
            start = number
        block.append(line)
    if block:
        yield start, "\n".join(block)


def _cited_paths(page: Path) -> list[tuple[int, str]]:
    tops = _top_level()
    text = page.read_text()
    found: list[tuple[int, str]] = []
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for token in _SPAN.findall(line):
            token = token.strip()
            if _is_repo_path(token, tops):
                found.append((number, token))
        for target in _LINK.findall(line):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            if resolved.is_relative_to(ROOT):
                found.append((number, str(resolved.relative_to(ROOT))))
    return found


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_repository_paths_exist(page: Path) -> None:
    missing = [
        f"{page.name}:{n}: {token}"
        for n, token in _cited_paths(page)
        if not all(_exists(p) for p in _expand(token))
    ]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


# -- docs/architecture.md against the code ------------------------------------------------


def _proto() -> tuple[dict[str, set[str]], set[str]]:
    """The services of proto/peerlm/v1 with their rpcs, and every message name."""
    services: dict[str, set[str]] = {}
    messages: set[str] = set()
    for path in sorted((ROOT / "proto/peerlm/v1").glob("*.proto")):
        current = ""
        for line in path.read_text().splitlines():
            if m := re.match(r"\s*service (\w+)", line):
                current = m.group(1)
                services[current] = set()
            elif (m := re.match(r"\s*rpc (\w+)", line)) and current:
                services[current].add(m.group(1))
            elif m := re.match(r"\s*message (\w+)", line):
                messages.add(m.group(1))
    return services, messages


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _public_names() -> set[str]:
    names: set[str] = set()
    for face in ("peerlm.node", "peerlm.services.cpm", "peerlm.overlay", "peerlm.agent"):
        module = importlib.import_module(face)
        names |= set(getattr(module, "__all__", dir(module)))
    return names


def _source_files(name: str) -> bool:
    return any(
        p
        for top in ("agent", "services", "overlay", "peerlm", "bench", "scripts", "deploy")
        for p in (ROOT / top).rglob(name)
    )


def _architecture_problems() -> list[str]:
    text = ARCHITECTURE.read_text()
    services, messages = _proto()
    rpcs = {r for s in services.values() for r in s}
    tops = _top_level()
    public: set[str] | None = None
    problems: list[str] = []
    for number, block in _blocks(text):
        folder: Path | None = None
        for token in _SPAN.findall(block):
            token = token.strip()
            where = f"architecture.md:{number}: `{token}`"
            if _is_repo_path(token, tops):
                expanded = _expand(token)
                if not all(_exists(p) for p in expanded):
                    problems.append(f"{where}: no such path")
                last = ROOT / expanded[-1]
                folder = last if token.endswith("/") else last.parent
            elif _PATH_CHARS.fullmatch(token) and _FILE_EXT.search(token) and "/" not in token:
                ok = (
                    all(_exists(p, folder) for p in _expand(token))
                    if folder is not None
                    else all(_source_files(p) for p in _expand(token))
                )
                if not ok:
                    in_folder = folder.relative_to(ROOT) if folder else "the source tree"
                    problems.append(f"{where}: not in {in_folder}")
            elif m := re.fullmatch(r"peerlm\.v1\.(\w+)", token):
                if m.group(1) not in services:
                    problems.append(f"{where}: no such gRPC service (have {sorted(services)})")
            elif m := re.fullmatch(r"([A-Z]\w*)\.([A-Z]\w*)", token):
                service, rpc = m.groups()
                if rpc not in services.get(service, set()):
                    problems.append(f"{where}: no rpc {rpc} in a service {service}")
            elif re.fullmatch(r"peerlm(\.\w+)+", token):
                if not _resolves(token):
                    problems.append(f"{where}: does not import")
            elif re.fullmatch(r"[A-Z][a-z0-9]+[A-Z]\w*", token):
                if token in services or token in rpcs or token in messages:
                    continue
                public = _public_names() if public is None else public
                if token not in public:
                    problems.append(f"{where}: neither a proto name nor a public Python name")
    return problems


def test_architecture_cites_what_exists() -> None:
    problems = _architecture_problems()
    assert not problems, "docs/architecture.md is out of date:\n" + "\n".join(problems)


def test_architecture_names_code_for_every_paper_row() -> None:
    """A row of "Where each paper lives" without code (a "not built yet" and a dash) is how
    the page once went stale: every row names at least one path."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Where each paper lives") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    # A row whose algorithm cell is empty continues the row above it.
    algorithms = [row for row in rows[1:] if row.split("|")[2].strip()]
    bare = [row for row in algorithms if "`" not in row.rsplit("|", 2)[-2]]
    assert rows and not bare, "rows that name no code:\n" + "\n".join(bare)


def test_architecture_has_a_row_per_protocol_of_the_menu() -> None:
    from peerlm.services.cpm import MENU

    rows = {
        m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", ARCHITECTURE.read_text(), re.MULTILINE)
    }
    assert set(MENU) <= rows, f"protocols without a row: {sorted(set(MENU) - rows)}"


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md", "docs/commands.md"])
def test_lines_stay_readable(page: str) -> None:
    long = [
        f"{page}:{n}: {len(line)} characters"
        for n, line in enumerate((ROOT / page).read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"lines over {MAX_LINE} characters:\n" + "\n".join(long)


def _product_files() -> Iterator[Path]:
    """Every tracked product file (``git ls-files``): what a clone holds, not local scratch.

    Outside a git checkout (an unpacked sdist) every file is walked instead, past made folders.
    """
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", *(f"*{s}" for s in sorted(_PRODUCT_SUFFIXES))],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        listed = ""
    if listed:
        for name in listed.split("\0"):
            if name and (ROOT / name).is_file():
                yield ROOT / name
        return
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if d not in _GENERATED and not d.endswith((".egg-info", "_cache"))
        ]
        for name in files:
            if Path(name).suffix in _PRODUCT_SUFFIXES:
                yield Path(folder) / name


def test_no_issue_numbers_in_the_product() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for path in _product_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if _ISSUE_REF.search(line)
    ]
    assert not found, (
        f"{len(found)} references to issue numbers (say what was measured or what the rule is):\n"
        + "\n".join(found)
    )
