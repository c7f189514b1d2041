"""A CPM merge directive, student side: pull the teacher's adapter, merge it, measure Eq. 3.

A directive of protocol ``pmix`` or ``svd_hka`` (the CPM's menu, ``docs/matchmaker.md``)
names a teacher whose adapter the student merges with its own. This is the overlay's
pull-and-aggregate step (:func:`~peerlm.agent.pull_aggregate.pull_and_aggregate`) with one
candidate, the teacher, at the address and under the name the directive gives: the same
pull (``PeerExchange.PullAdapter`` over mTLS, the teacher's sender proof required), the
same adapter checks (base model type, tokenizer, LoRA ``r``/``alpha``, tensor names and
shapes, finite values, norm bound), the same aggregation code (PDFL step, or OnePeFT's SVD
+ HKA on the student's public pairs) and the same acceptance gate.

The reward is Eq. 3 measured as AKD measures it: the validation loss right before and
right after the merge (the gate's two measurements, the post-merge one bounded as
:func:`~peerlm.agent.acceptance.judge` reports it), minus ``delta`` times the kilobytes
pulled. A merge the gate rolls back still reports its (negative) reward, as AKD does.
With ``reward_examples`` (the agent's ``reward_file``: a labelled public probe) the losses
of a merge that stands are measured on them, right before the pull and right after the
merge, exactly as :func:`~peerlm.agent.rounds.integrate_package` does for AKD, so rewards
stay comparable across protocols.

Choices made here:

* **The teacher counts like one overlay neighbour of similarity 1.** PDFL's weights are a
  softmax over similarities with our own entry included (``kappa``); a directive carries
  no similarity, so the teacher gets the value of a perfect match and the mix is the
  PDFL step's for one neighbour. SVD+HKA weights the two adapters the same way.
* **No gate configured still measures.** With ``acceptance_margin`` unset the gate runs
  with no margin: it measures both losses (the reward needs them) and never rolls back.
* **A teacher whose adapter cannot be merged fails the directive.** Unreachable, refused,
  of another shape or backbone, non-finite, too large: :class:`MergeRefused` with the
  pull's reason; the student's adapter is untouched. The daemon counts it as a failed
  exchange (``peerlm_agent_exchange_failures_total{reason="adapter_refused"}``), like an
  AKD package that cannot be used, and reports the refusal to the CPM by the pull's
  reason (:func:`peerlm.agent.directives.refusal_failure`), so its bandit learns it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from peerlm.agent.acceptance import AcceptanceGate, judge
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.pull_aggregate import (
    Candidate,
    ModelRunner,
    PullReport,
    PullSettings,
    pull_and_aggregate,
)
from peerlm.agent.rounds import reward_eq3
from peerlm.agent.training import TrainSettings
from peerlm.services.cpm import MERGE_PROTOCOLS, PMIX, SVD_HKA

from peerlm.node import NodeContext

__all__ = ["MergeOutcome", "MergeRefused", "merge_from_teacher"]


class MergeRefused(Exception):
    """The teacher's adapter was not merged; ``reason`` is the pull's refusal reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MergeOutcome:
    """What merging the teacher's adapter did, and Eq. 3's reward for it."""

    protocol: str
    loss_pre: float
    loss_post: float
    kilobytes: float
    reward: float
    rolled_back: bool
    report: PullReport


async def merge_from_teacher(
    ctx: NodeContext,
    host: ModelHost,
    *,
    protocol: str,
    teacher: str,
    endpoint: str,
    pull: PullSettings,
    val_examples: Sequence[tuple[str, str]],
    max_length: int,
    margin: float | None,
    reward_gamma: float,
    reward_delta: float,
    run_model: ModelRunner | None = None,
    hka: tuple[Sequence[tuple[str, str]], TrainSettings] | None = None,
    round_: int = 0,
    reward_examples: Sequence[tuple[str, str]] | None = None,
) -> MergeOutcome:
    """Pull ``teacher``'s adapter from ``endpoint`` and merge it by ``protocol``.

    ``pull`` supplies the limits and coefficients (the agent's overlay settings); its
    ``method`` is replaced by ``protocol`` and its fan-out by 1. ``svd_hka`` needs ``hka``
    (public pairs and training settings): ``ValueError`` before anything is pulled
    otherwise, as for a protocol that is not a merge. Raises :class:`MergeRefused` when the
    adapter is not merged (the host unchanged).
    """
    if protocol not in MERGE_PROTOCOLS:
        raise ValueError(f"{protocol!r} is not a merge protocol ({PMIX}, {SVD_HKA})")
    if protocol == SVD_HKA and (hka is None or not hka[0]):
        raise ValueError("svd_hka needs public (prompt, completion) pairs for HKA")
    settings = pull.model_copy(update={"method": protocol, "max_peers": 1})
    gate = AcceptanceGate(val_examples, margin, max_length)
    probe = list(reward_examples or ())

    async def probe_loss() -> float:
        def measure() -> float:
            return host.eval_loss(probe, max_length=max_length)[0]

        return await run_model(measure) if run_model is not None else measure()

    probe_pre = await probe_loss() if probe else None
    report = await pull_and_aggregate(
        ctx,
        host,
        [Candidate(teacher, endpoint, 1.0)],
        settings=settings,
        run_model=run_model,
        round_=round_,
        gate=gate,
        hka=hka,
        kind="merge",
    )
    if not report.applied and not report.rolled_back:
        refusal = next((r for r in report.refused if r.peer == teacher), None)
        if refusal is None:
            raise MergeRefused("not_integrated", "the aggregation left the adapter unchanged")
        raise MergeRefused(refusal.reason, refusal.detail)
    kilobytes = report.bytes_received / 1024.0
    pre, post = report.loss_pre, report.loss_post
    if probe_pre is not None and not report.rolled_back:
        pre, post = probe_pre, judge(probe_pre, await probe_loss(), None).loss_post
    reward = reward_eq3(pre, post, kilobytes, reward_gamma, reward_delta)
    if not math.isfinite(reward):
        raise MergeRefused("non_finite", f"reward not finite (L_pre={pre}, L_post={post})")
    return MergeOutcome(protocol, pre, post, kilobytes, reward, report.rolled_back, report)
