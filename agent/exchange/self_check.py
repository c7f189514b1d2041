"""A teacher checks its own answers against the examples its prompts show, and sends only
those that pass (``teach_self_check``; our choice beyond the paper).

KNEXA-FL's teacher sends its greedy predictions y_j(x) on X_u as they are (Eq. 2). On the
bank's problems a teacher's greedy answers in the categories it is competent in pass their
tests about half the time (50-64 % measured, :mod:`.teaching`), so half of what a student
distils is wrong code. X_u is unlabelled, but every bank prompt carries a worked example in
its docstring (``>>> f(args)`` followed by the result): an answer that does not reproduce
its own prompt's example is wrong whatever the hidden tests say. The teacher runs each
answer against its prompt's examples in the sandbox (the one that scores the agent's
validation problems, with its limits) and drops what fails. This is the execution-filtered
self-distillation the field uses for code (rejection sampling on checks the prompt itself
states); it uses nothing but the prompt, the answer and the teacher's own sandbox, reveals
nothing the package does not (which prompts are answered), and changes no wire format.

A prompt without an example cannot be checked and is kept. The examples are parsed by the
standard library's :class:`doctest.DocTestParser` and compared as values (``==`` on the
expected text read as a Python expression), so ``"a;b"`` and ``'a;b'`` are one result; an
expected text that is not an expression (a printed line, a traceback) is left out of the
check.
"""

from __future__ import annotations

import ast
import doctest
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

from peerlm.agent.eval.sandbox import LimitOptions, run_many

__all__ = ["SelfCheck", "example_program", "example_verdicts", "self_check"]


def _expression(text: str) -> str | None:
    """``text`` stripped when it parses as one Python expression, else None."""
    text = text.strip()
    if not text:
        return None
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    return text


def _docstring(prompt: str) -> str:
    """The docstring of the function ``prompt`` opens (its closing quotes are not part of
    an example's expected text); "" when the prompt does not parse as one."""
    try:
        tree = ast.parse(prompt.rstrip() + "\n    pass\n")
    except SyntaxError:
        return ""
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    if not functions:
        return ""
    return ast.get_docstring(functions[-1]) or ""


def example_program(prompt: str, completion: str) -> str | None:
    """The program that checks ``completion`` against ``prompt``'s docstring examples:
    the function (prompt + completion), then one ``assert (call) == (expected)`` per
    example; None when the prompt shows no example that can be checked."""
    checks = []
    for example in doctest.DocTestParser().get_examples(_docstring(prompt)):
        call, want = _expression(example.source), _expression(example.want)
        if call is not None and want is not None:
            checks.append(f"assert ({call}) == ({want})")
    if not checks:
        return None
    return prompt + completion + "\n\n" + "\n".join(checks) + "\n"


@dataclass(frozen=True)
class SelfCheck:
    """What :func:`self_check` kept: the answers' positions, and how many it ran and saw
    fail (a position with no checkable example is kept unrun)."""

    kept: tuple[int, ...]
    checked: int
    failed: int


def example_verdicts(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_workers: int = 2,
    **limits: Unpack[LimitOptions],
) -> list[bool | None]:
    """Per completion: whether it reproduces its prompt's docstring examples in the sandbox
    (None: the prompt shows no example that can be checked). ``limits`` go to
    :func:`~peerlm.agent.eval.sandbox.run_program` (``SandboxUnavailable`` if it cannot
    confine and ``allow_unconfined`` is false)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    programs = [example_program(p, c) for p, c in zip(prompts, completions, strict=True)]
    # Identical programs (a small model repeats itself) run once.
    unique = list(dict.fromkeys(p for p in programs if p is not None))
    results = run_many(unique, max_workers=max_workers, **limits) if unique else []
    passed = {program: r.status == "passed" for program, r in zip(unique, results, strict=True)}
    return [None if program is None else passed[program] for program in programs]


def self_check(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_workers: int = 2,
    **limits: Unpack[LimitOptions],
) -> SelfCheck:
    """Run each completion against its prompt's examples in the sandbox; the positions
    of those that pass or cannot be checked. ``limits`` go to
    :func:`~peerlm.agent.eval.sandbox.run_program` (``SandboxUnavailable`` if it cannot
    confine and ``allow_unconfined`` is false)."""
    verdicts = example_verdicts(prompts, completions, max_workers=max_workers, **limits)
    kept = tuple(i for i, v in enumerate(verdicts) if v is not False)
    return SelfCheck(
        kept=kept,
        checked=sum(v is not None for v in verdicts),
        failed=sum(v is False for v in verdicts),
    )
