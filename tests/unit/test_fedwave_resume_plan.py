"""Where a restarted FedWave expert resumes (``plan_resume``): joining a running workflow,
agreeing with agents restarted together (rolling back when ahead), and what it does when
it cannot agree."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from peerlm.agent.fedwave.resume import MAX_ROLLBACK_ROUNDS, MAX_ROUND, PeerPosition, plan_resume


def restarted(concluded: int | None) -> PeerPosition:
    """An agent that restarted too: only round 0 published (at start)."""
    return PeerPosition(published=0, concluded=concluded)


def test_a_restarted_agent_joins_the_round_the_running_workflow_is_in() -> None:
    # The others concluded 5: they train round 6 (published 5) or wait on its pulls
    # (published 6); either way the agent, back from round 2, plays 6 and skips 3-5.
    for published in (5, 6):
        plan = plan_resume(2, {"a": PeerPosition(published, 5), "b": PeerPosition(6, 5)}, [1, 2])
        assert (plan.next_round, plan.rollback_to, plan.skipped, plan.mode) == (
            6,
            None,
            3,
            "running",
        )
    # An agent of an older release says no concluded round: its newest published one counts.
    plan = plan_resume(2, {"a": PeerPosition(4, None)}, [2])
    assert (plan.next_round, plan.skipped) == (4, 1)


def test_agents_restarted_together_agree_on_the_smallest_concluded_round() -> None:
    peers = {"a": restarted(3), "b": restarted(4)}
    ahead = plan_resume(4, peers, kept=[2, 3, 4])
    assert (ahead.next_round, ahead.rollback_to, ahead.mode) == (4, 3, "together")
    behind = plan_resume(3, {"a": restarted(4), "b": restarted(4)}, kept=[1, 2, 3])
    assert (behind.next_round, behind.rollback_to, behind.skipped) == (4, None, 0)


def test_an_agent_ahead_of_a_running_workflow_rolls_back_to_it() -> None:
    # The others restarted first and already play round 3; this one had concluded 3.
    plan = plan_resume(3, {"a": PeerPosition(3, 2), "b": PeerPosition(2, 2)}, kept=[1, 2, 3])
    assert (plan.next_round, plan.rollback_to, plan.mode) == (3, 2, "running")


def test_without_the_older_checkpoint_it_keeps_its_state_and_says_so() -> None:
    plan = plan_resume(6, {"a": restarted(2)}, kept=[4, 5, 6])
    assert (plan.next_round, plan.rollback_to, plan.rollback_unavailable) == (7, None, True)


def test_unknown_fresh_and_silent_agents_are_left_out_of_the_agreement() -> None:
    # Still loading (no concluded round), fresh (0): nobody to agree with.
    plan = plan_resume(4, {"a": restarted(None), "b": restarted(0)}, kept=[2, 3, 4])
    assert (plan.next_round, plan.rollback_to, plan.mode) == (5, None, "alone")
    assert plan_resume(4, {}, kept=[4]).mode == "alone"
    with pytest.raises(ValueError, match=">= 1"):
        plan_resume(0, {}, kept=[])


@given(
    concluded=st.lists(st.integers(min_value=1, max_value=50), min_size=2, max_size=6),
    spread=st.integers(min_value=0, max_value=2),
)
def test_a_workflow_restarted_together_plays_one_round_whoever_is_ahead(
    concluded: list[int], spread: int
) -> None:
    # Each agent keeps its last three checkpoints (CheckpointStore's default); a stop lands
    # at most `spread` rounds apart. Every agent that sees every other settled plans the
    # same next round, and an agent that rolls back rolls back to a round it keeps.
    low = min(concluded)
    rounds = [min(c, low + spread) for c in concluded]
    names = [f"a{i}" for i in range(len(rounds))]
    plans = []
    for i, own in enumerate(rounds):
        peers = {names[j]: restarted(c) for j, c in enumerate(rounds) if j != i}
        kept = [r for r in (own - 2, own - 1, own) if r >= 1]
        plan = plan_resume(own, peers, kept)
        plans.append(plan)
        if plan.rollback_to is not None:
            assert plan.rollback_to in kept and plan.rollback_to < own
        assert not plan.rollback_unavailable
    # They all agree; on the smallest round's next when nobody is further than
    # MAX_ROLLBACK_ROUNDS below the median (always for agents stopped together in phase);
    # an agent further behind is left out as an outlier and skips to the others' round.
    agreed = {p.next_round for p in plans}
    assert len(agreed) == 1
    if max(rounds) - low <= MAX_ROLLBACK_ROUNDS:
        assert agreed == {low + 1}


@pytest.mark.parametrize("lie", [1, 2, 3])
def test_one_members_low_concluded_round_rolls_honest_agents_back_one_round_at_most(
    lie: int,
) -> None:
    """Hostile member: agents restarted together at round 6 (one at 5) and a member that
    claims to have concluded only ``lie``. Before, the smallest claim decided: every honest
    agent rolled back to it (as far as its kept checkpoints allowed, discarding the newer
    ones). Now a claim more than one round below the median is an outlier."""
    honest = {"a": 6, "b": 6, "c": 5}
    plans = {}
    for me, own in honest.items():
        peers = {o: restarted(c) for o, c in honest.items() if o != me} | {"liar": restarted(lie)}
        plans[me] = plan_resume(own, peers, kept=[own - 2, own - 1, own], last_round=20)
    assert {p.next_round for p in plans.values()} == {6}  # c's round: the honest agreement
    assert all(p.outliers == ("liar",) for p in plans.values())
    assert plans["a"].rollback_to == 5 and plans["c"].rollback_to is None


def test_one_members_running_round_cannot_move_a_restarted_agent() -> None:
    """Hostile member: the workflow runs round 7; a member claims to play round 15 (or 2).
    Before, the largest running round decided: the restarted agent skipped to 15 and played
    out of phase, a deadline lost each round. Now the upper median of the running rounds."""
    for claim in (15, 2):
        peers = {
            "a": PeerPosition(0, 6, playing=7),
            "b": PeerPosition(0, 6, playing=7),
            "liar": PeerPosition(0, claim - 1, playing=claim),
        }
        plan = plan_resume(5, peers, kept=[3, 4, 5], last_round=20)
        assert (plan.next_round, plan.skipped, plan.mode) == (7, 1, "running"), claim


def test_positions_say_what_they_know() -> None:
    assert not PeerPosition(None, None).settled
    assert not restarted(None).settled and restarted(0).settled
    assert PeerPosition(3, None).settled and PeerPosition(3, None).workflow_round == 3
    assert PeerPosition(3, 3).workflow_round == 4 and restarted(2).workflow_round is None
    assert PeerPosition(0, 3, playing=5).workflow_round == 5
    assert PeerPosition(2, 7, playing=4).highest_claim() == 7


def test_an_agent_restarting_after_the_others_decided_joins_their_round() -> None:
    # A and C agreed on round 5 and train it (nothing of it published yet); B, back late
    # from round 3, must not take them for restarting agents and play 4.
    peers = {"a": PeerPosition(0, 4, playing=5), "c": PeerPosition(0, 4, playing=5)}
    plan = plan_resume(3, peers, kept=[1, 2, 3])
    assert (plan.next_round, plan.skipped, plan.mode) == (5, 1, "running")
    # A decided agent is settled even before it has published anything.
    assert PeerPosition(None, None, playing=1).settled


def test_nothing_is_played_past_the_last_round() -> None:
    # Every agent had concluded the last round (a stop during the assembly): the last round
    # is played again from the checkpoint before it, so that its parts (the adapters the
    # assembly pulls) are published again.
    peers = {"a": restarted(8), "b": restarted(8)}
    plan = plan_resume(8, peers, kept=[6, 7, 8], last_round=8)
    assert (plan.next_round, plan.rollback_to) == (8, 7)
    # A restarted agent joining a workflow that lingers after its last round plays that
    # round (the others keep its parts), not the round after.
    lingering = {"a": PeerPosition(8, 8, playing=8), "b": PeerPosition(8, 8)}
    plan = plan_resume(5, lingering, kept=[5], last_round=8)
    assert (plan.next_round, plan.skipped) == (8, 2)


def test_a_claim_past_the_workflows_last_round_is_ignored() -> None:
    # A hostile member claims round 10**9: without the bound the restarted agent would skip
    # to it and end its run untrained. With it, the honest peer's round decides.
    peers = {"liar": PeerPosition(10**9, 10**9 - 1), "honest": PeerPosition(5, 4)}
    plan = plan_resume(2, peers, kept=[2], last_round=8)
    assert (plan.next_round, plan.skipped, plan.implausible) == (5, 2, ("liar",))
    # A concluded round past the end is as implausible as a published one.
    together = {"liar": PeerPosition(0, 99), "honest": PeerPosition(0, 3)}
    plan = plan_resume(4, together, kept=[2, 3, 4], last_round=8)
    assert (plan.next_round, plan.rollback_to, plan.implausible) == (4, 3, ("liar",))
    # A round past the end is refused in every field, the playing round included.
    plan = plan_resume(2, {"liar": PeerPosition(1, 1, playing=9)}, kept=[2], last_round=8)
    assert (plan.next_round, plan.implausible) == (3, ("liar",))
    # Rounds without end: only what a checkpoint could not hold is past it.
    assert plan_resume(2, peers, kept=[2]).next_round == 10**9
    huge = {"liar": PeerPosition(1, 2**64 - 2)}
    assert plan_resume(2, huge, kept=[2]).implausible == ("liar",)
    assert MAX_ROUND == 10**12 - 1
