"""Plain records the CPM keeps: profiles and the directive ledger."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DirectiveRecord",
    "DirectiveStatus",
    "ProfileRecord",
    "RewardRecord",
    "SpaceDisproof",
]


class DirectiveStatus(StrEnum):
    OPEN = "open"
    REWARDED = "rewarded"
    EXPIRED = "expired"


@dataclass(frozen=True)
class ProfileRecord:
    """The latest profile an agent submitted."""

    agent: str
    round: int
    features: NDArray[np.float64]
    endpoint: str
    received_at: float
    #: The parameter-space fingerprint the agent declared ("" undeclared; .menu).
    param_space: str = ""
    #: The protocols it executes (() means akd only; .menu.Capabilities).
    protocols: tuple[str, ...] = ()
    #: Its reported overlay top-K (() not reported; .menu, "overlay narrowing").
    overlay_peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class RewardRecord:
    """What the receiver of a directive reported, and what the bandit learned from it."""

    reward: float
    normalised: float
    loss_pre: float
    loss_post: float
    kilobytes: int
    rewarded_at: float
    #: Why the student refused the directive (:mod:`.refusals`); "" for a reward. For a
    #: refusal, ``reward`` is the configured refusal reward the bandit learnt.
    failure: str = ""


@dataclass(frozen=True)
class DirectiveRecord:
    """One pairing directive: single-use id, the pair, and the context the bandit scored."""

    directive_id: str
    matchmaking_round: int
    protocol: str
    role: str
    teacher: str
    student: str
    teacher_endpoint: str
    student_endpoint: str
    context: NDArray[np.float64]
    ucb: float
    issued_at: float
    expires_at: float
    status: DirectiveStatus = DirectiveStatus.OPEN
    reward: RewardRecord | None = None
    #: Further senders of a merge directive, ``(name, endpoint)``, best UCB first
    #: (``merge_senders``); ``()`` for a one-sender directive. The reward and ``context``
    #: stay the teacher's, or are the group's under ``co_sender_scoring="group"``.
    co_senders: tuple[tuple[str, str], ...] = ()

    def with_status(
        self, status: DirectiveStatus, reward: RewardRecord | None = None
    ) -> DirectiveRecord:
        return replace(self, status=status, reward=reward)


@dataclass(frozen=True)
class SpaceDisproof:
    """A student's proof that a sender's adapter is not of the fingerprint it declared.

    ``sender`` declared ``param_space`` when ``student`` reported, with the reward of
    ``directive_id``, that the adapter it pulled from ``sender`` did not fit its own space
    (docs/matchmaker.md, "The fingerprint").
    """

    sender: str
    param_space: str
    student: str
    directive_id: str
    reported_at: float
