"""Where a restarted FedWave expert resumes: the round it plays next, and whether it first
rolls back to an older checkpoint of its own. Pure: the caller asks the workflow's agents
(``DescribeWorkflow``) and loads the checkpoint.

Every agent says (``DescribeWorkflow``) the last round it concluded once its checkpoint is
loaded, and the round it is *playing* once it has decided (a fresh start: 1; a restart:
the round this module chose; then each round as it starts). An agent that says a playing
round is *running*. Two situations look alike from inside one agent and need different
answers:

* **One agent restarted, the others went on** (a crash, a redeploy): some agents are
  running. The restarted agent joins the largest round they play; the rounds it missed are
  skipped (its router equals theirs again from the first round they all conclude over the
  same set: Eq. 9 over the same trained routers gives the same bits).
* **The whole workflow restarted together** (``peerlm up --workflow --resume``, a host
  reboot): nobody is running yet; each restored the checkpoint of the last round *it*
  concluded, and a stop lands at a different point of each agent's round, so they may be a
  round apart. They agree on the smallest concluded round m among them and all play
  m + 1: an agent ahead rolls back to its checkpoint of m (it keeps the last three). If
  round m was complete for all (the usual case), they hold the same router again. Without
  the agreement, each would play its own next round and lose a deadline per round until
  the phase slipped back. An agent that restarts after the others decided sees them
  running and joins their round.

Nothing is played past the workflow's last round (``last_round``): an agent that would
resume after it (every agent had concluded the last round: a stop during the assembly)
replays the last round from its checkpoint of the one before, so that the last round's
parts (the adapters the assembly pulls) are published again. An agent ahead of a
*running* workflow rolls back the same way. An agent that cannot roll back (the checkpoint
was pruned) keeps its state and plays its own next round; the workflow then runs out of
phase. A peer that does not answer, or answers without a concluded round (still loading
its checkpoint when the wait ended, or an agent of an older release), is left out of the
agreement; a fresh agent (concluded 0) is too: nobody can roll back to the untrained
state. Peers of an older release (no playing round) count as running at their concluded
round + 1 once they have published a round ≥ 1.

What a hostile member can do with its answer: the positions are claims, and a member can
serve parts of any round it likes, so nothing here can check them. A claim of a round past
the workflow's last (or past what a checkpoint can hold) is ignored (``implausible``).
Within the rounds the workflow plays, one claim no longer decides (before the
hostile-member audit the largest running round and the smallest concluded one did, so one
member could make honest agents skip ahead or discard their two newer checkpoints):

* joining running agents, a restarted agent takes the *upper median* of their rounds (at a
  round's boundary honest agents are in r and r + 1, and r + 1 is the one to join, as the
  largest was); a lie moves it only when the liar is alone with a single honest agent;
* agents restarted together agree on the smallest concluded round among those at most
  ``MAX_ROLLBACK_ROUNDS`` (1) below the *lower median* of everyone's (their own included);
  a claim further below is an ``outlier`` and left out (logged, counted), so a lie rolls
  honest agents back by at most one round, and agents that see the same answers still
  agree. Two honest agents stopped two rounds apart (one concluded rounds without the
  other: already out of phase) no longer meet at the lower one: the one behind skips to
  the others' round when it is an outlier.

A roll-back also never goes past the checkpoints the agent keeps (the last three). With
two agents only, or a member answering each agent differently, a lie can still cost a
round a restart; rounds are lost, not the model, whose parts the norm bounds, the robust
router aggregate and the routing check still screen (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

# The largest round anything here accepts: the one a checkpoint can hold.
from peerlm.agent.checkpoint import _MAX_ROUND as MAX_ROUND

__all__ = ["MAX_ROLLBACK_ROUNDS", "MAX_ROUND", "PeerPosition", "ResumePlan", "plan_resume"]

#: How far below the median concluded round of agents restarted together the round they
#: agree on may go. Every round waits for the others' parts, so honest agents stopped
#: together are at most one round apart (one concluded a round the other had not yet);
#: a claim further behind is a lie or an agent already out of phase, and following it
#: would roll every honest agent back.
MAX_ROLLBACK_ROUNDS = 1


@dataclass(frozen=True)
class PeerPosition:
    """What a workflow agent said of itself (``DescribeWorkflow``)."""

    #: The newest round whose parts it holds (None: nothing published).
    published: int | None
    #: The last round it concluded; None: not said (loading its checkpoint, or older).
    concluded: int | None
    #: The round it plays; None: not decided yet (or an agent of an older release).
    playing: int | None = None

    @property
    def running(self) -> bool:
        """It has decided its round (an older release: it has published a round ≥ 1)."""
        if self.playing is not None:
            return True
        return self.published is not None and self.published >= 1

    @property
    def settled(self) -> bool:
        """Its answer will not change while it waits: running, or its state is loaded."""
        return self.running or self.concluded is not None

    @property
    def workflow_round(self) -> int | None:
        """The round it is in while running (None: not running)."""
        if self.playing is not None:
            return self.playing
        if not self.running:
            return None
        assert self.published is not None
        return self.concluded + 1 if self.concluded is not None else self.published

    def highest_claim(self) -> int:
        """The largest round it claims to have reached in any field."""
        return max(self.published or 0, self.concluded or 0, self.playing or 0)


@dataclass(frozen=True)
class ResumePlan:
    """The decision: play ``next_round``, after loading checkpoint ``rollback_to`` if set."""

    next_round: int
    rollback_to: int | None
    #: Rounds jumped over (joining a workflow that went on without this agent).
    skipped: int
    #: ``running``: joined the others' round; ``together``: agreed with agents restarted
    #: alike; ``alone``: nobody to agree with, own next round.
    mode: Literal["running", "together", "alone"]
    #: The rollback was wanted (this agent is ahead) but its checkpoint is not kept.
    rollback_unavailable: bool = False
    #: Peers whose claimed round is past the workflow's last: ignored.
    implausible: tuple[str, ...] = ()
    #: Peers restarted together whose concluded round is more than ``MAX_ROLLBACK_ROUNDS``
    #: below the median of all: ignored (no honest agent is that far behind; a lie would
    #: roll the others back).
    outliers: tuple[str, ...] = ()


def _lower_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _upper_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def plan_resume(
    own: int,
    peers: Mapping[str, PeerPosition],
    kept: Collection[int],
    *,
    last_round: int | None = None,
) -> ResumePlan:
    """The round an agent that restored its checkpoint of round ``own`` (≥ 1) plays next,
    given the other agents' ``peers`` positions and the rounds of its own checkpoints
    ``kept`` (module docstring). ``last_round``: the workflow's last round (None: rounds
    without end); a peer claiming a later one is ignored, and no plan goes past it.

    Robust to one member's lie (module docstring): joining running agents, the upper
    median of their rounds; restarted together, the smallest concluded round among those
    at most ``MAX_ROLLBACK_ROUNDS`` below the lower median of all of them (this agent's
    included), the others being ``outliers``."""
    if own < 1:
        raise ValueError(f"a resume starts from a concluded round (>= 1), got {own}")
    bound = MAX_ROUND if last_round is None else min(last_round, MAX_ROUND)
    implausible = tuple(sorted(a for a, p in peers.items() if p.highest_claim() > bound))
    plausible = {a: p for a, p in peers.items() if a not in implausible}
    running = {a: r for a, p in plausible.items() if (r := p.workflow_round) is not None}
    outliers: tuple[str, ...] = ()
    if running:
        mode: Literal["running", "together", "alone"] = "running"
        # The upper median: at a round's boundary the honest agents are in r and r + 1 and
        # the newer is the one to join (as the largest was); one member's claim moves it
        # only when it is alone with one honest agent.
        target = _upper_median(list(running.values()))
    else:
        agreed = {
            a: p.concluded
            for a, p in plausible.items()
            if p.concluded is not None and p.concluded >= 1
        }
        mode = "together" if agreed else "alone"
        middle = _lower_median([own, *agreed.values()])
        floor = middle - MAX_ROLLBACK_ROUNDS
        outliers = tuple(sorted(a for a, c in agreed.items() if c < floor))
        # This agent too may be the one behind: it then skips to the others' round.
        target = min(c for c in [own, *agreed.values()] if c >= floor) + 1
    # A lingering workflow plays nothing after its last round; its last round's parts are
    # still kept, so a restarted agent (re)plays that round.
    target = min(target, bound)
    if target > own + 1:
        return ResumePlan(
            target, None, target - own - 1, mode, implausible=implausible, outliers=outliers
        )
    if target < own + 1:
        if target - 1 in kept:
            return ResumePlan(
                target, target - 1, 0, mode, implausible=implausible, outliers=outliers
            )
        return ResumePlan(own + 1, None, 0, mode, True, implausible, outliers)
    return ResumePlan(own + 1, None, 0, mode, implausible=implausible, outliers=outliers)
