"""KNEXA-FL's adaptive knowledge distillation as exchange protocols (``akd``,
``akd_logits``; :mod:`peerlm.protocols`).

Student: fetch the teacher's knowledge package (``ctx.peers``: over mTLS in a deployment),
decode and vet it, integrate it by AKD (Eq. 2) behind the acceptance gate
(:func:`peerlm.agent.exchange.rounds.integrate_package`), and report Eq. 3 to the CPM.
Teacher: generate the package's predictions at once, ahead of the next round's training, so
the student does not wait behind it; the peer server answers the student's fetch (text or
top-k logits by the entry's payload, ``akd_mode``).
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

from peerlm.protocols import AKD, AKD_LOGITS
from peerlm.wire.v1 import cpm_pb2

__all__ = ["PROTOCOLS", "Distillation"]

#: The metric label of every AKD integration, text or logits (``kind`` of the rollback and
#: peer-slot counters): the text protocol's name, as it has always been.
_LABEL = AKD.name


class Distillation(ExchangeProtocol):
    """AKD of a teacher's package (text or logits, by the entry's payload)."""

    async def student(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """Fetch, integrate by AKD (Eq. 2), report Eq. 3."""
        from peerlm.agent.exchange.package import PackageError, decode_package, student_limits
        from peerlm.agent.exchange.rounds import integrate_package
        from peerlm.agent.modelhost import TokenizerMismatchError
        from peerlm.agent.vetting.logits import vet_student_package

        s = ctx.s
        try:
            data = await ctx.peers.fetch_package(
                d.peer.endpoint,
                d.directive_id,
                expect=d.teacher,
                max_bytes=s.max_package_bytes,
                timeout_s=s.round_timeout_s,
                tokenizer_sha256=ctx.host.tokenizer_hash,
            )
            package = decode_package(
                data,
                expect_transfer_sha256=ctx.transfer_digest,
                expect_directive_id=d.directive_id,
                expect_teacher=d.teacher,
                **student_limits(len(ctx.transfer_prompts), s.package_max_item_bytes),
            )
            # A logits item teaches every token it gives mass, not only column 0's text:
            # each such text is vetted before anything is learnt.
            package = await ctx.run_model(
                vet_student_package, package, ctx.host.tokenizer, ctx.guardrail, ctx.ctx
            )
            kb = len(data) / 1024.0
            result = await ctx.integrating(_LABEL)(
                integrate_package,
                ctx.host,
                package,
                kilobytes=kb,
                local_examples=ctx.train_examples,
                val_examples=ctx.val_examples,
                transfer_prompts=ctx.transfer_prompts,
                config=ctx.config.integrating(),
                t=t,
                guardrail=ctx.guardrail,
                reward_examples=ctx.reward_examples,
                learns=ctx.slot_learns,
                reward_scope=ctx.reward_scope,
            )
        except (PackageError, TokenizerMismatchError) as exc:
            reason = "package" if isinstance(exc, PackageError) else "tokenizer_mismatch"
            if isinstance(exc, PackageError):
                ctx.telemetry.package_refusals.labels(exc.reason).inc()
            exchange_failed(ctx, d, reason, exc)
            await report_refusal(ctx, d, reason)
            return
        except Exception as exc:  # a failed exchange is logged and the round goes on
            exchange_failed(ctx, d, getattr(exc, "reason", "error"), exc)
            await report_refusal(ctx, d, getattr(exc, "reason", "error"))
            return
        ctx.note_interrupted(result.stats.interrupted, t, "integrate", result.stats.steps)
        ctx.slot_integrated(_LABEL)
        if result.rolled_back:
            # Undone by the acceptance gate; the CPM still hears the (negative) reward.
            ctx.telemetry.rolled_back.labels(_LABEL).inc()
            log_exchange(
                ctx.log.warning,
                "exchange_rolled_back",
                d,
                t,
                result.loss_pre,
                result.loss_post,
                result.reward,
            )
        ack = await report_reward(ctx, d, result.reward, result.loss_pre, result.loss_post, kb)
        if ack is None:
            return
        if result.stats.steps:  # not a package the peer slot learns none of
            ctx.telemetry.packages_integrated.labels(result.mode).inc()
        ctx.summary.exchanges += 1
        ctx.summary.bytes_received += len(data)
        ctx.summary.rewards.append(round(result.reward, 6))
        log_exchange(
            ctx.log.info,
            "exchange_integrated",
            d,
            t,
            result.loss_pre,
            result.loss_post,
            result.reward,
            mode=result.mode,
            steps=result.stats.steps,
            alpha_kd=round(result.alpha_kd, 3),
            temperature=None if result.temperature is None else round(result.temperature, 3),
            kilobytes=round(kb, 1),
            normalised=round(ack.normalised_reward, 4),
        )

    def teacher(self, ctx: ExchangeContext, d: cpm_pb2.Directive, t: int) -> None:
        """Generate the predictions now, ahead of the next round's training in the model
        worker's queue, so the student does not wait behind it."""
        ctx.prebuild_predictions(d)


#: The protocols this module implements, for the agent's registry.
PROTOCOLS: tuple[ExchangeProtocol, ...] = (Distillation(AKD), Distillation(AKD_LOGITS))
