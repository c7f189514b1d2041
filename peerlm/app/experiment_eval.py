"""What the experiment measures of a client: the test NLL curve, validation pass@1 and
competence, the probe loss, the final evaluation (sampled pass@1, structural match, NLL)
and the run's record built from it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from peerlm.app.experiment_plan import Event
from peerlm.app.experiment_slices import SLICES
from peerlm.app.experiment_world import Client, World

if TYPE_CHECKING:
    from peerlm.agent import AnswerCheck, CheckedAnswers, Competence, Problem


__all__ = ["final_eval", "finish_run", "nll_on_test", "probe_loss", "slice_means", "validate"]


def nll_on_test(world: World, client: Client) -> list[float]:
    from peerlm.agent import reference_nll

    return client.routed(world.test, lambda ps: reference_nll(client.host, ps), key="test-nll")


def slice_means(world: World, per_client: Mapping[int, Sequence[float]]) -> dict[str, float]:
    """Mean of a per-(client, problem) value over each non-empty slice's units."""
    out: dict[str, float] = {}
    for name in SLICES:
        units = world.units(name)
        if units:
            out[name] = float(np.mean([per_client[i][j] for i, j in units]))
    return out


def final_eval(world: World, client: Client, seed: int) -> dict[str, Any]:
    from peerlm.agent import (
        reference_nll,
        sample_completions,
        score_completions,
        structural_match_rate,
    )

    plan = world.plan

    def sample(problems: Sequence[Problem]) -> list[list[str]]:
        got = sample_completions(
            client.host,
            problems,
            max_new_tokens=plan.max_new_tokens,
            n=plan.samples,
            temperature=plan.sample_temperature,
            seed=seed,
        )
        return [got[p.task_id] for p in problems]

    drawn = f"sample|{seed}|{plan.samples}|{plan.sample_temperature}|{plan.max_new_tokens}"
    checks = _AnswerChecks(plan.answer_check)
    answers = client.routed(world.test, sample, key=drawn, choose=checks)
    completions = {p.task_id: a for p, a in zip(world.test, answers, strict=True)}
    known = client.memo.outcomes if client.memo is not None else {}
    report = score_completions(world.test, completions, ks=(1,), known=known)
    passed = [r.pass_at[1] for r in report.problems]
    # Which test problems the router sent to the peer slot (1; the answer check may still
    # have kept the own adapter's answer); the router never sees the test set's categories.
    peer = _peer_routes(client, world.test)
    out = {
        "arch": client.arch,
        "pass@1": passed,
        # Each answer_check policy's pass@1 from the same answers (the plan's is "pass@1"),
        # and how many routed answers the plan's policy took from the own adapter.
        "answer_checks": checks.pass_at_1(world.test, passed, known),
        "answers_from_own": checks.from_own,
        "struct": [structural_match_rate(p, completions[p.task_id]) for p in world.test],
        "nll": nll_on_test(world, client),
        # The probe set's NLL (not test data): what "best" is chosen by.
        "probe_nll": client.routed(
            world.probe, lambda ps: reference_nll(client.host, ps), key="probe-nll"
        ),
        "status_counts": dict(report.status_counts),
        "peer_routed": peer,
        "own_steps": client.own_steps,
        "peer_steps": client.peer_steps,
        "self_checked": client.self_checked,
        "self_check_failed": client.self_check_failed,
        "peer_integrations": client.slot.integrations,
        # Integrations written to each of the slot's banks (one, "", without slot_banks).
        "peer_banks": dict(sorted(client.slot.writes.items())),
    }
    # Evaluations of the own adapter not computed again (the curve's and these): taken from
    # LocalOnly+'s record in a run that replays it, or from the same run's earlier one of
    # the same adapter (LocalOnly+'s final test NLL is its last curve point).
    out["own_reused"] = client.memo.reused if client.memo is not None else 0
    return out


class _AnswerChecks:
    """``route_map``'s ``choose`` for the final evaluation: the plan's ``answer_check``
    over the routed problems' answers, keeping what the check saw so that every policy's
    pass@1 follows from the same answers (:mod:`peerlm.agent.exchange.answer_check`)."""

    def __init__(self, policy: AnswerCheck) -> None:
        self.policy = policy
        self.from_own = 0
        self.seen: tuple[list[Problem], list[list[str]], list[list[str]], CheckedAnswers] | None
        self.seen = None

    def __call__(
        self,
        problems: Sequence[Problem],
        own: Sequence[Sequence[str]],
        peer: Sequence[Sequence[str]],
    ) -> list[list[str]]:
        from peerlm.agent import check_answers, example_verdicts

        def verdicts(prompts: Sequence[str], answers: Sequence[str]) -> list[bool | None]:
            return example_verdicts(prompts, answers, max_workers=1)

        # Every policy is checked (not only the plan's): the run is its own ablation.
        checked = check_answers("peer_first", [p.prompt for p in problems], own, peer, verdicts)
        picks = checked.picks(self.policy)
        self.from_own = sum(not take for takes in picks for take in takes)
        self.seen = ([*problems], [list(a) for a in own], [list(a) for a in peer], checked)
        return checked.pick(picks, own, peer)

    def pass_at_1(
        self, test: Sequence[Problem], passed: Sequence[float], known: dict[str, Any]
    ) -> dict[str, list[float]]:
        """Per policy, pass@1 per test problem: the plan's ``passed`` where nothing was
        routed or the policy answers the same, the others scored (``known`` reused)."""
        from peerlm.agent import ANSWER_CHECKS, score_completions

        out = {str(policy): list(passed) for policy in ANSWER_CHECKS}
        if self.seen is None:
            return out
        problems, own, peer, checked = self.seen
        index = {p.task_id: j for j, p in enumerate(test)}
        mine = checked.picks(self.policy)
        for policy in ANSWER_CHECKS:
            picks = checked.picks(policy)  # type: ignore[arg-type]
            if policy == self.policy or picks == mine:
                continue
            answers = checked.pick(picks, own, peer)
            report = score_completions(
                problems,
                {p.task_id: a for p, a in zip(problems, answers, strict=True)},
                ks=(1,),
                known=known,
            )
            for r in report.problems:
                out[policy][index[r.task_id]] = r.pass_at[1]
        return out


def _peer_routes(client: Client, problems: Sequence[Problem]) -> list[int]:
    """Per problem, 1 if the peer slot answers it, else 0."""
    if client.router is None or not client.slot.ready:
        return [0] * len(problems)
    return [int(x) for x in client.router.to_peer([p.prompt for p in problems])]


def probe_loss(client: Client, examples: Sequence[tuple[str, str]]) -> float:
    """Mean loss of ``examples`` on the model that answers them (each routed)."""
    losses = client.routed(
        [_Prompted(p, r) for p, r in examples],
        lambda xs: [client.host.eval_loss([(x.prompt, x.reference)])[0] for x in xs],
    )
    return float(np.mean(losses)) if losses else 0.0


@dataclass(frozen=True)
class _Prompted:
    prompt: str
    reference: str


def validate(world: World, c: Client) -> tuple[float, Competence]:
    """Greedy pass@1 of ``c``'s own adapter on its validation problems, and per category
    (what it may teach)."""
    from peerlm.agent import competence_of, sample_completions, score_completions

    plan = world.plan
    val = c.val[: plan.val_limit] if plan.val_limit else c.val
    completions = sample_completions(c.host, val, max_new_tokens=plan.max_new_tokens)
    report = score_completions(val, completions)
    competence = competence_of((r.category, r.c, r.n) for r in report.problems)
    return report.mean.get(1, 0.0), competence


def finish_run(
    world: World,
    clients: Sequence[Client],
    strategy: str,
    seed: int,
    rounds: list[dict[str, Any]],
    curve: Mapping[str, list[float]],
    started: float,
    event: Event,
    **extra: Any,
) -> dict[str, Any]:
    """The final evaluation of every client and the run's record (every strategy's)."""
    final = {c.name: final_eval(world, c, seed * 1_000 + i) for i, c in enumerate(clients)}
    event("final", {"strategy": strategy, "seed": seed})
    rewards = [x["reward"] for r in rounds for x in r["exchanges"] if "reward" in x]
    return {
        "strategy": strategy,
        "seed": seed,
        "clients": final,
        "curve_nll": curve,
        "exchanges": sum(len(r["exchanges"]) for r in rounds),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "kilobytes": round(sum(x["kilobytes"] for r in rounds for x in r["exchanges"]), 2),
        "rounds": rounds,
        **extra,
        "seconds": round(time.perf_counter() - started, 1),
    }
