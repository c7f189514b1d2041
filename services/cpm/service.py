"""The CPM's gRPC adapter: authorised calls in, the core's decisions out.

Everything that decides lives in :mod:`peerlm.services.cpm.core`; this module maps
messages to core calls, core refusals to gRPC status codes (and a metric), and fans
directives out to per-agent feeds. All core calls run on one dedicated thread, so the
event loop never blocks on SQLite's fsync and the core never sees two calls at once.

ReportReward is group-committed: calls queue up, and one batcher task hands everything
queued (up to ``MAX_REWARD_BATCH``) to the core at once, which applies the rewards and
commits their ledger rows in one transaction (one fsync); each call is answered only
after that commit. No timer delays a lone reward: the batch is whatever arrived while
the previous one was being committed, so the batch size adapts to the load.

ReportRewards is the same contract on one long-lived stream: each request message joins
the same group commit and gets one result, in order, after its commit; a refusal is a
result (code, reason, bounded message), not the end of the stream. The stream pays gRPC's,
TLS's and the interceptors' per-call cost once instead of per reward (docs/bench-cpm.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp
from peerlm.services.cpm.core import (
    CpmCore,
    CpmError,
    MatchOutcome,
    RewardOutcome,
    RewardReport,
)
from peerlm.services.cpm.metrics import CpmMetrics
from peerlm.services.cpm.records import DirectiveRecord

from peerlm.grpc_types import ServicerContext
from peerlm.pki.identity import Role, certificate_hosts_pem
from peerlm.pki.proof import FEED_NONCE_METADATA, ProofSigner, transfer_statement
from peerlm.rpc import LogLimiter, bounded_details, metadata_value
from peerlm.security.authz import current_identity
from peerlm.wire.v1 import common_pb2, cpm_pb2, cpm_pb2_grpc

__all__ = ["CPM_POLICY", "CpmService", "DirectiveHub"]

T = TypeVar("T")
_SERVICE = "/peerlm.v1.Matchmaker/"
#: Most rewards committed in one transaction (bounds one batch's latency and memory).
MAX_REWARD_BATCH = 512
_Pending = tuple[RewardReport, "asyncio.Future[RewardOutcome | CpmError]"]
#: Longest directive id echoed in a ReportRewards result (valid ids have 32 characters).
_ECHO_ID_CHARS = 64
#: Seconds between two log lines about refused stream rewards for the same reason: a
#: stream can carry thousands of refusals a second, each counted in the metric.
_STREAM_REFUSAL_LOG_INTERVAL_S = 10.0

#: Which certificate roles may call which method. Anything not listed is denied.
CPM_POLICY: dict[str, frozenset[Role]] = {
    _SERVICE + "SubmitProfile": frozenset({Role.AGENT}),
    _SERVICE + "StreamDirectives": frozenset({Role.AGENT}),
    _SERVICE + "ReportReward": frozenset({Role.AGENT}),
    _SERVICE + "ReportRewards": frozenset({Role.AGENT}),
    _SERVICE + "GetStats": frozenset({Role.ADMIN}),
    _SERVICE + "TriggerMatchmaking": frozenset({Role.ADMIN}),
}


class _Signal:
    """A control item on a feed queue (never sent to the agent)."""

    def __init__(self, name: str) -> None:
        self.name = name


_SHUTDOWN = _Signal("shutdown")
_OVERFLOW = _Signal("overflow")
_REPLACED = _Signal("replaced")


@dataclass(frozen=True)
class UnmatchedNotice:
    """An agent was considered in ``matchmaking_round`` and not paired."""

    matchmaking_round: int


FeedItem = DirectiveRecord | UnmatchedNotice | _Signal


class DirectiveHub:
    """One bounded queue per connected agent. A slow agent is disconnected (it reconnects
    and gets its open directives replayed) rather than letting its queue grow."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._queues: dict[str, asyncio.Queue[FeedItem]] = {}
        # Agents whose feed ended on their side (stream closed or cancelled), not opened
        # again and no profile since: their pending profile is stale, they are not paired
        # (a forced disconnect, _OVERFLOW or _REPLACED, does not count).
        self._closed: set[str] = set()

    @property
    def connected(self) -> int:
        return len(self._queues)

    def closed(self) -> frozenset[str]:
        """The agents that closed their directive feed and have neither opened it again nor
        submitted a profile since."""
        return frozenset(self._closed)

    def submitted(self, agent: str) -> None:
        """``agent`` submitted a profile: it wants pairing again, feed open or not."""
        self._closed.discard(agent)

    def attach(self, agent: str) -> asyncio.Queue[FeedItem]:
        old = self._queues.get(agent)
        if old is not None:
            self._force(old, _REPLACED)
        q: asyncio.Queue[FeedItem] = asyncio.Queue(maxsize=self._depth + 1)
        self._queues[agent] = q
        self._closed.discard(agent)
        return q

    def detach(self, agent: str, q: asyncio.Queue[FeedItem]) -> None:
        if self._queues.get(agent) is q:
            del self._queues[agent]
            self._closed.add(agent)

    def publish(self, directive: DirectiveRecord) -> None:
        for agent in (directive.teacher, directive.student):
            q = self._queues.get(agent)
            if q is None:
                continue  # replayed when the agent connects
            if q.qsize() >= self._depth:
                self._force(q, _OVERFLOW)
                del self._queues[agent]
            else:
                q.put_nowait(directive)

    def notify_unmatched(self, agent: str, matchmaking_round: int) -> None:
        """Tell ``agent`` it was not paired this round. Best effort: no queue, no replay (the
        agent then waits for its round timeout, as without the notice)."""
        q = self._queues.get(agent)
        if q is not None and q.qsize() < self._depth:
            q.put_nowait(UnmatchedNotice(matchmaking_round))

    def close_all(self) -> None:
        for q in self._queues.values():
            self._force(q, _SHUTDOWN)
        self._queues.clear()

    @staticmethod
    def _force(q: asyncio.Queue[FeedItem], item: _Signal) -> None:
        # The queue has one slot of headroom for signals; drop a directive if needed
        # (the agent gets it again by replay when it reconnects).
        if q.full():
            q.get_nowait()
        q.put_nowait(item)


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def directive_message(d: DirectiveRecord, recipient: str) -> cpm_pb2.Directive:
    """The directive as ``recipient`` (teacher or student) sees it."""
    teaching = recipient == d.teacher
    peer_name, peer_endpoint = (
        (d.student, d.student_endpoint) if teaching else (d.teacher, d.teacher_endpoint)
    )
    return cpm_pb2.Directive(
        directive_id=d.directive_id,
        matchmaking_round=d.matchmaking_round,
        protocol=d.protocol,
        role=cpm_pb2.EXCHANGE_ROLE_TEACHER if teaching else cpm_pb2.EXCHANGE_ROLE_STUDENT,
        teacher=d.teacher,
        student=d.student,
        peer=common_pb2.PeerAddress(name=peer_name, endpoint=peer_endpoint),
        issued_at=_timestamp(d.issued_at),
        expires_at=_timestamp(d.expires_at),
        co_senders=[common_pb2.PeerAddress(name=n, endpoint=e) for n, e in d.co_senders],
    )


class CpmService(cpm_pb2_grpc.MatchmakerServicer):
    """Implements ``peerlm.v1.Matchmaker`` over a :class:`CpmCore`."""

    def __init__(
        self,
        core: CpmCore,
        metrics: CpmMetrics,
        log: Any,
        *,
        queue_depth: int,
        tick_s: float = 1.0,
        signer: ProofSigner | None = None,
        reward_window: int = 64,
    ) -> None:
        self._core = core
        self._reward_window = reward_window
        self._refusal_log = LogLimiter(_STREAM_REFUSAL_LOG_INTERVAL_S)
        self._signer = signer
        self._m = metrics
        self._log = log
        self._hub = DirectiveHub(queue_depth)
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpm-core")
        self._kick = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tick = tick_s
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_task: asyncio.Task[None] | None = None
        self._rewards: asyncio.Queue[_Pending] = asyncio.Queue()
        # The result queue of every open ReportRewards stream, so that stop() can end them
        # (an idle stream would otherwise hold the server's shutdown for its whole grace).
        self._reward_streams: set[asyncio.Queue[Any]] = set()
        self._refresh_gauges()
        # A restart restores the bandit: its gauge shows it before the next matchmaking.
        self._m.theta_norm.set(float(np.linalg.norm(core.matchmaker.theta)))

    # ------------------------------------------------------------- lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._matchmaking_loop())
        self._batch_task = loop.create_task(self._reward_batcher())
        how = self._core.bandit_recovery
        self._m.bandit_recovery.labels(how.split(":")[0]).inc()
        log = self._log.warning if how.startswith("rebuilt") else self._log.info
        log(
            "bandit_recovered",
            how=how,
            rewards_replayed=self._core.rewards_replayed,
            ledger_rows_skipped=self._core.ledger_rows_skipped,
            bandit_updates=self._core.matchmaker.n_updates,
        )
        self._m.rewards_replayed.inc(self._core.rewards_replayed)
        self._m.snapshots.inc(self._core.snapshots_written)

    async def stop(self) -> None:
        """End every feed cleanly and stop the matchmaking loop."""
        self._stopping.set()
        self._kick.set()
        self._hub.close_all()
        for results in self._reward_streams:
            results.put_nowait(_SHUTDOWN)
        if self._loop_task is not None:
            await self._loop_task
        if self._batch_task is not None:
            self._batch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batch_task

    def close(self) -> None:
        """Write a final bandit snapshot (so the next start replays nothing) and stop."""
        try:
            self._exec.submit(self._core.snapshot_if_behind).result()
        except Exception:
            # The ledger holds every acknowledged reward: the next start replays them.
            self._log.exception("final_snapshot_failed")
        self._exec.shutdown(wait=True)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def _refuse(self, context: ServicerContext, rpc: str, err: CpmError) -> None:
        self._m.rejected.labels(rpc, err.reason).inc()
        self._log.warning(
            "request_refused", rpc=rpc, reason=err.reason, detail=err.message, peer=_caller_name()
        )
        if err.trailers:
            context.set_trailing_metadata(err.trailers)
        await context.abort(grpc.StatusCode[err.code], err.message)

    # ------------------------------------------------------------------ RPCs

    async def SubmitProfile(
        self, request: cpm_pb2.SubmitProfileRequest, context: ServicerContext
    ) -> cpm_pb2.SubmitProfileResponse:
        agent = current_identity().name
        try:
            out = await self._call(
                functools.partial(
                    self._core.submit_profile,
                    agent,
                    request.round,
                    list(request.features),
                    request.peer_endpoint,
                    self._hub.connected,
                    endpoint_hosts=_certificate_hosts(context),
                    param_space=request.parameter_space,
                    protocols=list(request.protocols),
                    overlay_peers=list(request.overlay_peers),
                )
            )
        except CpmError as err:
            await self._refuse(context, "SubmitProfile", err)
            raise AssertionError("unreachable") from None
        self._m.profiles.inc()
        # A profile submitted after the feed closed is a fresh wish to be paired (the
        # directive is replayed when the feed opens); only one submitted before is stale.
        self._hub.submitted(agent)
        self._refresh_gauges()
        self._log.info(
            "profile_received",
            agent=agent,
            round=request.round,
            pending=out.pending,
            quorum=out.quorum_reached,
        )
        if out.quorum_reached:
            self._kick.set()
        return cpm_pb2.SubmitProfileResponse(
            matchmaking_round=out.matchmaking_round, profiles_pending=out.pending
        )

    async def StreamDirectives(
        self, request: cpm_pb2.StreamDirectivesRequest, context: ServicerContext
    ) -> AsyncIterator[cpm_pb2.Directive]:
        agent = current_identity().name
        nonce = metadata_value(context, FEED_NONCE_METADATA)
        if nonce is not None and not _NONCE.fullmatch(nonce):
            self._m.rejected.labels("StreamDirectives", "bad_nonce").inc()
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{FEED_NONCE_METADATA} must be 32 to 64 lower-case hex digits",
            )
        if nonce is not None and self._signer is not None:
            # The agent cannot see our certificate in TLS: prove that a CPM answers, for this
            # agent and this connection's nonce (peerlm.pki.proof).
            statement = transfer_statement("directive-feed", nonce, agent, b"")
            await context.send_initial_metadata(self._signer.metadata(statement))
        if self._stopping.is_set():
            # A feed re-opened between stop() closing the feeds and the server stopping would
            # otherwise be cut by the server's grace and counted as CANCELLED; say why instead.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the CPM is shutting down")
        queue = self._hub.attach(agent)
        self._m.connected.set(self._hub.connected)
        self._log.info("directive_feed_opened", agent=agent)
        seen: set[str] = set()
        try:
            for d in await self._call(self._core.open_directives_for, agent):
                seen.add(d.directive_id)
                yield directive_message(d, agent)
            # A matchmaking round may have started while we replayed: quorum counts us now.
            self._kick.set()
            while True:
                item = await queue.get()
                if item is _SHUTDOWN:
                    return
                if item is _OVERFLOW:
                    self._m.rejected.labels("StreamDirectives", "overflow").inc()
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "directive feed fell behind; reconnect to get open directives replayed",
                    )
                if item is _REPLACED:
                    await context.abort(
                        grpc.StatusCode.ABORTED,
                        "another directive feed was opened for this agent",
                    )
                if isinstance(item, UnmatchedNotice):
                    yield cpm_pb2.Directive(
                        matchmaking_round=item.matchmaking_round,
                        role=cpm_pb2.EXCHANGE_ROLE_UNMATCHED,
                    )
                    continue
                assert isinstance(item, DirectiveRecord)
                if item.directive_id in seen:
                    continue
                seen.add(item.directive_id)
                yield directive_message(item, agent)
        finally:
            self._hub.detach(agent, queue)
            self._m.connected.set(self._hub.connected)
            self._log.info("directive_feed_closed", agent=agent)

    async def ReportReward(
        self, request: cpm_pb2.ReportRewardRequest, context: ServicerContext
    ) -> cpm_pb2.ReportRewardResponse:
        agent = current_identity().name
        report = RewardReport(
            agent,
            request.directive_id,
            request.reward,
            request.loss_pre,
            request.loss_post,
            request.kilobytes,
            request.failure,
            tuple(request.space_mismatch),
        )
        done: asyncio.Future[RewardOutcome | CpmError] = asyncio.get_running_loop().create_future()
        self._rewards.put_nowait((report, done))
        out = await done
        if isinstance(out, CpmError):
            await self._refuse(context, "ReportReward", out)
            raise AssertionError("unreachable")
        return cpm_pb2.ReportRewardResponse(
            directive_id=request.directive_id,
            normalised_reward=out.normalised,
            bandit_updates=out.bandit_updates,
        )

    async def ReportRewards(
        self,
        request_iterator: AsyncIterable[cpm_pb2.ReportRewardRequest],
        context: ServicerContext,
    ) -> AsyncIterator[cpm_pb2.ReportRewardResult]:
        agent = current_identity().name
        if self._stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the CPM is shutting down")
        loop = asyncio.get_running_loop()
        # Read ahead of the results by at most reward_window messages; beyond that the
        # client waits in HTTP/2 flow control, so one stream holds bounded memory here.
        window = asyncio.Semaphore(self._reward_window)
        # In request order: (echoed id, outcome future); None ends (the client is done);
        # _SHUTDOWN ends (the CPM stops: what is unanswered was not acknowledged); an
        # exception is raised.
        order: asyncio.Queue[
            tuple[str, asyncio.Future[RewardOutcome | CpmError]] | BaseException | _Signal | None
        ] = asyncio.Queue()

        async def read() -> None:
            try:
                messages = aiter(request_iterator)
                while True:
                    await window.acquire()
                    try:
                        request = await anext(messages)
                    except StopAsyncIteration:
                        break
                    report = RewardReport(
                        agent,
                        request.directive_id,
                        request.reward,
                        request.loss_pre,
                        request.loss_post,
                        request.kilobytes,
                        request.failure,
                        tuple(request.space_mismatch),
                    )
                    done: asyncio.Future[RewardOutcome | CpmError] = loop.create_future()
                    self._rewards.put_nowait((report, done))
                    order.put_nowait((request.directive_id[:_ECHO_ID_CHARS], done))
                order.put_nowait(None)
            except BaseException as exc:  # a malformed message's abort, a cancelled call
                order.put_nowait(exc)
                raise

        reader = loop.create_task(read())
        pending: list[asyncio.Future[RewardOutcome | CpmError]] = []
        self._reward_streams.add(order)
        try:
            while True:
                item = await order.get()
                if item is None or item is _SHUTDOWN:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, tuple)
                directive_id, done = item
                pending.append(done)
                out = await done
                pending.pop()
                window.release()
                if isinstance(out, CpmError):
                    yield self._stream_refusal(directive_id, out)
                    continue
                yield cpm_pb2.ReportRewardResult(
                    directive_id=directive_id,
                    ack=cpm_pb2.ReportRewardResponse(
                        directive_id=directive_id,
                        normalised_reward=out.normalised,
                        bandit_updates=out.bandit_updates,
                    ),
                )
        finally:
            self._reward_streams.discard(order)
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            # Rewards read but not yet answered: one not yet taken by the batcher is dropped
            # (never acknowledged, so the client sends it again); one being committed is
            # committed (a resend is answered ALREADY_EXISTS).
            while not order.empty():
                rest = order.get_nowait()
                if isinstance(rest, tuple):
                    rest[1].cancel()
            for done in pending:
                done.cancel()

    def _stream_refusal(self, directive_id: str, err: CpmError) -> cpm_pb2.ReportRewardResult:
        """A refused reward as a stream result; counted, and logged at a bounded rate."""
        self._m.rejected.labels("ReportRewards", err.reason).inc()
        suppressed = self._refusal_log.admit(err.reason)
        if suppressed is not None:
            self._log.warning(
                "request_refused",
                rpc="ReportRewards",
                reason=err.reason,
                detail=err.message,
                peer=_caller_name(),
                suppressed_since_last=suppressed,
            )
        return cpm_pb2.ReportRewardResult(
            directive_id=directive_id,
            refused=cpm_pb2.RewardRefusal(
                code=grpc.StatusCode[err.code].value[0],
                reason=err.reason,
                message=bounded_details(err.message),
            ),
        )

    async def _reward_batcher(self) -> None:
        """Group commit: everything queued goes to the core as one batch, one fsync.

        Cancelled at shutdown: every reward it holds or that is queued is answered
        UNAVAILABLE (not acknowledged; the sender retries, and a reward whose commit
        finished meanwhile is then answered ALREADY_EXISTS), so no call waits for the
        server's grace to run out.
        """
        live: list[_Pending] = []
        try:
            await self._batch_forever(live)
        except asyncio.CancelledError:
            err = CpmError(
                "UNAVAILABLE",
                "shutting_down",
                "the CPM is shutting down; the reward was not acknowledged, send it again",
            )
            while not self._rewards.empty():
                live.append(self._rewards.get_nowait())
            for _, fut in live:
                if not fut.done():
                    fut.set_result(err)
            raise

    async def _batch_forever(self, live: list[_Pending]) -> None:
        """The batcher's loop; ``live`` holds the batch being committed."""
        while True:
            live.clear()
            batch = [await self._rewards.get()]
            while len(batch) < MAX_REWARD_BATCH and not self._rewards.empty():
                batch.append(self._rewards.get_nowait())
            live.extend((rep, fut) for rep, fut in batch if not fut.cancelled())
            if not live:
                continue
            snapshots = self._core.snapshots_written
            refactors = self._core.bandit_refactors
            disproofs = self._core.space_disproofs_recorded
            try:
                results = await self._call(self._core.report_rewards, [r for r, _ in live])
            except Exception as exc:
                # Not committed, so not acknowledged: each caller gets UNAVAILABLE and may
                # retry (the directive id makes a retry safe).
                self._log.exception("reward_batch_failed", size=len(live))
                err = CpmError("UNAVAILABLE", "commit_failed", f"reward not committed: {exc}")
                results = [err] * len(live)
            self._m.reward_batch.observe(len(live))
            committed = [
                (rep, done)
                for (rep, _), done in zip(live, results, strict=True)
                if isinstance(done, RewardOutcome)
            ]
            if committed:
                # One line per group commit, not per reward: at thousands of rewards per
                # second a line each would cost more than the commit.
                self._m.rewards.inc(len(committed))
                for _, done in committed:
                    self._m.normalised_reward.observe(done.normalised)
                    record = done.directive.reward
                    if record is not None and record.failure:
                        self._m.exchange_refusals.labels(
                            record.failure, done.directive.protocol
                        ).inc()
                self._log.info(
                    "rewards_committed",
                    count=len(committed),
                    bandit_updates=self._core.matchmaker.n_updates,
                    rewards=[
                        {
                            "agent": rep.agent,
                            "directive": rep.directive_id,
                            "teacher": done.directive.teacher,
                            "round": done.directive.matchmaking_round,
                            "reward": rep.reward,
                            "normalised": round(done.normalised, 4),
                            **(
                                {"failure": done.directive.reward.failure}
                                if done.directive.reward is not None
                                and done.directive.reward.failure
                                else {}
                            ),
                        }
                        for rep, done in committed
                    ],
                )
            self._m.snapshots.inc(max(0, self._core.snapshots_written - snapshots))
            self._m.bandit_refactors.inc(max(0, self._core.bandit_refactors - refactors))
            new_disproofs = self._core.space_disproofs_recorded - disproofs
            if new_disproofs > 0:
                self._m.space_disproofs.inc(new_disproofs)
                self._log.warning(
                    "space_disproofs_recorded",
                    count=new_disproofs,
                    reports=[
                        {"student": rep.agent, "senders": list(rep.space_mismatch)}
                        for rep, _ in committed
                        if rep.space_mismatch
                    ],
                )
            for (_, fut), res in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
            self._refresh_gauges()

    async def GetStats(
        self, request: cpm_pb2.GetStatsRequest, context: ServicerContext
    ) -> cpm_pb2.CpmStats:
        return await self._call(self._stats)

    async def TriggerMatchmaking(
        self, request: cpm_pb2.TriggerMatchmakingRequest, context: ServicerContext
    ) -> cpm_pb2.TriggerMatchmakingResponse:
        out = await self._run_matchmaking("admin")
        return cpm_pb2.TriggerMatchmakingResponse(
            matchmaking_round=out.matchmaking_round, pairs=len(out.directives)
        )

    # ------------------------------------------------------------ internals

    def _stats(self) -> cpm_pb2.CpmStats:
        core = self._core
        state = core.matchmaker.snapshot()
        counts = core.directive_counts()
        # The normaliser's centre and spread: mean and s.d. under "zscore", median and
        # 1.4826 * MAD under "robust" (the snapshot holds no moments then).
        centre, spread = core.matchmaker.reward_statistics
        agents = [
            cpm_pb2.AgentStats(
                name=p.agent,
                last_round=p.round,
                exchanges=state.trust.get(p.agent, (0, 0))[0],
                successes=state.trust.get(p.agent, (0, 0))[1],
                peer_endpoint=p.endpoint,
                last_profile_at=_timestamp(p.received_at),
            )
            for p in core.agents()
        ]
        return cpm_pb2.CpmStats(
            matchmaking_rounds=core.matchmaking_round,
            profiles_received=core.profiles_received,
            directives_issued=sum(counts.values()),
            directives_open=core.open_count,
            rewards_observed=state.n_updates,
            bandit_updates=state.n_updates,
            theta_norm=float(np.linalg.norm(core.matchmaker.theta)),
            reward_mean=centre,
            reward_std=spread,
            context_dim=state.context_dim,
            agents=agents,
        )

    def _refresh_gauges(self) -> None:
        self._m.open_directives.set(self._core.open_count)
        self._m.bandit_updates.set(self._core.matchmaker.n_updates)
        # Not len(agents()): that sorts every profile, per group commit, on the event loop
        # thread while the core thread may be adding one.
        self._m.agents.set(self._core.agent_count)
        self._m.space_disproved.set(self._core.disproved_members)
        self._m.connected.set(self._hub.connected)

    async def _run_matchmaking(self, trigger: str) -> MatchOutcome:
        # An agent that closed its directive feed is not paired: a directive to it would only
        # expire, holding its partner for the round.
        out = await self._call(self._core.matchmake, self._hub.closed())
        if out.without_feed:
            self._m.without_feed.inc(len(out.without_feed))
            self._log.info("unpaired_without_feed", agents=list(out.without_feed))
        if out.candidates >= 2:
            self._m.matchmaking_rounds.labels(trigger).inc()
            self._m.matchmaking_seconds.observe(out.seconds)
            theta = await self._call(lambda: float(np.linalg.norm(self._core.matchmaker.theta)))
            self._m.theta_norm.set(theta)
        for d in out.directives:
            self._m.directives.labels(d.protocol).inc()
            self._hub.publish(d)
        for agent in out.unmatched:
            self._hub.notify_unmatched(agent, out.unmatched_round)
        self._refresh_gauges()
        if out.directives:
            self._log.info(
                "matchmaking_round",
                round=out.matchmaking_round,
                trigger=trigger,
                candidates=out.candidates,
                pairs=[f"{d.teacher}->{d.student}" for d in out.directives],
                ms=round(out.seconds * 1000, 2),
            )
        return out

    async def _matchmaking_loop(self) -> None:
        """Quorum (kicked by SubmitProfile) or timer; also closes expired directives.

        The loop waits on an event with a timeout rather than sleeping a fixed period, so
        it neither drifts nor delays a quorum round by up to a tick.
        """
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=self._tick)
            self._kick.clear()
            if self._stopping.is_set():
                return
            try:
                trigger = await self._call(self._core.match_due, self._hub.connected)
                if trigger is not None:
                    await self._run_matchmaking(trigger)
                expired = await self._call(self._core.expire_due)
                if expired:
                    self._m.expired.inc(len(expired))
                    self._refresh_gauges()
                    self._log.info("directives_expired", count=len(expired))
            except Exception:
                self._log.exception("matchmaking_loop_error")


def _certificate_hosts(context: ServicerContext) -> frozenset[str] | None:
    """The DNS/IP SANs of the caller's verified certificate; None without one (insecure-dev,
    where the AuthInterceptor admitted a dev identity from metadata)."""
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    if not pems:
        return None
    return certificate_hosts_pem(pems[0])


def _caller_name() -> str:
    try:
        return current_identity().spiffe_uri
    except RuntimeError:
        return "unknown"


_NONCE = re.compile(r"[0-9a-f]{32,64}")
