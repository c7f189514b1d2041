"""``peerlm bench cpm-group-arm``: pair vs group co-sender scoring on a synthetic federation.

A small, seeded world where the value of a merge lies in its *group* of senders, to check
that ``co_sender_scoring="group"`` can learn what ``"pair"`` cannot (docs/matchmaker.md,
"Group scoring"). It runs the real :class:`Matchmaker` (``select`` with capabilities,
``observe``); only the reward is synthetic.

The world: ``specialists`` agents of skill A (profile ``[1, 0, z1, z2]``) and as many of
skill B (``[0, 1, z1, z2]``), and ``students`` agents; ``z`` is a fixed per-agent
identity in ``[-0.3, 0.3]``. Every agent executes ``svd_hka`` in one parameter space; a
student's overlay list names every specialist, a specialist's names nobody, so each
merge directive is specialist(s) -> student and its co-senders are specialists. A
directive's reward is its value ``v`` plus Gaussian noise (sd ``noise``); the figure
reported is ``v`` (the expected reward), averaged over each round's directives. Two
scenarios:

* ``mix``: students are ``[0.5, 0.5, z1, z2]`` (they need both skills) and
  ``v = 1 - |m_A - 0.5| - |m_B - 0.5|`` with ``m`` the mean skill profile of the
  directive's senders: 1 for a teacher with a co-sender of the other skill, 0 for two
  of the same (``merge_senders = 2``). Under the group context this ``v`` is linear in
  ``|p_G - p_r|``, so the group arm can represent it exactly: the scenario shows the
  mechanism learns, not that real merges have this form.
* ``diversity``: students are ``[0, 0, z1, z2]`` (their profile says nothing about the
  skills) and ``v = 1`` when the senders hold both skills, else 0. The mean profile of an
  {A, B} group is the average of those of {A, A} and {B, B}, so no linear function of
  the group context ranks it above both: the negative control, where "group" should not
  beat "pair" (what the mean cannot express).

Reference: a co-sender drawn at random among the other specialists is of the other skill
with probability 4/7 (``v`` = 0.57 at the default sizes, both scenarios); 1.0 is
the best possible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import scipy.stats
from numpy.typing import NDArray
from peerlm.services.cpm import Capabilities, Matchmaker

from peerlm.protocols import SVD_HKA

__all__ = ["GroupArmRun", "compare", "render_report", "report_lines", "run_group_arm"]

Scenario = Literal["mix", "diversity"]
Scoring = Literal["pair", "group"]
_PROFILE_DIM = 4


@dataclass(frozen=True)
class GroupArmRun:
    """One (scenario, scoring, seed) run: the mean value of each round's directives and
    the share of directives whose senders held both skills."""

    values: list[float]
    covered: list[float]


def _world(
    scenario: Scenario, specialists: int, students: int, seed: int
) -> tuple[dict[str, NDArray[np.float64]], dict[str, Capabilities], dict[str, int]]:
    """Profiles, capabilities and skill (0: A, 1: B, -1: student) of every agent."""
    rng = np.random.default_rng([seed, 1])
    profiles: dict[str, NDArray[np.float64]] = {}
    skill: dict[str, int] = {}
    for k in range(2 * specialists):
        name = f"s{k:02d}"
        skill[name] = k % 2
        profiles[name] = np.array([1.0 - k % 2, float(k % 2), *rng.uniform(-0.3, 0.3, 2)])
    for k in range(students):
        name = f"t{k:02d}"
        skill[name] = -1
        mix = 0.5 if scenario == "mix" else 0.0
        profiles[name] = np.array([mix, mix, *rng.uniform(-0.3, 0.3, 2)])
    senders = frozenset(a for a, s in skill.items() if s >= 0)
    caps = {
        a: Capabilities("ps", (SVD_HKA.name,), senders if s < 0 else frozenset())
        for a, s in skill.items()
    }
    return profiles, caps, skill


def _value(
    scenario: Scenario,
    group: Sequence[str],
    profiles: dict[str, NDArray[np.float64]],
    skill: dict[str, int],
) -> float:
    """The expected reward of a merge directive whose senders are ``group``."""
    if scenario == "diversity":
        return 1.0 if {skill[a] for a in group} == {0, 1} else 0.0
    m = np.mean([profiles[a][:2] for a in group], axis=0)
    return float(1.0 - np.abs(m - 0.5).sum())


def run_group_arm(
    scenario: Scenario,
    scoring: Scoring,
    seed: int,
    *,
    rounds: int = 60,
    specialists: int = 4,
    students: int = 4,
    merge_senders: int = 2,
    noise: float = 0.1,
    beta: float = 1.0,
) -> GroupArmRun:
    """One seeded run of the real matchmaker on the synthetic world."""
    profiles, caps, skill = _world(scenario, specialists, students, seed)
    m = Matchmaker(
        _PROFILE_DIM,
        beta=beta,
        protocols=(SVD_HKA.name,),
        seed=seed,
        merge_senders=merge_senders,
        co_sender_scoring=scoring,
    )
    rng = np.random.default_rng([seed, 2])
    values: list[float] = []
    covered: list[float] = []
    for _ in range(rounds):
        pairings = m.select(profiles, caps)
        if not pairings:
            raise ValueError("the synthetic world produced no pairing")
        vs, cs = [], []
        for p in pairings:
            group = [p.sender, *p.co_senders]
            v = _value(scenario, group, profiles, skill)
            vs.append(v)
            cs.append(float({skill[a] for a in group} == {0, 1}))
            m.observe(p, v + float(rng.normal(0.0, noise)))
        values.append(float(np.mean(vs)))
        covered.append(float(np.mean(cs)))
    return GroupArmRun(values, covered)


Progress = Callable[[str, int, int], None]


def compare(
    scenarios: Sequence[Scenario] = ("mix", "diversity"),
    seeds: int = 10,
    *,
    rounds: int = 60,
    progress: Progress | None = None,
    **world: Any,
) -> dict[str, Any]:
    """Both scorings on each scenario over ``seeds`` seeds. Per scenario and metric: the
    mean over the second half of the rounds (after learning) per seed, its mean over seeds
    per scoring and the paired difference group - pair, each with a 95% percentile
    bootstrap interval over seeds (the independent units; the rounds of one run are not),
    plus the per-seed means."""
    out: dict[str, Any] = {"seeds": seeds, "rounds": rounds, "world": world, "scenarios": {}}
    late = slice(rounds // 2, rounds)
    total, done = 2 * len(scenarios) * seeds, 0
    for scenario in scenarios:
        runs: dict[str, list[GroupArmRun]] = {"pair": [], "group": []}
        for scoring in ("pair", "group"):
            for seed in range(seeds):
                runs[scoring].append(
                    run_group_arm(scenario, scoring, seed, rounds=rounds, **world)  # type: ignore[arg-type]
                )
                done += 1
                if progress is not None:
                    progress(f"{scenario}/{scoring}", done, total)
        report: dict[str, Any] = {}
        for metric in ("values", "covered"):
            per_seed = {
                s: np.array([np.mean(getattr(r, metric)[late]) for r in runs[s]]) for s in runs
            }
            report[metric] = {
                "pair": _estimate(per_seed["pair"]),
                "group": _estimate(per_seed["group"]),
                "group_minus_pair": _estimate(per_seed["group"] - per_seed["pair"]),
                "per_seed": {s: per_seed[s].round(4).tolist() for s in per_seed},
            }
        out["scenarios"][scenario] = report
    return out


def _estimate(values: NDArray[np.float64]) -> dict[str, Any]:
    """Mean and 95% percentile bootstrap interval over seeds (scipy.stats.bootstrap; fixed
    seed, so a report is reproducible). One seed: the interval is the point."""
    mean = float(np.mean(values))
    if len(values) < 2 or float(np.ptp(values)) == 0.0:
        return {"mean": mean, "ci95": [mean, mean]}
    ci = scipy.stats.bootstrap(
        (values,), np.mean, method="percentile", n_resamples=4000, random_state=12345
    ).confidence_interval
    return {"mean": mean, "ci95": [float(ci.low), float(ci.high)]}


def render_report(result: dict[str, Any], console: Any) -> None:
    """The comparison as plain lines on ``console`` (a rich ``Console``)."""
    for line in report_lines(result):
        console.print(line, highlight=False, soft_wrap=True)


def report_lines(result: dict[str, Any]) -> list[str]:
    """The comparison as plain lines."""

    def fmt(e: dict[str, Any]) -> str:
        lo, hi = e["ci95"]
        return f"{e['mean']:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = [
        f"pair vs group co-sender scoring: {result['seeds']} seeds, {result['rounds']} rounds, "
        "second half of the rounds (95% bootstrap over seeds; group-pair paired by seed)"
    ]
    for scenario, rep in result["scenarios"].items():
        v, c = rep["values"], rep["covered"]
        lines.append(
            f"{scenario:9s} value: pair {fmt(v['pair'])}  group {fmt(v['group'])}  "
            f"group-pair {fmt(v['group_minus_pair'])}"
        )
        lines.append(
            f"{'':9s} both skills: pair {fmt(c['pair'])}  group {fmt(c['group'])}  "
            f"group-pair {fmt(c['group_minus_pair'])}"
        )
    return lines
