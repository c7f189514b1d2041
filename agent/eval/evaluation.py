"""Functional correctness: the unbiased pass@k estimator and sandboxed evaluation.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n
samples per problem of which c pass, the probability that at least one of k samples drawn
without replacement passes is ``1 - C(n - c, k) / C(n, k)``. Binomials overflow long before
realistic n, so it is computed as the product ``1 - prod_{i = n-c+1}^{n} (1 - k / i)``.

Structural match (:func:`structural_match`): a metric that moves before pass@1 does. A
completion matches its reference when the two programs (prompt + completion, prompt +
reference) have the same Python token sequence after normalising literals and identifiers:
every number becomes ``<num>``, every string ``<str>``, and every name that is neither a
keyword, a builtin nor an attribute (the name after a ``.``) becomes ``<id0>``, ``<id1>``...
in order of first appearance (alpha-renaming). Comments and blank lines are dropped;
indentation and line structure are kept. So ``[s] * 2`` matches ``[s] * 3`` (the wrong
constant: the audit's commonest failure) and ``for j in x`` matches ``for i in x``, while
``x + 1`` does not match ``x - 1``. A program that does not tokenize matches nothing.
"""

from __future__ import annotations

import builtins
import io
import keyword
import tokenize
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from peerlm.agent.eval.sandbox import STATUSES, LimitOptions, Status, run_many
from peerlm.agent.tasks.bank import CATEGORIES
from peerlm.agent.tasks.dataset import Problem

__all__ = [
    "EvalReport",
    "ProblemResult",
    "evaluate",
    "pass_at_k",
    "structural_form",
    "structural_match",
    "structural_match_rate",
]

_BUILTINS = frozenset(dir(builtins))
_SKIPPED = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER, tokenize.TYPE_COMMENT}
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples with ``c`` correct.

    As in the HumanEval reference code, 1.0 when ``n - c < k`` (every draw of k samples
    contains a correct one). For ``k > n`` the estimator is undefined; this returns 1.0 if
    ``c > 0`` else 0.0 (the reference code's ``n - c < k`` rule would say 1.0 even for
    ``c = 0``). :func:`evaluate` leaves such k out instead of calling this.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if k > n:
        return 1.0 if c > 0 else 0.0
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass(frozen=True)
class ProblemResult:
    """One problem's samples: ``n`` run, ``c`` passed, pass@k for each k <= n (others absent)."""

    task_id: str
    category: str
    n: int
    c: int
    pass_at: Mapping[int, float]
    statuses: Mapping[Status, int]


@dataclass(frozen=True)
class EvalReport:
    """Per-problem results and their means.

    ``mean[k]`` is pass@k averaged over the problems with at least k samples (absent if none
    has); ``per_category`` is the same mean within each category; ``status_counts`` counts
    sandbox outcomes over all samples. :meth:`to_dict` writes absent values as ``null``.
    """

    ks: tuple[int, ...]
    problems: tuple[ProblemResult, ...]
    mean: Mapping[int, float]
    per_category: Mapping[str, Mapping[int, float]]
    status_counts: Mapping[Status, int]
    n_samples: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with ``"pass@k"`` keys."""

        def keyed(values: Mapping[int, float]) -> dict[str, float | None]:
            return {f"pass@{k}": values.get(k) for k in self.ks}

        return {
            "n_problems": len(self.problems),
            "n_samples": self.n_samples,
            **keyed(self.mean),
            "per_category": {cat: keyed(v) for cat, v in self.per_category.items()},
            "status_counts": dict(self.status_counts),
            "problems": [
                {
                    "task_id": p.task_id,
                    "category": p.category,
                    "n": p.n,
                    "c": p.c,
                    **keyed(p.pass_at),
                    "statuses": dict(p.statuses),
                }
                for p in self.problems
            ],
        }


def evaluate(
    problems: Sequence[Problem],
    completions: Mapping[str, Sequence[str]],
    ks: Iterable[int] = (1, 5, 10),
    max_workers: int = 2,
    known: MutableMapping[str, Status] | None = None,
    **limits: Unpack[LimitOptions],
) -> EvalReport:
    """Run every completion against its problem's tests in the sandbox; pass@k per problem.

    Identical programs (the same completion to the same problem) are run once and their
    outcome counted for each sample. ``known`` maps programs to the status an earlier
    evaluation *under the same limits* measured: those are not run again, and the programs
    this call runs are added to it (the caller keeps one map per set of limits). A program
    near a limit may time out on one run and not on another: with ``known`` a later
    evaluation inherits the first one's outcome (the same draw for both, as for common
    random numbers) instead of measuring again.

    ``completions`` maps task ids to samples; every problem needs at least one sample and
    every key must name a problem (``ValueError`` otherwise). ``limits`` go to
    :func:`~peerlm.agent.eval.sandbox.run_program`.
    """
    ks = tuple(sorted(set(ks)))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    by_id: dict[str, Problem] = {}
    for problem in problems:
        if problem.task_id in by_id:
            raise ValueError(f"duplicate task_id {problem.task_id!r}")
        by_id[problem.task_id] = problem
    unknown = sorted(set(completions) - set(by_id))
    if unknown:
        raise ValueError(f"completions for unknown task ids: {', '.join(unknown[:5])}")
    for tid, samples in completions.items():
        # A bare string is a Sequence[str] too: it would be scored character by character.
        if isinstance(samples, str):
            raise TypeError(f"completions[{tid!r}] is a str; pass a list of completions")
    missing = [tid for tid in by_id if not completions.get(tid)]
    if missing:
        raise ValueError(f"no completions for {len(missing)} problem(s), e.g. {missing[0]!r}")

    programs = [p.program(s) for p in problems for s in completions[p.task_id]]
    # Identical programs (greedy copies, repeated samples of a small model) run once: the
    # sandbox is deterministic for a given program and limits, and a run costs a process.
    known = {} if known is None else known
    unique = [p for p in dict.fromkeys(programs) if p not in known]
    ran = zip(unique, run_many(unique, max_workers=max_workers, **limits), strict=True)
    known.update((program, result.status) for program, result in ran)
    outcomes = iter([known[program] for program in programs])
    results: list[ProblemResult] = []
    totals = dict.fromkeys(STATUSES, 0)
    for problem in problems:
        statuses = dict.fromkeys(STATUSES, 0)
        for _ in completions[problem.task_id]:
            statuses[next(outcomes)] += 1
        for status, count in statuses.items():
            totals[status] += count
        n, c = sum(statuses.values()), statuses["passed"]
        results.append(
            ProblemResult(
                task_id=problem.task_id,
                category=problem.category,
                n=n,
                c=c,
                pass_at={k: pass_at_k(n, c, k) for k in ks if k <= n},
                statuses=statuses,
            )
        )
    present = {r.category for r in results}
    # Bank categories in histogram order, then any others (e.g. "humaneval") by name.
    categories = [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))
    return EvalReport(
        ks=ks,
        problems=tuple(results),
        mean=_means(results, ks),
        per_category={c: _means([r for r in results if r.category == c], ks) for c in categories},
        status_counts=totals,
        n_samples=len(programs),
    )


def structural_form(code: str) -> tuple[str, ...] | None:
    """``code``'s token sequence with literals and identifiers normalised (module docstring);
    ``None`` when it does not tokenize (an unfinished string, bad indentation)."""
    names: dict[str, str] = {}
    out: list[str] = []
    after_dot = False
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in _SKIPPED:
                continue
            if tok.type == tokenize.ERRORTOKEN:  # e.g. an unterminated string
                return None
            if tok.type == tokenize.NUMBER:
                out.append("<num>")
            elif tok.type == tokenize.STRING:
                out.append("<str>")
            elif tok.type == tokenize.NAME:
                word = tok.string
                if after_dot or keyword.iskeyword(word) or word in _BUILTINS:
                    out.append(word)
                else:
                    out.append(names.setdefault(word, f"<id{len(names)}>"))
            elif tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                out.append(tokenize.tok_name[tok.type])
            else:
                out.append(tok.string)
            after_dot = tok.type == tokenize.OP and tok.string == "."
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return tuple(out)


def structural_match(prompt: str, completion: str, reference: str) -> bool:
    """Whether ``prompt + completion`` equals ``prompt + reference`` up to literals and
    identifiers (module docstring). The prompt is part of both programs, so a completion's
    use of the parameters is renamed consistently with the reference's."""
    if completion.strip() == reference.strip():
        return True
    mine = structural_form(prompt + completion)
    return mine is not None and mine == structural_form(prompt + reference)


def structural_match_rate(problem: Problem, completions: Sequence[str]) -> float:
    """Share of ``completions`` that structurally match ``problem``'s reference (0 if none)."""
    if isinstance(completions, str):
        raise TypeError("completions is a str; pass a list of completions")
    if not completions:
        return 0.0
    target = structural_form(problem.prompt + problem.reference)
    hits = 0
    for c in completions:
        if c.strip() == problem.reference.strip():
            hits += 1
        elif target is not None:
            hits += structural_form(problem.prompt + c) == target
    return hits / len(completions)


def _means(results: Sequence[ProblemResult], ks: Sequence[int]) -> dict[int, float]:
    means: dict[int, float] = {}
    for k in ks:
        values = [r.pass_at[k] for r in results if k in r.pass_at]
        if values:
            means[k] = sum(values) / len(values)
    return means
