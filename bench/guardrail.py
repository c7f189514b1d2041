"""Guardrail leak recall and false positives on the bundled code bank.

``python -m peerlm.bench.guardrail [--per-category N] [--seed S]`` prints one JSON object.

Private set: ``N`` bank problems per category (the agent's D_i: prompt + reference, as the
agent indexes them). Honest set: ``N`` *other* problems per category (distinct functions,
the same templates), whose own references stand for honest completions. The guardrail is
built as the agent builds it (:func:`peerlm.agent.vetting.guardrail.agent_guardrail`), or with
``--baseline FILE`` from an older ``guardrail.py`` as ``Guardrail(private, ngram=8)``, the
earlier construction.

Measured:

* ``leak_recall``: share of leaked private function bodies the filter changes, per form:
  ``body`` (the reference verbatim, as a completion), ``function`` (the def line and the
  body), ``renamed`` (parameters renamed and operators re-spaced, i.e. the same code
  disguised);
* ``secret_recall``: share of planted secrets and personal data it changes, per trick;
* ``false_positive``: share of honest completions it changes (``bank``) and of ordinary
  standard-library source files (``stdlib``).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import inspect
import json
import logging
import random
import re
import string
import sys
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from peerlm.agent import (
    CATEGORIES,
    Problem,
    agent_guardrail,
    code_tokens,
    function_key,
    generate_bank,
    public_problems,
)

__all__ = ["leak_forms", "main", "measure", "planted_secrets"]

_PARAMS = re.compile(r"def \w+\((.*?)\)")


def _renamed(problem: Problem) -> str:
    """The reference with its parameters renamed and the spacing around operators changed."""
    match = _PARAMS.search(problem.prompt)
    body = problem.reference
    if match:
        names = [p.split(":")[0].strip() for p in match.group(1).split(",") if p.strip()]
        for i, name in enumerate(names):
            body = re.sub(rf"\b{re.escape(name)}\b", f"arg_{i}", body)
    body = re.sub(r" ([+\-*/%<>=]=?|==) ", r"\1", body)
    return body.replace(", ", ",")


def leak_forms(problem: Problem) -> dict[str, str]:
    """A private problem's body as a teacher could leak it."""
    def_line = problem.prompt.split("\n", 1)[0]
    return {
        "body": problem.reference,
        "function": def_line + "\n    " + problem.reference,
        "renamed": _renamed(problem),
    }


def _luhn_complete(digits: str) -> str:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 0:
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
    return digits + str((10 - total % 10) % 10)


def planted_secrets(rng: random.Random, per_kind: int) -> dict[str, list[str]]:
    """Secrets and personal data hidden by known disguises, ``per_kind`` of each."""
    alnum = string.ascii_letters + string.digits
    upper = string.ascii_uppercase + string.digits

    def token(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    out: dict[str, list[str]] = {k: [] for k in (
        "concatenation", "implicit_concatenation", "hex", "base32", "zero_width", "case",
        "ssn", "card", "phone", "internal_ip",
    )}  # fmt: skip
    for _ in range(per_kind):
        aws = "AKIA" + token(upper, 16)
        gh = "ghp_" + token(alnum, 36)
        cut = rng.randint(3, len(aws) - 3)
        out["concatenation"].append(f'key = "{aws[:cut]}" + "{aws[cut:]}"\n')
        cut = rng.randint(4, len(gh) - 4)
        out["implicit_concatenation"].append(f'TOKEN = ("{gh[:cut]}"\n         "{gh[cut:]}")\n')
        out["hex"].append(f'blob = bytes.fromhex("{aws.encode().hex()}")\n')
        out["base32"].append(f'blob = "{base64.b32encode(gh.encode()).decode()}"\n')
        hidden = "\u200b".join(aws)
        out["zero_width"].append(f'k = "{hidden}"\n')
        out["case"].append(f'k = "{aws.lower()}"\n')
        area = rng.choice([n for n in range(1, 900) if n != 666])
        ssn = f"{area:03d}-{rng.randint(1, 99):02d}-{rng.randint(1, 9999):04d}"
        out["ssn"].append(f'patient = {{"name": "J. Doe", "ssn": "{ssn}"}}\n')
        card = _luhn_complete(rng.choice("3456") + token(string.digits, 14))
        groups = " ".join(card[i : i + 4] for i in range(0, 16, 4))
        out["card"].append(f"# charge card {groups} monthly\n")
        phone = f"+1 ({rng.randint(201, 989)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
        out["phone"].append(f'CONTACT = "{phone}"\n')
        ip = rng.choice([
            f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
            f"192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
            f"172.{rng.randint(16, 31)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        ])  # fmt: skip
        out["internal_ip"].append(f'DB_HOST = "{ip}:5432"\n')
    return out


def _stdlib_sources() -> list[str]:
    import collections
    import fnmatch
    import functools
    import heapq
    import shutil
    import textwrap
    import urllib.parse

    objects: Sequence[Callable[..., Any]] = (
        textwrap.dedent, string.capwords, shutil.copyfileobj, heapq.nsmallest,
        urllib.parse.urlsplit, functools.total_ordering, collections.Counter.most_common,
        fnmatch.translate, json.dumps, random.Random.shuffle, base64.b32encode,
    )  # fmt: skip
    return [inspect.getsource(obj) for obj in objects]


def _build(private: Sequence[Problem], baseline: str | None) -> Any:
    texts = [p.prompt + p.reference for p in private]
    if baseline is not None:
        # An older guardrail.py, built as the agent built it before the disguise checks.
        spec = importlib.util.spec_from_file_location("guardrail_baseline", baseline)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module.Guardrail(texts, ngram=8)
    return agent_guardrail(texts)


def _shape(code: str) -> tuple[str, ...]:
    """A body's code tokens with names replaced: equal shapes are the same function."""
    return tuple(t.renamed for t in code_tokens(code))


def _share(guard: Any, texts: Sequence[str]) -> float:
    changed = sum(guard.filter_text(t).text != t for t in texts)
    return round(changed / len(texts), 4) if texts else 0.0


def measure(per_category: int = 40, seed: int = 7, baseline: str | None = None) -> dict[str, Any]:
    """Recall and false positives; see the module docstring."""
    public_keys = {function_key(p) for p in public_problems()}
    bank = generate_bank(2 * per_category, seed, exclude=public_keys)
    private: list[Problem] = []
    honest: list[Problem] = []
    for category in CATEGORIES:
        mine = [p for p in bank if p.category == category]
        private += mine[:per_category]
        honest += mine[per_category:]
    guard = _build(private, baseline)
    forms = [leak_forms(p) for p in private]
    leak = {form: _share(guard, [f[form] for f in forms]) for form in forms[0]}
    # A private body that is, up to names, a body of the public corpus reveals nothing
    # private; an honest body that is, up to names, a private body is the same function.
    public_shapes = {_shape(p.reference) for p in public_problems()}
    private_shapes = {_shape(p.reference) for p in private}
    secret_forms = [f for p, f in zip(private, forms, strict=True)
                    if _shape(p.reference) not in public_shapes]  # fmt: skip
    distinct_honest = [p for p in honest if _shape(p.reference) not in private_shapes]
    secrets = planted_secrets(random.Random(seed), per_kind=per_category)
    return {
        "private_problems": len(private),
        "honest_problems": len(honest),
        "leak_recall": leak,
        "leak_recall_mean": round(sum(leak.values()) / len(leak), 4),
        "private_bodies_not_public": len(secret_forms),
        "leak_recall_not_public": {
            form: _share(guard, [f[form] for f in secret_forms]) for form in forms[0]
        },
        "secret_recall": {kind: _share(guard, texts) for kind, texts in secrets.items()},
        "false_positive": {
            "bank": _share(guard, [p.reference for p in honest]),
            "bank_not_a_private_function": _share(guard, [p.reference for p in distinct_honest]),
            "bank_function": _share(guard, [leak_forms(p)["function"] for p in honest]),
            "stdlib": _share(guard, _stdlib_sources()),
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print :func:`measure` as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--per-category", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--baseline", help="an older agent/vetting/guardrail.py to measure instead")
    args = parser.parse_args(argv)
    # The filter logs one line per redaction; the figures are what this command is for.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(json.dumps(measure(args.per_category, args.seed, args.baseline), indent=2))


if __name__ == "__main__":
    main()
