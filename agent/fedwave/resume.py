"""Where a restarted FedWave expert resumes: the round it plays next, and whether it first
rolls back to an older checkpoint of its own. Pure: the caller asks the workflow's agents
(``DescribeWorkflow``) and loads the checkpoint.

Two situations look alike from inside one agent and need different answers:

* **One agent restarted, the others went on** (a crash, a redeploy): the others are
  *running*: they have published parts of a round ≥ 1 since they started. The round they
  are in is their last concluded round + 1 (an agent that concluded R is training R + 1,
  or has published it and waits on its pulls). The restarted agent joins that round; the
  rounds it missed are skipped (its router equals theirs again from the first round they
  all conclude over the same set: Eq. 9 over the same trained routers gives the same bits).
* **The whole workflow restarted together** (``peerlm up --workflow --resume``, a host
  reboot): nobody is running; each restored the checkpoint of the last round *it*
  concluded, and a stop lands at a different point of each agent's round, so they may be a
  round apart. They agree on the smallest concluded round m among them and all play
  m + 1: an agent ahead rolls back to its checkpoint of m (it keeps the last three), whose
  router is the one the others hold if round m was complete for all. Without that, each
  would play its own next round and lose a deadline per round until the phase slipped back.

An agent that is ahead of a *running* workflow (the others restarted first and are
already playing) rolls back the same way. An agent that cannot roll back (the checkpoint
was pruned) keeps its state and plays its own next round; the workflow then runs out of
phase as before this module existed (counted in the report as a plain resume). A peer that
does not answer, or answers without a concluded round (still loading its checkpoint when
the wait ended, or an agent of an older release), is left out of the agreement; a fresh
agent (concluded 0) is too: nobody can roll back to the untrained state.

What a hostile member can do with its answer: the positions are claims, and a member can
serve parts of any round it likes, so nothing here can check them. Claiming a round past
the workflow's last (``last_round``) would make a restarted agent skip to the end and
stop training; such claims are ignored (``implausible`` in the plan). Within the rounds
the workflow plays, a member can still move a restarted agent forward (it skips rounds)
or hold agents restarted together back by up to the two older checkpoints they keep (a
roll-back never goes further); both cost rounds, not the model's integrity, and the norm
bounds still screen every part it sends.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["PeerPosition", "ResumePlan", "plan_resume"]


@dataclass(frozen=True)
class PeerPosition:
    """What a workflow agent said of itself (``DescribeWorkflow``)."""

    #: The newest round whose parts it holds (None: nothing published).
    published: int | None
    #: The last round it concluded; None: not said (loading its checkpoint, or older).
    concluded: int | None

    @property
    def running(self) -> bool:
        """It has published a trained round since it started (round 0 is the start's)."""
        return self.published is not None and self.published >= 1

    @property
    def settled(self) -> bool:
        """Its answer will not change while it waits: running, or its state is loaded."""
        return self.running or self.concluded is not None

    @property
    def workflow_round(self) -> int | None:
        """The round it is in while running (None: not running)."""
        if not self.running:
            return None
        assert self.published is not None
        return self.concluded + 1 if self.concluded is not None else self.published


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
    without end); a peer claiming to have published or concluded a later one is ignored."""
    if own < 1:
        raise ValueError(f"a resume starts from a concluded round (>= 1), got {own}")
    implausible: tuple[str, ...] = ()
    if last_round is not None:
        implausible = tuple(
            sorted(
                a for a, p in peers.items() if max(p.published or 0, p.concluded or 0) > last_round
            )
        )
        peers = {a: p for a, p in peers.items() if a not in implausible}
    return replace(_plan(own, peers, kept), implausible=implausible)


def _plan(own: int, peers: Mapping[str, PeerPosition], kept: Collection[int]) -> ResumePlan:
    running = [r for p in peers.values() if (r := p.workflow_round) is not None]
    if running:
        mode: Literal["running", "together", "alone"] = "running"
        target = max(running)
    else:
        agreed = [
            p.concluded for p in peers.values() if p.concluded is not None and p.concluded >= 1
        ]
        mode = "together" if agreed else "alone"
        target = min([own, *agreed]) + 1
    if target > own + 1:
        return ResumePlan(target, None, target - own - 1, mode)
    if target < own + 1:
        if target - 1 in kept:
            return ResumePlan(target, target - 1, 0, mode)
        return ResumePlan(own + 1, None, 0, mode, rollback_unavailable=True)
    return ResumePlan(own + 1, None, 0, mode)
