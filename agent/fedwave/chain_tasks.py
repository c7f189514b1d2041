"""The task metrics the code chain allows beside Table 1's lexical ones.

MSCoRe's outputs can only be compared with references; the code chain's can also be run:

* **implementation pass** (pass@1 with one sample): the ``implement`` stage's body under the
  signature it was given, followed by the problem's reference tests, passes in the sandbox;
* **generated-test share**: each ``assert`` line the ``test`` stage generated is run alone
  against the reference function; the share that run and pass (a generated test that
  fails on the reference is a wrong test). Output without any ``assert`` line scores 0 of 0.

Programs run through :func:`peerlm.agent.eval.sandbox.run_many` (confined child processes; never
in this process). The program builders are pure and tested on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

from peerlm.agent.eval.sandbox import LimitOptions, run_many
from peerlm.agent.fedwave.code_chain import ChainItem

__all__ = [
    "MAX_ASSERTS",
    "ChainTaskScores",
    "assert_lines",
    "generated_test_programs",
    "implementation_program",
    "score_chain_tasks",
]

#: At most this many generated asserts are run per problem (a model may loop on asserts).
MAX_ASSERTS = 16


@dataclass(frozen=True)
class ChainTaskScores:
    """Per-problem task outcomes of one chain run."""

    implementation_passed: tuple[bool, ...]
    tests_passed: tuple[int, ...]
    tests_total: tuple[int, ...]

    @property
    def pass_at_1(self) -> float:
        """Share of problems whose generated body passes the reference tests."""
        n = len(self.implementation_passed)
        return sum(self.implementation_passed) / n if n else 0.0

    @property
    def test_share(self) -> float:
        """Generated asserts that pass on the reference, over all generated asserts."""
        total = sum(self.tests_total)
        return sum(self.tests_passed) / total if total else 0.0


def implementation_program(signature: str, body: str, tests: str) -> str:
    """Signature and docstring, the generated body, then the reference tests."""
    return signature + body.rstrip() + "\n" + tests


def assert_lines(generated_tests: str) -> list[str]:
    """The generated ``assert`` statements (one per line), at most :data:`MAX_ASSERTS`."""
    lines = [line.strip() for line in generated_tests.splitlines()]
    return [line for line in lines if line.startswith("assert ")][:MAX_ASSERTS]


def generated_test_programs(reference_function: str, generated_tests: str) -> list[str]:
    """One program per generated assert: the reference function, then that assert."""
    return [reference_function + "\n" + line + "\n" for line in assert_lines(generated_tests)]


def score_chain_tasks(
    items: Sequence[ChainItem],
    bodies: Sequence[str],
    generated_tests: Sequence[str],
    *,
    signatures: Sequence[str] | None = None,
    max_workers: int = 2,
    **limits: Unpack[LimitOptions],
) -> ChainTaskScores:
    """Run the implementation and generated-test checks for each chain item.

    ``bodies[k]`` is the ``implement`` stage's output for ``items[k]``, under
    ``signatures[k]`` (the signature it was given: the ``specify`` stage's output in a
    chained run; the reference signature by default). ``generated_tests[k]`` is the
    ``test`` stage's output; it is checked against the reference function.
    """
    n = len(items)
    if (
        len(bodies) != n
        or len(generated_tests) != n
        or (signatures is not None and len(signatures) != n)
    ):
        raise ValueError("items, bodies, generated tests and signatures must have one length")
    programs: list[str] = []
    for k, item in enumerate(items):
        signature = signatures[k] if signatures is not None else item.artefacts[1]
        programs.append(implementation_program(signature, bodies[k], item.problem.tests))
    per_item_tests: list[list[str]] = []
    for k, item in enumerate(items):
        reference = item.problem.prompt + item.problem.reference
        per_item_tests.append(generated_test_programs(reference, generated_tests[k]))
    flat = [p for tests in per_item_tests for p in tests]
    results = run_many(programs + flat, max_workers=max_workers, **limits)
    implemented = tuple(r.passed for r in results[:n])
    offset = n
    passed: list[int] = []
    for tests in per_item_tests:
        passed.append(sum(r.passed for r in results[offset : offset + len(tests)]))
        offset += len(tests)
    return ChainTaskScores(
        implementation_passed=implemented,
        tests_passed=tuple(passed),
        tests_total=tuple(len(t) for t in per_item_tests),
    )
