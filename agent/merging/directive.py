"""A CPM merge directive, student side: pull the senders' adapters, merge them, measure Eq. 3.

A directive of protocol ``pmix`` or ``svd_hka`` (the CPM's menu, ``docs/matchmaker.md``)
names a teacher, and with the CPM's ``merge_senders`` > 1 up to ``merge_senders - 1``
co-senders (``Directive.co_senders``), whose adapters the student merges with its own.
This is the overlay's pull-and-aggregate step
(:func:`~peerlm.agent.merging.pull_aggregate.pull_and_aggregate`) with the directive's senders as
the candidates, at the addresses and under the names the directive gives: the same pull
(``PeerExchange.PullAdapter`` over mTLS, each sender's proof required, unless ``peers``
says otherwise: the experiment's in-process transport), the same adapter
checks (base model type, tokenizer, LoRA ``r``/``alpha``, tensor names and shapes, finite
values, norm bound), the same aggregation code (PDFL step, or OnePeFT's SVD + HKA on the
student's public pairs, Eq. 3 over its own and every usable sender's adapter) and the same
acceptance gate.

The reward is Eq. 3 measured as AKD measures it: the validation loss right before and
right after the merge (the gate's two measurements, the post-merge one bounded as
:func:`~peerlm.agent.acceptance.judge` reports it), minus ``delta`` times the kilobytes
pulled (every sender's). A merge the gate rolls back still reports its (negative) reward,
as AKD does. One reward per directive, however many senders it names. With
``reward_examples`` (the agent's ``reward_file``: a labelled public probe) the losses of a
merge that stands are measured on them, right before the pull and right after the merge,
exactly as :func:`~peerlm.agent.exchange.rounds.integrate_package` does for AKD, so rewards stay
comparable across protocols.

Choices made here:

* **Every sender counts like one overlay neighbour of similarity 1.** PDFL's weights are a
  softmax over similarities with our own entry included (``kappa``); a directive carries
  no similarity, so each sender gets the value of a perfect match. SVD+HKA weights the
  adapters the same way: lambda_i of OnePeFT's Eq. 3 is uniform over our own adapter and
  the usable senders' (the paper's default, data share, needs each client's data size,
  which peers do not disclose).
* **No gate configured still measures.** With ``acceptance_margin`` unset the gate runs
  with no margin: it measures both losses (the reward needs them) and never rolls back.
* **A sender that fails is skipped; the directive fails only when none is usable.**
  Unreachable, refused, of another shape or backbone, non-finite, too large, over the norm
  bound (a poisoned adapter): that sender is left out of the merge, listed in
  :attr:`MergeOutcome.skipped` and counted in
  ``peerlm_agent_directive_senders_skipped_total{reason}`` (its pull's reason). When no
  sender's adapter is usable: :class:`MergeRefused` with the teacher's reason (else the
  first sender's); the student's adapter is untouched. The daemon counts it as a failed
  exchange (``peerlm_agent_exchange_failures_total{reason="adapter_refused"}``), like an
  AKD package that cannot be used, and reports the refusal to the CPM by that reason
  (:func:`peerlm.agent.cpm.directives.refusal_failure`), so its bandit learns it.
* **A sender whose adapter is of another parameter space is named to the CPM.** The CPM
  paired the student only with senders that declared its own fingerprint; an adapter the
  codec refuses for its spec (base model type, tokenizer, LoRA ``r``/``alpha``, tensor
  names or shapes: the parts of the fingerprint an adapter carries) disproves that
  sender's declaration. Those senders are :attr:`MergeOutcome.space_mismatch` (or
  :attr:`MergeRefused.space_mismatch` when none was usable), and the daemon reports them
  with the reward or the refusal (``ReportRewardRequest.space_mismatch``), so the CPM stops
  pairing the liar (docs/matchmaker.md, "The fingerprint"). A sender that was unreachable,
  or sent a corrupt, non-finite or over-norm adapter, proved nothing about its space and
  is not named (:func:`peerlm.agent.cpm.directives.space_mismatches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from peerlm.agent.acceptance import AcceptanceGate, judge
from peerlm.agent.cpm.directives import space_mismatches
from peerlm.agent.exchange.rounds import reward_eq3
from peerlm.agent.merging.pull_aggregate import (
    Candidate,
    ModelRunner,
    PullReport,
    PullSettings,
    pull_and_aggregate,
)
from peerlm.agent.modelhost import ModelHost
from peerlm.agent.peer.transport import PeerTransport
from peerlm.agent.training import TrainSettings
from peerlm.overlay import Refusal

from peerlm.node import NodeContext
from peerlm.protocols import CATALOGUE, lookup

__all__ = ["MergeOutcome", "MergeRefused", "merge_from_teacher"]

#: Refusal reasons that are an outcome of the whole merge, not a sender's fault.
_NOT_SKIPS = frozenset({"rolled_back"})


class MergeRefused(Exception):
    """The teacher's adapter was not merged; ``reason`` is the pull's refusal reason;
    ``space_mismatch``: the senders whose adapter proved to be of another parameter space
    (:func:`~peerlm.agent.cpm.directives.space_mismatches`)."""

    def __init__(self, reason: str, detail: str, space_mismatch: tuple[str, ...] = ()) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.space_mismatch = space_mismatch


@dataclass(frozen=True)
class MergeOutcome:
    """What merging the senders' adapters did, and Eq. 3's reward for it.

    ``merged``: the senders whose adapters went into the merge (empty when the gate rolled
    it back); ``skipped``: the senders left out, with their reasons; ``space_mismatch``:
    those of them whose adapter proved to be of another parameter space than the
    student's (:func:`~peerlm.agent.cpm.directives.space_mismatches`), for the CPM."""

    protocol: str
    loss_pre: float
    loss_post: float
    kilobytes: float
    reward: float
    rolled_back: bool
    report: PullReport
    merged: tuple[str, ...] = ()
    skipped: tuple[Refusal, ...] = ()
    space_mismatch: tuple[str, ...] = ()


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
    co_senders: Sequence[tuple[str, str]] = (),
    peers: PeerTransport | None = None,
) -> MergeOutcome:
    """Pull ``teacher``'s adapter from ``endpoint`` (and each of ``co_senders``, ``(name,
    endpoint)``) and merge them by ``protocol``.

    ``pull`` supplies the limits and coefficients (the agent's overlay settings); its
    ``method`` is replaced by ``protocol`` and its fan-out by the number of senders (at
    most ``pull.max_peers``: further co-senders are skipped, reason ``over_limit``; a
    sender named twice, or this agent itself, reason ``duplicate`` or ``self``).
    ``svd_hka`` needs ``hka`` (public pairs and training settings): ``ValueError`` before
    anything is pulled otherwise, as for a protocol that is not a merge. A sender whose
    adapter cannot be used is skipped and counted (module docstring); raises
    :class:`MergeRefused` when no sender's adapter was merged (the host unchanged).
    ``peers``: how the adapters are pulled (default: over ``ctx``'s channels).
    """
    merges = [entry.name for entry in CATALOGUE if entry.is_merge]
    if protocol not in merges:
        raise ValueError(f"{protocol!r} is not a merge protocol ({', '.join(merges)})")
    if lookup(protocol).needs_public_pairs and (hka is None or not hka[0]):
        raise ValueError(f"{protocol} needs public (prompt, completion) pairs for HKA")
    # A sender named twice (or this agent itself) would take a fan-out slot twice: the
    # directive is deduplicated here, in its order, before the cut, with the reasons the
    # pull's own selection gives (``duplicate``, ``self``); a directive no honest CPM sends.
    senders: list[tuple[str, str]] = []
    repeated: list[Refusal] = []
    named: set[str] = set()
    for name, address in [(teacher, endpoint), *co_senders]:
        if name == ctx.name:
            repeated.append(Refusal(name, "self", "the directive names this agent itself"))
        elif name in named:
            repeated.append(Refusal(name, "duplicate", "named again in the directive"))
        else:
            named.add(name)
            senders.append((name, address))
    fan_out = min(len(senders), pull.max_peers)
    settings = pull.model_copy(update={"method": protocol, "max_peers": fan_out})
    gate = AcceptanceGate(val_examples, margin, max_length)
    probe = list(reward_examples or ())

    async def probe_loss() -> float:
        def measure() -> float:
            return host.eval_loss(probe, max_length=max_length)[0]

        return await run_model(measure) if run_model is not None else measure()

    probe_pre = await probe_loss() if probe else None
    # The fan-out is cut here, in the directive's order (teacher first, then co-senders
    # best UCB first): with equal similarities the pull's own cut would go by name.
    ranked = [Candidate(name, address, 1.0) for name, address in senders[:fan_out]]
    beyond = repeated + [
        Refusal(name, "over_limit", f"beyond the {fan_out} senders this agent pulls")
        for name, _ in senders[fan_out:]
    ]
    report = await pull_and_aggregate(
        ctx,
        host,
        ranked,
        settings=settings,
        run_model=run_model,
        round_=round_,
        gate=gate,
        hka=hka,
        kind="merge",
        peers=peers,
    )
    names = {teacher, *(name for name, _ in co_senders)}
    skipped = tuple(
        r for r in (*report.refused, *beyond) if r.reason not in _NOT_SKIPS and r.peer in names
    )
    counter = ctx.counter(
        "peerlm_agent_directive_senders_skipped_total",
        "Senders of a CPM merge directive whose adapter was not merged (unreachable, "
        "refused, another parameter space, non-finite, over the norm bound, ...), by reason",
        ("reason",),
    )
    for refusal in skipped:
        counter.labels(refusal.reason).inc()
    mismatched = space_mismatches((r.peer, r.reason) for r in skipped)
    if report.applied or report.rolled_back:
        merged = tuple(p.peer for p in report.pulled)
        if merged:
            ctx.counter(
                "peerlm_agent_directive_senders_merged_total",
                "Senders' adapters merged by CPM merge directives",
            ).inc(len(merged))
    if not report.applied and not report.rolled_back:
        # The teacher's reason when it failed, else the first skipped sender's.
        first = [r for r in skipped if r.peer == teacher] + list(skipped)
        if not first:
            raise MergeRefused("not_integrated", "the aggregation left the adapter unchanged")
        refusal = first[0]
        raise MergeRefused(refusal.reason, refusal.detail, mismatched)
    kilobytes = report.bytes_received / 1024.0
    pre, post = report.loss_pre, report.loss_post
    if probe_pre is not None and not report.rolled_back:
        pre, post = probe_pre, judge(probe_pre, await probe_loss(), None).loss_post
    reward = reward_eq3(pre, post, kilobytes, reward_gamma, reward_delta)
    if not math.isfinite(reward):
        raise MergeRefused(
            "non_finite", f"reward not finite (L_pre={pre}, L_post={post})", mismatched
        )
    return MergeOutcome(
        protocol,
        pre,
        post,
        kilobytes,
        reward,
        report.rolled_back,
        report,
        merged=tuple(p.peer for p in report.pulled),
        skipped=skipped,
        space_mismatch=mismatched,
    )
