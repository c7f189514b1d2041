"""FedProxy's cohort rounds as a protocol core with no I/O: who delivered, when it ends.

The owner opens round ``t`` when it publishes the proxy ``φ^(t−1)`` (rounds count from 1;
Algorithm 1's ``t``), then collects the members' trained proxies until every member has
delivered or the deadline passed, and merges what arrived. :class:`CohortRound` is that
bookkeeping, fed the clock and the events (an update arrived, an update was refused),
answering what to ask next, whether the round is over and, at the end, the
:class:`RoundOutcome`: who is merged, who was missing and why. The transports
(:mod:`peerlm.agent.fedproxy.service`, :mod:`peerlm.agent.fedproxy.owner`) do the I/O.

:func:`round_answer` is the rule both servers use for a request naming a round: the
current one is served, the next one is waited for (a member asks for round ``t + 1``
while the owner is still merging ``t``; the owner asks for a member's update while it is
still training), anything else does not exist.

Every refusal is a :class:`RoundError` whose ``reason`` is a metric label.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CohortRound", "RoundAnswer", "RoundError", "RoundOutcome", "round_answer"]


class RoundError(ValueError):
    """An event the round cannot take: ``reason`` is ``not_in_cohort``, ``round``,
    ``duplicate``, ``closed`` or ``late``; the round's state is unchanged."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RoundAnswer(enum.Enum):
    """What a server does with a request for a round."""

    SERVE = "serve"
    WAIT = "wait"
    NOT_FOUND = "not_found"


def round_answer(wanted: int, current: int, *, horizon: int | None = 1) -> RoundAnswer:
    """``wanted`` (>= 1) against the ``current`` round the server holds (0: none yet).

    The current round is served; a later one up to ``horizon`` rounds ahead (None: any) is
    waited for; an older one or one further ahead does not exist. The owner waits one round
    ahead (its next publication); a member any (it may have missed rounds and will train the
    one it pulls next), since only the owner, who knows the round, asks it.
    """
    if wanted < 1:
        raise ValueError(f"a round is >= 1, got {wanted}")
    if current >= 1 and wanted == current:
        return RoundAnswer.SERVE
    if wanted > current and (horizon is None or wanted - current <= horizon):
        return RoundAnswer.WAIT
    return RoundAnswer.NOT_FOUND


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended: the members merged (``arrived``, sorted), those missing
    (``missing``: no update by the deadline; ``refused``: member -> reason its update was
    refused), and whether the deadline ended it (else everyone answered)."""

    round: int
    arrived: tuple[str, ...]
    missing: tuple[str, ...]
    refused: dict[str, str]
    deadline_passed: bool

    @property
    def complete(self) -> bool:
        """Every member's update arrived and was merged."""
        return not self.missing and not self.refused


class CohortRound:
    """One round's collection at the owner: ``cohort`` members, opened at ``opened_at`` (the
    caller's clock, seconds), closing ``deadline_s`` later at the latest."""

    def __init__(
        self, round_: int, cohort: Iterable[str], *, opened_at: float, deadline_s: float
    ) -> None:
        members = frozenset(cohort)
        if round_ < 1:
            raise ValueError(f"a round is >= 1, got {round_}")
        if not members:
            raise ValueError("a cohort round needs at least one member")
        if not (math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.round = round_
        self.cohort = members
        self.deadline = opened_at + deadline_s
        self._arrived: set[str] = set()
        self._refused: dict[str, str] = {}
        self._closed: RoundOutcome | None = None

    # ------------------------------------------------------------------ queries

    def pending(self) -> tuple[str, ...]:
        """Members still to ask (neither delivered nor refused), sorted."""
        return tuple(sorted(self.cohort - self._arrived - set(self._refused)))

    def remaining(self, now: float) -> float:
        """Seconds until the deadline (0 once passed)."""
        return max(0.0, self.deadline - now)

    def done(self, now: float) -> bool:
        """Whether the round is over: every member answered, or the deadline passed."""
        return not self.pending() or now >= self.deadline

    # ------------------------------------------------------------------ events

    def _check(self, member: str, round_: int, now: float) -> None:
        if self._closed is not None:
            raise RoundError(f"round {self.round} is closed", reason="closed")
        if member not in self.cohort:
            raise RoundError(f"{member!r} is not in the cohort", reason="not_in_cohort")
        if round_ != self.round:
            raise RoundError(f"update of round {round_} during round {self.round}", reason="round")
        if member in self._arrived or member in self._refused:
            raise RoundError(f"{member!r} already answered round {self.round}", reason="duplicate")
        if now >= self.deadline:
            raise RoundError(f"{member!r}'s update came after the deadline", reason="late")

    def deliver(self, member: str, round_: int, now: float) -> None:
        """``member``'s valid update of ``round_`` arrived at ``now``: it will be merged."""
        self._check(member, round_, now)
        self._arrived.add(member)

    def refuse(self, member: str, round_: int, now: float, reason: str) -> None:
        """``member``'s update of ``round_`` was refused (``reason``: the decoder's label);
        it counts as missing, and is not asked again this round."""
        self._check(member, round_, now)
        self._refused[member] = reason

    def close(self, now: float) -> RoundOutcome:
        """End the round (only when :meth:`done`); later events are refused (``closed``).
        Idempotent: closing again returns the same outcome."""
        if self._closed is not None:
            return self._closed
        if not self.done(now):
            raise RoundError(
                f"round {self.round} still waits for {list(self.pending())} "
                f"for {self.remaining(now):.1f} s",
                reason="open",
            )
        self._closed = RoundOutcome(
            round=self.round,
            arrived=tuple(sorted(self._arrived)),
            missing=self.pending(),
            refused=dict(sorted(self._refused.items())),
            deadline_passed=bool(self.pending()),
        )
        return self._closed
