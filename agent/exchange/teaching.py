"""What a teacher teaches: the prompts of X_u on which it has evidence of competence.

KNEXA-FL (Eq. 2) has the teacher answer *every* prompt of the transfer set X_u. On a ground
where skills are private and complementary most of X_u belongs to categories the
teacher never saw: measured on the experiment's world (seed 0, warmed-up experts, 416
prompts), 288 of the 416 greedy completions a teacher sends are of other clients' private
categories, and 5 of those 864 (three teachers) pass their tests, while the teacher's own
category passes 50-64 % for the two teachers that learnt theirs. The student then spends
about three quarters of its AKD steps learning wrong code, including wrong code for *its
own* skill, which is what the first measured run showed (own-skill Pass@1 36 % → 20 %,
lacked-skill Pass@1 flat; docs/experiment.md).

Neither signal a teacher or student has for free separates the two on these models: the
teacher's own per-byte confidence ranks the other clients' categories above its own for
two of three teachers, and the student's surprisal ranks its own skill (the teacher's wrong
answers) as high as the teacher's. What does separate them is the evidence every agent
already measures each round: pass@1 of its greedy completions on its *own validation
problems*, per category. So (our choice beyond the paper, ``teach_scope="competent"``) a
teacher answers only the prompts of categories where the Wilson lower bound of its
validation pass@1 is at least ``min_pass``; a category absent from its validation data is
one it has no evidence for and is not taught. ``teach_scope="all"`` is the paper's rule.

The scope is the teacher's decision about its own package (a package may answer any subset
of X_u; the wire format is unchanged), it reveals nothing the package does not (which
prompts are answered), and it costs nothing extra: the validation pass@1 is the profile's
measurement, and fewer prompts mean less generation and fewer bytes (Eq. 3's KB penalty).
The Wilson interval is written out here (three lines) rather than taken from SciPy, which
the agent does not otherwise import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Competence",
    "TeachScope",
    "competence_of",
    "teachable_indices",
    "wilson_lower_bound",
]

#: ``"competent"``: categories with evidence of skill (module docstring); ``"all"``: X_u whole.
TeachScope = Literal["competent", "all"]
_Z95 = 1.959963984540054


def wilson_lower_bound(passed: int, n: int, z: float = _Z95) -> float:
    """The lower end of the Wilson score interval of ``passed`` successes in ``n`` trials.

    0 for ``n == 0`` (no evidence). Wilson rather than the normal approximation because
    validation sets per category are small (1-40 problems) and the rates near 0.
    """
    if n < 0 or passed < 0 or passed > n:
        raise ValueError(f"need 0 <= passed <= n, got passed={passed}, n={n}")
    if n == 0:
        return 0.0
    p = passed / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


@dataclass(frozen=True)
class Competence:
    """Greedy validation pass counts per category: ``{category: (passed, problems)}``."""

    counts: Mapping[str, tuple[int, int]]

    def categories(self, min_pass: float) -> frozenset[str]:
        """Categories whose Wilson lower bound of pass@1 is at least ``min_pass``."""
        return frozenset(
            c for c, (k, n) in self.counts.items() if n > 0 and wilson_lower_bound(k, n) >= min_pass
        )

    def to_dict(self) -> dict[str, list[int]]:
        """JSON-ready ``{category: [passed, problems]}`` (checkpoints, reports)."""
        return {c: [k, n] for c, (k, n) in sorted(self.counts.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[int]]) -> Competence:
        """The inverse of :meth:`to_dict`; raises ``ValueError`` on counts that make no sense."""
        counts: dict[str, tuple[int, int]] = {}
        for category, pair in data.items():
            k, n = (int(x) for x in pair)
            if not 0 <= k <= n:
                raise ValueError(f"competence of {category!r}: bad counts {pair!r}")
            counts[str(category)] = (k, n)
        return cls(counts)


def competence_of(results: Iterable[tuple[str, int, int]]) -> Competence:
    """Per-category counts from ``(category, passed samples, samples)`` per problem.

    A problem counts as passed when its greedy sample passed (``passed == samples``, which
    for the usual one greedy sample is simply "it passed").
    """
    counts: dict[str, list[int]] = {}
    for category, c, n in results:
        entry = counts.setdefault(category, [0, 0])
        entry[0] += int(n > 0 and c == n)
        entry[1] += 1
    return Competence({k: (v[0], v[1]) for k, v in counts.items()})


def teachable_indices(
    prompt_categories: Sequence[str],
    competence: Competence | None,
    *,
    scope: TeachScope,
    min_pass: float,
) -> list[int]:
    """Indices of the X_u prompts this teacher answers.

    ``"all"``, or ``"competent"`` before any measurement (``competence`` None: the first
    round of an agent that evaluates less often than it teaches), answer every prompt.
    """
    if scope == "all" or competence is None:
        return list(range(len(prompt_categories)))
    known = competence.categories(min_pass)
    return [i for i, c in enumerate(prompt_categories) if c in known]
