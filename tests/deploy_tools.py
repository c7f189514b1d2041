"""Finding the external tools the deployment tests use (installed by scripts/ci-tools)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = ROOT / ".tools" / "bin"

#: PromQL words that are not metric names.
_PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
     "bool", "offset", "inf", "nan",
     # aggregation operators: written before their grouping clause, not before "("
     "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk",
     "quantile", "count_values"}
)  # fmt: skip


def tool(name: str) -> str:
    """Path of ``name`` on PATH or in .tools/bin; skips the test, naming the tool, if absent."""
    found = shutil.which(name) or shutil.which(name, path=str(TOOLS_BIN))
    if found is None:
        pytest.skip(
            f"{name} is not installed (scripts/ci-tools installs it; CI runs it, or set "
            "PEERLM_INSTALL_TOOLS=1 for scripts/test)"
        )
    return found


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, grouping, functions removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery selectors
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text
    )  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("("):  # a function call
            continue
        word = m.group(0)
        if word.lower() in _PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def documented_metrics() -> dict[str, str]:
    """Metric name -> type, from the tables of docs/metrics.md."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    return dict(re.findall(r"^\| `([a-z0-9_:]+)` \| (\w+) \|", doc, flags=re.M))


def is_documented(name: str, documented: dict[str, str]) -> bool:
    """``name`` is in the catalogue, or is a histogram's ``_bucket``/``_sum``/``_count``."""
    if name in documented:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and documented.get(base) == "histogram":
            return True
    return False
