"""The adapter merges as exchange protocols (``pmix``, SemanticDFL's PDFL step, and
``svd_hka``, OnePeFT's SVD aggregation with HKA; :mod:`peerlm.protocols`).

Student: pull the teacher's adapter and each co-sender's (``ctx.peers``: over mTLS in a
deployment), merge the usable ones
by the directive's protocol behind the acceptance gate, report Eq. 3 once
(:mod:`peerlm.agent.merging.directive`), naming any sender whose adapter disproved its
parameter-space fingerprint. Teacher: nothing to build; the peer server serves the adapter,
and the linger after the last round waits for one more pull by the student.
"""

from __future__ import annotations

from peerlm.agent.exchange.protocol import (
    ExchangeContext,
    ExchangeProtocol,
    exchange_failed,
    log_exchange,
    report_refusal,
    report_reward,
)

from peerlm.protocols import CATALOGUE
from peerlm.wire.v1 import cpm_pb2

__all__ = ["PROTOCOLS", "AdapterMerge"]


class AdapterMerge(ExchangeProtocol):
    """A merge of the senders' adapters by the entry's rule
    (:func:`peerlm.agent.merging.pull_aggregate.integrate_adapters`)."""

    async def student(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """Pull, merge, report Eq. 3
        (:func:`~peerlm.agent.merging.directive.merge_from_teacher`)."""
        from peerlm.agent.merging.directive import MergeRefused, merge_from_teacher
        from peerlm.agent.overlay_client.step import pull_settings

        s = ctx.s
        try:
            result = await merge_from_teacher(
                ctx.ctx,
                ctx.host,
                protocol=d.protocol,
                teacher=d.teacher,
                endpoint=d.peer.endpoint,
                pull=pull_settings(s.overlay, s.round_timeout_s),
                val_examples=ctx.val_examples,
                max_length=s.max_length,
                margin=s.acceptance_margin,
                reward_gamma=s.reward_gamma,
                reward_delta=s.reward_delta,
                run_model=ctx.integrating(d.protocol),
                hka=(ctx.public_pairs, ctx.config.integrating().train_settings(t))
                if ctx.public_pairs
                else None,
                round_=t,
                reward_examples=ctx.reward_examples,
                co_senders=[(c.name, c.endpoint) for c in d.co_senders],
                peers=ctx.peers,
            )
        except MergeRefused as exc:
            exchange_failed(ctx, d, "adapter_refused", exc)
            await report_refusal(ctx, d, exc.reason, exc.space_mismatch)
            return
        except Exception as exc:  # a failed exchange is logged and the round goes on
            exchange_failed(ctx, d, getattr(exc, "reason", "error"), exc)
            await report_refusal(ctx, d, getattr(exc, "reason", "error"))
            return
        ctx.slot_integrated(d.protocol)
        outcome = (t, result.loss_pre, result.loss_post, result.reward)
        if result.rolled_back:
            log_exchange(ctx.log.warning, "exchange_rolled_back", d, *outcome)
        ack = await report_reward(
            ctx,
            d,
            result.reward,
            result.loss_pre,
            result.loss_post,
            result.kilobytes,
            space_mismatch=result.space_mismatch,
        )
        if ack is None:
            return
        ctx.telemetry.merges.labels(d.protocol).inc()
        merges = ctx.summary.merges_by_protocol
        merges[d.protocol] = merges.get(d.protocol, 0) + 1
        ctx.summary.exchanges += 1
        # Adapter bytes, as the teacher counts them (overlay_bytes_sent: every adapter sent).
        ctx.summary.overlay_bytes_received += result.report.bytes_received
        ctx.summary.rewards.append(round(result.reward, 6))
        log_exchange(
            ctx.log.info,
            "exchange_integrated",
            d,
            *outcome,
            kilobytes=round(result.kilobytes, 1),
            normalised=round(ack.normalised_reward, 4),
            merged=list(result.merged),
            skipped={r.peer: r.reason for r in result.skipped},
        )

    def teacher(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """The student pulls our adapter: nothing to generate."""
        ctx.expect_adapter_pull(d.student)


#: The protocols this module implements, for the agent's registry: every merge of the
#: catalogue (its rule is chosen by name where the adapters are aggregated).
PROTOCOLS: tuple[ExchangeProtocol, ...] = tuple(
    AdapterMerge(entry) for entry in CATALOGUE if entry.is_merge
)
