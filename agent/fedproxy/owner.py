"""FedProxy's owner (Algorithm 1, server side): publish the proxy, collect, merge, publish.

The owner is an agent holding the full model and its proxy (``fedproxy.owner: true``).
Round ``t`` (from 1):

1. the proxy ``φ^(t−1)`` and the conflict scores ``C^(t−1)`` of the merge that made it (none
   in round 1) are published on the owner's :class:`~peerlm.agent.fedproxy.service.RoundBoard`,
   from which cohort members pull them (``PullProxy``);
2. the owner pulls each member's trained proxy (``PullUpdate``, waited for on the member's
   side up to the time left), checks it (:func:`~peerlm.agent.fedproxy.codec.decode_update`:
   the same blocks, names, shapes, dtypes; finite) and records it in the round's
   :class:`~peerlm.agent.fedproxy.rounds.CohortRound` until every member answered or the
   deadline passed; an unreachable member is asked again every ``retry_s``;
3. what arrived is merged by the server-side analysis and H-TIES
   (:func:`~peerlm.agent.fedproxy.hties.h_ties`, Eq. 5–7 and 10–14, ``r0``, ``δ``, ``ρ`` from the
   settings); who was missing, and why, goes to the log (``fedproxy_round_merged``) and to
   ``peerlm_agent_fedproxy_members_missing_total{member, reason}``;
4. ``φ^(t)`` and ``C^(t)`` are published as round ``t + 1``.

A round where nothing arrived republishes the proxy and scores unchanged (nothing to merge;
logged and counted as ``empty``). A member's bad update never reaches the merge: it is
counted in ``peerlm_agent_fedproxy_payloads_refused_total{kind="update", reason}`` and the
member counts as missing for that round. Besides the codec's checks, an update whose task
vector is over the norm bound is refused so (``reason="norm"``,
:mod:`peerlm.agent.fedproxy.admission`), and with an ``evaluate`` the merge passes the
acceptance gate: a merge that raises the proxy's held-out loss by more than
``fedproxy.acceptance_margin`` is not published (the previous proxy and scores are, as round
``t + 1``; logged as ``fedproxy_merge_rejected`` and counted as the round outcome
``rejected``).

Hostile members inside the norm bound (docs/fedproxy.md, "Hostile members"): an update
that changes the token embeddings (members send none) is refused ``frozen``, one that moves
a tensor or a matrix row beyond ``fedproxy.max_group_norm_ratio`` of its reference
``group_norm``; the merge clips every coordinate to what a second member moved it
(``fedproxy.robust_merge``, :func:`~peerlm.agent.fedproxy.hties.support_clip`); and the owner keeps
the version published before the current one: when a member's update reports (its
:class:`~peerlm.agent.fedproxy.codec.HarmReport`, measured on the member's own validation)
that the current proxy raised its loss by more than ``fedproxy.harm_margin`` over the
previous one, the round's updates (trained from the harmful proxy) are not merged and the
previous version is published again (outcome ``rolled_back``, logged as
``fedproxy_rolled_back``, counted in ``peerlm_agent_fedproxy_rollbacks_total{member}``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from peerlm.agent.acceptance import Verdict, judge
from peerlm.agent.fedproxy.admission import (
    FROZEN_REASON,
    GROUP_REASON,
    NORM_REASON,
    frozen_refusal,
    group_refusal,
    harm_of,
    norm_refusal,
    state_norm,
    token_embedding_keys,
)
from peerlm.agent.fedproxy.codec import HarmReport, decode_proxy, decode_update, encode_proxy
from peerlm.agent.fedproxy.hties import h_ties
from peerlm.agent.fedproxy.member import Evaluator, proxy_from
from peerlm.agent.fedproxy.proxy import ProxyError, ProxyInfo, fuse_into, proxy_info
from peerlm.agent.fedproxy.rounds import CohortRound, RoundError, RoundOutcome
from peerlm.agent.fedproxy.service import ProxyExchangeService, RoundBoard, pull_update
from peerlm.agent.peer.client import PeerExchangeError
from peerlm.agent.peer.stream import PeerStreamer
from peerlm.agent.settings import FedProxySettings
from prometheus_client import Histogram
from transformers import PreTrainedModel

from peerlm.atomic_file import write_atomic
from peerlm.metrics import get_collector
from peerlm.node import NodeContext

__all__ = ["ProxyOwner"]

#: Answers after which a member is asked again within the round (it is not there yet, or
#: has not finished training): the rest are final for the round.
_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class _Version:
    """A published proxy the owner can go back to: its weights, scores, the round it was
    first published in, and its held-out loss on the owner's gate (None: not measured)."""

    state: dict[str, torch.Tensor]
    conflict: dict[str, torch.Tensor]
    since: int
    loss: float | None


class ProxyOwner:
    """The owner's rounds over ``proxy`` (a model built by ``peerlm models compress``).

    ``checkpoint``: a file where every published round (the payload itself: proxy, scores,
    round) is written atomically before it is served, and from which :meth:`start` resumes
    after a restart (kill -9 included).

    ``clock`` (monotonic seconds) times the rounds' deadlines; the merge runs on a worker
    thread so the server goes on answering.

    ``evaluate``: the held-out loss of a proxy (:func:`~peerlm.agent.fedproxy.member.text_loss`
    on the owner's validation texts), for the acceptance gate; None: no gate.
    """

    def __init__(
        self,
        ctx: NodeContext,
        settings: FedProxySettings,
        proxy: PreTrainedModel,
        *,
        checkpoint: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        evaluate: Evaluator | None = None,
    ) -> None:
        info = proxy_info(proxy)
        if info is None:
            raise ProxyError("the owner's model is not a proxy (no peerlm_proxy)", reason="model")
        if not settings.cohort:
            raise ValueError("an owner needs a cohort")
        self._ctx, self._settings, self._clock = ctx, settings, clock
        self._checkpoint = checkpoint
        self._evaluate = evaluate if settings.acceptance_margin is not None else None
        self._loss: float | None = None  # the held-out loss of ``state``, once measured
        self._norm_of: tuple[dict[str, torch.Tensor], float] | None = None
        self.info: ProxyInfo = info
        self._config: dict[str, Any] = proxy.config.to_dict()
        self.state: dict[str, torch.Tensor] = {
            k: v.detach().to("cpu").clone() for k, v in proxy.state_dict().items()
        }
        self.conflict: dict[str, torch.Tensor] = {}
        #: The token embeddings' keys: frozen in a cohort (members send no update for them).
        self._frozen = token_embedding_keys(proxy)
        #: The round the current proxy was first published in, and the version before it
        #: (None: nothing to roll back to, at the start or right after a rollback).
        self._since = 0
        self._previous: _Version | None = None
        self.board = RoundBoard(horizon=1)
        self._opened_at = 0.0
        #: SHA-256 of every payload this process published, by round: what a member that
        #: pulled that round holds (the payload travels byte for byte).
        self.published: dict[int, str] = {}
        #: One record per round this process closed (``fedproxy_round_merged``'s fields).
        self.history: list[dict[str, Any]] = []
        reg = ctx.registry
        self._rounds = ctx.counter(
            "peerlm_agent_fedproxy_rounds_total",
            "Cohort rounds closed by the owner: complete (every member merged), partial, "
            "empty, rejected (the merge failed the acceptance gate; the previous proxy stands)",
            ("outcome",),
        )
        self._merged = ctx.counter(
            "peerlm_agent_fedproxy_updates_merged_total", "Member updates merged by H-TIES"
        )
        self._missing = ctx.counter(
            "peerlm_agent_fedproxy_members_missing_total",
            "Members whose update a round merged without: deadline (none came) or the "
            "reason it was refused",
            ("member", "reason"),
        )
        self._refused = ctx.counter(
            "peerlm_agent_fedproxy_payloads_refused_total",
            "Proxies (at a member) and updates (at the owner) refused as bad input",
            ("kind", "reason"),
        )
        self._rollbacks = ctx.counter(
            "peerlm_agent_fedproxy_rollbacks_total",
            "Published proxies rolled back to the previous version on a member's harm report "
            "(the member whose report it was)",
            ("member",),
        )
        self._merge_seconds = get_collector(
            Histogram,
            reg,
            "peerlm_agent_fedproxy_merge_seconds",
            "Time of the owner's analysis and H-TIES merge of one round",
        )

    @property
    def round(self) -> int:
        """The round published last (0 before :meth:`start`)."""
        return self.board.round

    def service(
        self, *, chunk_bytes: int, max_wait_s: float, streamer: PeerStreamer | None = None
    ) -> ProxyExchangeService:
        """The ``ProxyExchange`` service of this owner: its proxies, to its cohort only."""
        return ProxyExchangeService(
            proxies=self.board,
            cohort=self._settings.cohort,
            chunk_bytes=chunk_bytes,
            max_wait_s=max_wait_s,
            registry=self._ctx.registry,
            signer=self._ctx.signer,
            log=self._ctx.log,
            streamer=streamer,
            max_pulls_per_round=self._settings.max_pulls_per_round,
        )

    async def start(self) -> None:
        """Publish the round the checkpoint holds, else round 1: the proxy as compressed,
        no conflict scores (``C = 0``). A checkpoint that does not decode as a proxy of these
        blocks and shapes raises :class:`ProxyError` (the owner must not silently start over).
        """
        if self.board.round != 0:
            return
        if self._checkpoint is not None and self._checkpoint.exists():
            data = await asyncio.to_thread(self._checkpoint.read_bytes)
            shapes = {k: tuple(v.shape) for k, v in self.state.items()}
            saved = decode_proxy(data, shapes, max_bytes=len(data), expected_info=self.info)
            self.state, self.conflict = saved.state, saved.conflict
            self._since = saved.round
            self.published[saved.round] = hashlib.sha256(data).hexdigest()
            await self.board.publish(saved.round, data)
            self._opened_at = self._clock()
            self._ctx.log.info(
                "fedproxy_restored", round=saved.round, checkpoint=str(self._checkpoint)
            )
            return
        self._since = 1
        await self._publish(1)

    async def _publish(self, round_: int) -> None:
        payload = encode_proxy(self.state, self._config, round_, self.conflict or None)
        if len(payload) > self._settings.max_proxy_bytes:
            raise ProxyError(
                f"the proxy of {len(payload)} bytes exceeds fedproxy.max_proxy_bytes "
                f"({self._settings.max_proxy_bytes})",
                reason="too_large",
            )
        if self._checkpoint is not None:  # durable before anyone can pull it
            await asyncio.to_thread(write_atomic, self._checkpoint, payload)
        self.published[round_] = hashlib.sha256(payload).hexdigest()
        await self.board.publish(round_, payload)
        self._opened_at = self._clock()
        self._ctx.log.info(
            "fedproxy_round_published",
            round=round_,
            bytes=len(payload),
            scored_tensors=len(self.conflict),
        )

    async def run_round(self) -> RoundOutcome:
        """Collect the current round, merge what arrived, publish the next round."""
        await self.start()
        t = self.board.round
        core = CohortRound(
            t,
            self._settings.cohort,
            opened_at=self._opened_at,
            deadline_s=self._settings.round_deadline_s,
        )
        updates: dict[str, dict[str, torch.Tensor]] = {}
        reports: dict[str, HarmReport] = {}
        await asyncio.gather(
            *(
                self._collect(core, name, address, updates, reports)
                for name, address in sorted(self._settings.cohort.items())
            )
        )
        outcome = core.close(max(self._clock(), core.deadline if core.pending() else 0.0))
        for name in outcome.missing:
            self._missing.labels(name, "deadline").inc()
        for name, reason in outcome.refused.items():
            self._missing.labels(name, reason).inc()
        rejected = False
        harmed = self._harmed(t, {m: reports[m] for m in outcome.arrived if m in reports})
        if harmed:
            self._roll_back(t, harmed)
            weights, heterogeneity = {}, {}
        elif outcome.arrived:
            started = self._clock()
            result = await asyncio.to_thread(
                h_ties,
                self.state,
                [updates[name] for name in outcome.arrived],
                r0=self._settings.r0,
                delta=self._settings.delta,
                rho=self._settings.rho,
                robust=self._settings.robust_merge,
            )
            self._merge_seconds.observe(self._clock() - started)
            verdict = await self._gate(t, result.state)
            rejected = verdict is not None and verdict.rolled_back
            if not rejected:
                self._previous = _Version(self.state, self.conflict, self._since, self._loss)
                self._since = t + 1
                self.state, self.conflict = result.state, result.analysis.conflict
                self._merged.inc(len(outcome.arrived))
                self._loss = verdict.loss_post if verdict is not None else None
            weights = dict(zip(outcome.arrived, result.analysis.weights, strict=True))
            heterogeneity = dict(zip(outcome.arrived, result.analysis.heterogeneity, strict=True))
        else:
            weights, heterogeneity = {}, {}
        kind = "complete" if outcome.complete else ("partial" if outcome.arrived else "empty")
        kind = "rejected" if rejected else kind
        kind = "rolled_back" if harmed else kind
        self._rounds.labels(kind).inc()
        record: dict[str, Any] = {
            "round": t,
            "outcome": kind,
            "merged": list(outcome.arrived),
            "missing": list(outcome.missing),
            "refused": dict(outcome.refused),
            "deadline_passed": outcome.deadline_passed,
            "weights": weights,
            "heterogeneity": heterogeneity,
            "harm": {m: round(harm_of(r.loss, r.previous_loss), 6) for m, r in reports.items()},
        }
        self.history.append(record)
        log = self._ctx.log.info if outcome.complete else self._ctx.log.warning
        log("fedproxy_round_merged", **record)
        await self._publish(t + 1)
        return outcome

    def _harmed(self, t: int, reports: Mapping[str, HarmReport]) -> dict[str, float]:
        """The members whose report says the current proxy harmed them beyond the margin,
        and by how much, when there is a previous version to go back to. A report counts
        when it compares exactly those two versions: the proxy of this round (published
        at ``_since`` or later) against one the member pulled while the previous version
        was the published one."""
        margin, previous = self._settings.harm_margin, self._previous
        if margin is None or previous is None:
            return {}
        out = {}
        for name, report in sorted(reports.items()):
            harm = harm_of(report.loss, report.previous_loss)
            comparable = report.round == t and previous.since <= report.previous_round < self._since
            if comparable and harm > margin:
                out[name] = harm
        return out

    def _roll_back(self, t: int, harmed: Mapping[str, float]) -> None:
        """Make the previous version current again (published as round ``t + 1`` by the
        caller); this round's updates, trained from the harmful proxy, are not merged."""
        previous = self._previous
        assert previous is not None
        self.state, self.conflict, self._loss = previous.state, previous.conflict, previous.loss
        self._since, self._previous = t + 1, None
        for name in harmed:
            self._rollbacks.labels(name).inc()
        self._ctx.log.warning(
            "fedproxy_rolled_back",
            round=t,
            harm={name: round(value, 6) for name, value in harmed.items()},
            margin=self._settings.harm_margin,
            restored_from_round=previous.since,
        )

    async def _gate(self, t: int, merged: dict[str, torch.Tensor]) -> Verdict | None:
        """The acceptance gate's verdict on ``merged`` against the current proxy (None: no
        gate). Measured on a worker thread; the current proxy's loss once per proxy."""
        if self._evaluate is None:
            return None
        if self._loss is None:
            self._loss = await asyncio.to_thread(self._measure, self.state)
        post = await asyncio.to_thread(self._measure, merged)
        verdict = judge(self._loss, post, self._settings.acceptance_margin)
        if verdict.rolled_back:
            self._ctx.log.warning(
                "fedproxy_merge_rejected",
                round=t,
                loss_pre=self._loss,
                loss_post=post,
                margin=self._settings.acceptance_margin,
            )
        return verdict

    def _measure(self, state: dict[str, torch.Tensor]) -> float:
        assert self._evaluate is not None
        return self._evaluate(proxy_from(self._config, state))

    async def _collect(
        self,
        core: CohortRound,
        name: str,
        address: str,
        updates: dict[str, dict[str, torch.Tensor]],
        reports: dict[str, HarmReport],
    ) -> None:
        """Ask ``name`` for its update of the round until it comes, is refused, or the
        deadline passes."""
        t, s = core.round, self._settings
        while not core.done(self._clock()):
            try:
                data = await pull_update(
                    self._ctx,
                    address,
                    t,
                    member=name,
                    max_bytes=s.max_proxy_bytes,
                    timeout_s=max(0.05, core.remaining(self._clock())),
                )
            except PeerExchangeError as err:
                if err.code in _RETRY_CODES:
                    self._ctx.log.debug(
                        "fedproxy_member_not_ready", round=t, peer=name, reason=err.reason
                    )
                    await asyncio.sleep(min(s.retry_s, core.remaining(self._clock())))
                    continue
                reason = err.reason if err.code is None else err.code.name.lower()
                self._refuse(core, name, "transfer_" + reason, str(err))
                return
            try:
                update = decode_update(
                    data, self.state, self.info, max_bytes=s.max_proxy_bytes, round_=t
                )
            except ProxyError as err:
                self._refused.labels("update", err.reason).inc()
                self._refuse(core, name, err.reason, str(err))
                return
            refusal = await asyncio.to_thread(self._admit, update.state)
            if refusal is not None:
                self._refused.labels("update", refusal[0]).inc()
                self._refuse(core, name, *refusal)
                return
            try:
                core.deliver(name, t, self._clock())
            except RoundError as err:  # the deadline passed while it was decoded
                self._ctx.log.warning("fedproxy_update_late", round=t, peer=name, error=str(err))
                return
            updates[name] = update.state
            if update.report is not None:
                reports[name] = update.report
            self._ctx.log.info("fedproxy_update_received", round=t, peer=name, bytes=len(data))
            # Delivered: done with this member for the round (without this return the loop
            # pulled and decoded its update again while another member was still pending).
            return

    def _admit(self, update: dict[str, torch.Tensor]) -> tuple[str, str] | None:
        """(reason, detail) of why ``update`` is refused, or None (on a worker thread): the
        norm bound, the frozen embeddings, the per-group bounds. The current proxy's norm,
        the bounds' reference, is computed once per proxy."""
        base, cached = self.state, self._norm_of
        if cached is None or cached[0] is not base:
            cached = (base, state_norm(base))
            self._norm_of = cached
        s = self._settings
        over = norm_refusal(base, update, max_ratio=s.max_update_norm_ratio, base_norm=cached[1])
        if over is not None:
            return NORM_REASON, over
        frozen = frozen_refusal(base, update, self._frozen)
        if frozen is not None:
            return FROZEN_REASON, frozen
        group = group_refusal(base, update, max_ratio=s.max_group_norm_ratio, base_norm=cached[1])
        if group is not None:
            return GROUP_REASON, group
        return None

    def _refuse(self, core: CohortRound, name: str, reason: str, detail: str) -> None:
        try:
            core.refuse(name, core.round, self._clock(), reason)
        except RoundError:
            return  # past the deadline: it counts as missing anyway
        self._ctx.log.warning(
            "fedproxy_update_refused", round=core.round, peer=name, reason=reason, detail=detail
        )

    async def linger(self, wait_s: float) -> frozenset[str]:
        """After the last round: keep serving until every member has pulled the final
        proxy, for up to ``wait_s``; the members that did not (logged)."""
        missing = await self.board.wait_served(self._settings.cohort, wait_s)
        if missing:
            self._ctx.log.warning(
                "fedproxy_final_not_pulled", round=self.round, members=sorted(missing)
            )
        return missing

    def fuse(self, full: PreTrainedModel) -> tuple[str, ...]:
        """Write the current global proxy into ``full``, the model it was compressed from,
        in place (plug-in fusion, Section 4.3); the keys of ``full`` that changed."""
        return fuse_into(full, proxy_from(self._config, self.state))

    def global_proxy(self) -> PreTrainedModel:
        """The current global proxy ``φ`` as a model (a fresh copy, in eval mode)."""
        return proxy_from(self._config, self.state)

    def global_state(self) -> Mapping[str, torch.Tensor]:
        """The current global proxy ``φ`` (what the last round published)."""
        return self.state
