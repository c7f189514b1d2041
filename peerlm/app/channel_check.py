"""Can a skill travel? One warmed-up expert teaches one student that lacks its skill by AKD.

``python -m peerlm.app.channel_check --teacher 2 --student 0 --prompts 96 --steps 48,96``
lays out the experiment's world (:class:`~peerlm.app.experiment.ExperimentPlan`'s defaults,
world seed ``--world-seed``), warms every client up as the experiment does, takes the
teacher's private category, draws ``--prompts`` fresh prompts of it (none in the data, the
test set or the pre-training corpus; 0: the category's prompts in X_u), and has the student
integrate the teacher's greedy completions of them by AKD (``ModelHost.train_akd``, weight
``--alpha`` on the teacher's text) for each of ``--steps`` optimiser steps, from the same
start. Pass@1 and structural match on the category's test problems (``--samples`` at T 0.8)
are reported for the teacher, the student before, and the student after each budget.

It measures the channel's capacity, the figures behind the experiment's X_u size
(docs/experiment.md, "The configurations"); it is a diagnostic, not part of the federation.
Few test problems: read it as a direction, not as a figure with an interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _measure(host: Any, problems: list[Any], samples: int) -> dict[str, float]:
    from peerlm.agent import sample_completions, score_completions, structural_match_rate

    completions = sample_completions(
        host, problems, max_new_tokens=64, n=samples, temperature=0.8, seed=1
    )
    report = score_completions(problems, completions, ks=(1,))
    struct = [structural_match_rate(p, completions[p.task_id]) for p in problems]
    return {
        "pass@1": round(report.mean.get(1, 0.0), 4),
        "struct": round(sum(struct) / max(1, len(struct)), 4),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the check; prints one JSON object."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--teacher", type=int, default=2)
    parser.add_argument("--student", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=96, help="0: the category's X_u.")
    parser.add_argument("--steps", default="48,96", help="AKD step budgets, comma-separated.")
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--world-seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--size", choices=("tiny", "micro"), default="tiny")
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=Path("state/channel-check"))
    args = parser.parse_args(argv)
    if args.teacher == args.student:
        parser.error("--teacher and --student must differ")
    budgets = [int(x) for x in args.steps.split(",") if x.strip()]
    if not budgets or min(budgets) < 1:
        parser.error("--steps needs positive step counts")

    import torch

    torch.set_num_threads(1)
    from peerlm.agent import TrainSettings, probe_problems, read_jsonl, teacher_completions
    from peerlm.app.cli_models import models_cache_dir
    from peerlm.app.experiment_plan import ExperimentPlan
    from peerlm.app.experiment_world import build_clients, prepare_world, warm_up

    started = time.perf_counter()
    plan = ExperimentPlan(strategies=("local",), seeds=(0,), world_seed=args.world_seed,
                             size=args.size)  # fmt: skip
    models = args.models_dir or models_cache_dir(args.size)
    world = prepare_world(plan, models, args.work_dir / "data", lambda _k, _d: None)
    world.warm = warm_up(world, lambda _k, _d: None)
    clients = build_clients(world, 0)
    teacher, student = clients[args.teacher], clients[args.student]
    [category] = sorted(world.slices[args.teacher].to_dict()["own"])[:1]
    if category in world.slices[args.student].to_dict()["own"]:
        parser.error(f"the student already holds {category!r}")
    transfer = read_jsonl(args.work_dir / "data" / "transfer.jsonl")
    if args.prompts:
        taken = [*world.test, *transfer, *(p for tr, va in world.clients_data for p in (*tr, *va))]
        fresh = probe_problems(args.prompts, args.world_seed + 4_242, taken, [category])
        prompts = [p.prompt for p in fresh][: args.prompts]
    else:
        prompts = [p.prompt for p in transfer if p.category == category]
    test = [p for p in world.test if p.category == category]
    completions = teacher_completions(teacher.host, prompts, plan.max_new_tokens)
    pairs = [(p, c) for p, c in zip(prompts, completions, strict=True) if c.strip()]
    out: dict[str, Any] = {
        "category": category,
        "teacher": {"arch": teacher.arch, **_measure(teacher.host, test, args.samples)},
        "student": {"arch": student.arch},
        "prompts": len(prompts),
        "test_problems": len(test),
        "alpha": args.alpha,
        "before": _measure(student.host, test, args.samples),
        "after": {},
    }
    start = student.host.adapter_state()
    for steps in budgets:
        student.host.load_adapter_state(start)
        settings = TrainSettings(learning_rate=plan.learning_rate,
                                 grad_accumulation=plan.grad_accumulation, seed=5)  # fmt: skip
        student.host.train_akd(student.train_examples, pairs, args.alpha, settings, steps=steps)
        out["after"][str(steps)] = _measure(student.host, test, args.samples)
    out["seconds"] = round(time.perf_counter() - started, 1)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
