"""The agent side of the CPM contract: submit profiles, follow directives, report rewards.

Two recoveries live here:

* **Rewards are retried idempotently.** Rewards go over one long-lived ReportRewards
  stream (opened on the first reward, re-opened after it breaks; one reward in flight at a
  time), which spares the CPM gRPC's per-call cost. A reward whose stream fails with
  UNAVAILABLE or DEADLINE_EXCEEDED (the CPM restarting, a cut link) is sent again with the
  same directive id, on a new stream, with backoff, for up to ``reward_retry_s``. The
  directive id makes this safe: the CPM applies a reward once; if an earlier attempt was
  committed before the connection broke, the retry is answered ALREADY_EXISTS, which here
  means "acknowledged". A refusal comes back as a result on the stream and is raised as
  the same ``AioRpcError`` the unary ReportReward would have ended with.
* **A stream the CPM ends early is judged by its status, not by the failed write.** When
  the CPM refuses the stream as it opens (PERMISSION_DENIED for a non-agent,
  UNAVAILABLE while it shuts down, RESOURCE_EXHAUSTED past the per-identity call limit)
  or ends it, a write that races its status fails in grpc.aio with INTERNAL ("Internal
  error from Core") instead of the server's code, and the call's own status is then
  overwritten with that INTERNAL too (grpc/grpc#36066; 11 of 100 refused reports here).
  Acting on it would raise a refusal under the wrong code and, worse, give up at once on
  a CPM that is only restarting. A write that failed sent nothing, so the reward is then
  sent once with the unary ReportReward, whose status is the server's own, and that
  answer (acknowledgement, refusal, UNAVAILABLE to retry) is acted on. A write refused
  because the call had already ended is judged by the call's final status (which no
  write overwrote).
* **Rounds resynchronise after a restart.** An agent that restarts with fresh state or
  falls back to an older checkpoint numbers its rounds from there, and the CPM refuses a
  profile older than one it already holds (``stale_round``), telling the last round it
  holds in the ``peerlm-last-round`` trailer. The client then shifts its round numbering
  by a fixed offset so that this profile is sent as the next round, and keeps that offset
  for the rest of the run (rounds stay increasing for the CPM; the agent's own training
  round is unchanged). The profile's content is the agent's current one, so the CPM
  matches it as it is now.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from peerlm.metrics import get_counter
from peerlm.node import NodeContext
from peerlm.pki.identity import Role
from peerlm.pki.proof import FEED_NONCE_METADATA, ProofError
from peerlm.wire.v1 import cpm_pb2, cpm_pb2_grpc

__all__ = [
    "DEV_IDENTITY_METADATA",
    "LAST_ROUND_METADATA",
    "CpmClient",
    "next_directive",
    "rest_of_round",
]

#: After a round's first directive, how long further ones of its matchmaking round may
#: take to arrive (the CPM sends a round's directives together), and the most one round
#: takes (a bound against a feed that floods; a round gives an agent one directive as
#: student and one per student it teaches).
ROUND_SETTLE_S = 0.25
MAX_DIRECTIVES_PER_ROUND = 64

#: Trailing metadata of the CPM's ``stale_round`` refusal (the last round it holds for us);
#: the same name as ``peerlm.services.cpm.core.LAST_ROUND_METADATA`` (agents do not import
#: the service).
LAST_ROUND_METADATA = "peerlm-last-round"
#: ``peerlm.services.cpm.core.REFUSED_FIELD_METADATA``: the profile field a refusal names.
REFUSED_FIELD_METADATA = "peerlm-refused-field"

#: Metadata key carrying the caller's SPIFFE id in insecure-dev mode only.
DEV_IDENTITY_METADATA = "peerlm-dev-identity"

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

# Codes after which re-opening the directive feed can succeed.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


class CpmClient:
    """A channel to the CPM with the calls an agent makes, dialled by the agent's context.

    Under mTLS the directive feed must prove it comes from a CPM (``peerlm.pki.proof``); in
    insecure-dev the context names us with the dev identity. The CPM refuses a bad
    certificate in the handshake, where no server code runs: only this side can count it
    (``peerlm_grpc_client_tls_failures_total``, by the context's channel).
    """

    def __init__(
        self,
        ctx: NodeContext,
        target: str,
        *,
        role: Role = Role.CPM,
        reward_retry_s: float = 60.0,
    ) -> None:
        """``role``: whose proof the feed must carry (a CPM's; tests name another).
        ``reward_retry_s``: how long a reward is re-sent after UNAVAILABLE or a deadline."""
        self._limits = ctx.limits
        self._peer = ctx.dial(target, expect=role)
        self._tls_failures = ctx.tls_failures
        self._feed_proof = self._peer.expected
        self._channel = self._peer.channel
        self._round_offset = 0
        self._reward_retry_s = reward_retry_s
        self._retries = get_counter(
            ctx.registry,
            "peerlm_agent_cpm_recoveries_total",
            "CPM calls recovered by the client: reward retries after UNAVAILABLE or a "
            "deadline, rewards re-sent by the unary call after a stream write failed "
            "(reward_unary), round resynchronisations after stale_round, overlay lists the "
            "CPM refused dropped from a profile.",
            ("kind",),
        )
        self._stub = cpm_pb2_grpc.MatchmakerStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = self._peer.metadata
        # The reward stream, and the lock that keeps one reward in flight on it (results
        # come in request order; one at a time keeps each result with its caller).
        self._reward_call: Any = None
        self._reward_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._reward_call is not None:
            self._reward_call.cancel()
            self._reward_call = None
        await self._channel.close(None)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    @property
    def round_offset(self) -> int:
        """Added to the agent's round in every profile (non-zero after a resync)."""
        return self._round_offset

    async def submit_profile(
        self,
        round_: int,
        features: Sequence[float],
        peer_endpoint: str = "",
        *,
        parameter_space: str = "",
        protocols: Sequence[str] = (),
        overlay_peers: Sequence[str] = (),
    ) -> cpm_pb2.SubmitProfileResponse:
        """Submit a profile; on ``stale_round`` resynchronise the round numbering once.

        ``parameter_space`` and ``protocols``: what this agent declares for the CPM's
        protocol menu (:func:`peerlm.agent.cpm.profile.parameter_space_fingerprint`).
        ``overlay_peers``: its overlay top-K, narrowing the senders of its merge
        directives; a list the CPM refuses (a peer it does not know yet, say) is dropped
        and the profile sent again without it (counted: ``overlay_peers_dropped``)."""
        req = cpm_pb2.SubmitProfileRequest(
            features=list(features),
            peer_endpoint=peer_endpoint,
            parameter_space=parameter_space,
            protocols=list(protocols),
            overlay_peers=list(overlay_peers),
        )
        try:
            return await self._submit(round_ + self._round_offset, req)
        except grpc.aio.AioRpcError as err:
            if req.overlay_peers and _refused_field(err) == "overlay_peers":
                self._retries.labels("overlay_peers_dropped").inc()
                del req.overlay_peers[:]
                return await self.submit_profile(
                    round_,
                    features,
                    peer_endpoint,
                    parameter_space=parameter_space,
                    protocols=protocols,
                )
            last = _last_round(err)
            if last is None:
                raise
        self._round_offset = last + 1 - round_
        self._retries.labels("round_resync").inc()
        return await self._submit(round_ + self._round_offset, req)

    async def _submit(
        self, sent_round: int, template: cpm_pb2.SubmitProfileRequest
    ) -> cpm_pb2.SubmitProfileResponse:
        req = cpm_pb2.SubmitProfileRequest()
        req.CopyFrom(template)
        req.round = sent_round
        resp: cpm_pb2.SubmitProfileResponse = await self._stub.SubmitProfile(
            req, timeout=self._limits.rpc_timeout_s, metadata=self._metadata
        )
        return resp

    async def report_reward(
        self,
        directive_id: str,
        reward: float,
        *,
        loss_pre: float = 0.0,
        loss_post: float = 0.0,
        kilobytes: int = 0,
        failure: int = 0,
        space_mismatch: Sequence[str] = (),
    ) -> cpm_pb2.ReportRewardResponse:
        """Report Eq. 3's ``reward`` for a directive, or with ``failure`` (a
        ``peerlm.v1.ExchangeFailure`` value, ``reward`` 0) that the student refused it;
        retried idempotently (module docstring). ``space_mismatch``: the directive's
        senders whose pulled adapter proved to be of another parameter space than this
        agent's (the CPM's record of a disproved fingerprint)."""
        req = cpm_pb2.ReportRewardRequest(
            directive_id=directive_id,
            reward=reward,
            loss_pre=loss_pre,
            loss_post=loss_post,
            kilobytes=kilobytes,
            failure=failure,  # type: ignore[arg-type]
            space_mismatch=list(space_mismatch),
        )
        deadline = time.monotonic() + self._reward_retry_s
        backoff = 0.25
        attempt = 0
        while True:
            attempt += 1
            try:
                result = await self._report_on_stream(req)
                if result.HasField("ack"):
                    return result.ack
                raise _rpc_error(
                    _STATUS_BY_VALUE.get(result.refused.code, grpc.StatusCode.UNKNOWN),
                    f"{result.refused.message} ({result.refused.reason})",
                )
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.ALREADY_EXISTS and attempt > 1:
                    # An earlier attempt was committed before its answer was lost.
                    return cpm_pb2.ReportRewardResponse(directive_id=directive_id)
                retryable = code in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if not retryable or time.monotonic() + backoff > deadline:
                    raise
            self._retries.labels("reward_retry").inc()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _report_on_stream(
        self, req: cpm_pb2.ReportRewardRequest
    ) -> cpm_pb2.ReportRewardResult:
        """Send one reward on the reward stream and read its result. A broken stream is
        dropped (the next reward opens a new one) and raised as an ``AioRpcError``: the
        server's status when it ended the stream with one, UNAVAILABLE when it ended it
        cleanly, DEADLINE_EXCEEDED when no result came in time. A write that failed as
        INTERNAL is answered by the unary call instead (module docstring)."""
        timeout = self._limits.rpc_timeout_s
        async with self._reward_lock:
            call = self._reward_call
            if call is None or call.done():
                # The stub is typed for the sync API; on an aio channel a stream call without
                # a request iterator is written to with write().
                call = self._stub.ReportRewards(metadata=self._metadata)  # type: ignore[call-arg]
                self._reward_call = call
            try:
                await asyncio.wait_for(call.write(req), timeout)
            except grpc.aio.AioRpcError as err:
                self._tls_failures.observe(err)
                self._drop_reward_call(call)
                if err.code() != grpc.StatusCode.INTERNAL:
                    raise  # the server's status, read before the write was attempted
                # Perhaps grpc/grpc#36066's race, perhaps a real INTERNAL: the write sent
                # nothing, and the unary call's status is the server's either way.
                self._retries.labels("reward_unary").inc()
                return await self._report_unary(req, timeout)
            except TimeoutError:
                self._drop_reward_call(call)
                raise _rpc_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no reward result in time"
                ) from None
            except asyncio.InvalidStateError:  # the stream ended between done() and write()
                self._drop_reward_call(call)
                raise await _final_status(call) from None
            try:
                result = await asyncio.wait_for(call.read(), timeout)
            except grpc.aio.AioRpcError as err:
                # A stream's handshake failure surfaces here (unary calls: the channel counts).
                self._tls_failures.observe(err)
                self._drop_reward_call(call)
                raise
            except TimeoutError:
                self._drop_reward_call(call)
                raise _rpc_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no reward result in time"
                ) from None
            if result is grpc.aio.EOF:  # type: ignore[attr-defined]  # the CPM closed it (shutting down)
                self._drop_reward_call(call)
                raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the reward stream ended")
            assert isinstance(result, cpm_pb2.ReportRewardResult)
            return result

    async def _report_unary(
        self, req: cpm_pb2.ReportRewardRequest, timeout: float
    ) -> cpm_pb2.ReportRewardResult:
        """``req`` by the unary ReportReward, its answer as the stream would give it (a
        refusal is raised, with the server's code, as the stream's would be)."""
        ack = await self._stub.ReportReward(req, metadata=self._metadata, timeout=timeout)
        return cpm_pb2.ReportRewardResult(directive_id=ack.directive_id, ack=ack)

    def _drop_reward_call(self, call: Any) -> None:
        call.cancel()
        if self._reward_call is call:
            self._reward_call = None

    async def directives(self, max_backoff_s: float = 10.0) -> AsyncIterator[cpm_pb2.Directive]:
        """Directives for this agent, forever; the feed is re-opened after transient errors.

        Open directives are replayed by the CPM on every (re)connect, so a directive may be
        seen twice across a reconnect; consumers de-duplicate by id (this iterator does).
        "Not matched this round" notices (``EXCHANGE_ROLE_UNMATCHED``, no id) pass through.
        Authentication and authorisation failures, and ABORTED (another feed for this
        agent replaced this one), are raised, not retried. With ``feed_proof`` every feed
        must open with the CPM's proof over a fresh nonce of ours; a feed without one is
        raised as UNAUTHENTICATED before any directive is read from it.
        """
        seen: set[str] = set()
        backoff = 0.2
        while True:
            nonce = secrets.token_hex(16)
            metadata = self._metadata
            if self._feed_proof is not None:
                metadata = (*metadata, (FEED_NONCE_METADATA, nonce))
            call = self._stub.StreamDirectives(cpm_pb2.StreamDirectivesRequest(), metadata=metadata)
            try:
                if self._feed_proof is not None:
                    await self._check_feed(call, nonce)
                async for d in call:
                    backoff = 0.2
                    if d.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED:
                        yield d  # a notice: no id to de-duplicate by
                    elif d.directive_id not in seen:
                        seen.add(d.directive_id)
                        yield d
                # A clean end means the CPM is shutting down: reconnect once it is back.
            except grpc.aio.AioRpcError as err:
                # A feed's handshake failure surfaces here (unary calls: the channel counts).
                self._tls_failures.observe(err)
                if err.code() not in _RETRYABLE:
                    raise
            finally:
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)

    async def _check_feed(self, call: Any, nonce: str) -> None:
        """Verify the feed's proof before reading any directive from it.

        A call that failed before sending headers (CPM down, network cut) has no proof and
        no directives: its own error is raised, so the caller retries it as usual.
        """
        assert self._feed_proof is not None
        metadata = await call.initial_metadata()
        try:
            self._feed_proof.verify(metadata, "directive-feed", nonce, b"")
        except ProofError as err:
            if err.reason == "missing" and call.done():
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    raise grpc.aio.AioRpcError(
                        code, grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details(), ""
                    ) from None
            call.cancel()
            raise _unauthenticated(
                f"the directive feed did not prove it comes from a CPM: {err} ({err.reason})"
            ) from None


def _refused_field(err: grpc.aio.AioRpcError) -> str | None:
    """The profile field an ``INVALID_ARGUMENT`` refusal names, else None."""
    if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    trailers: Any = err.trailing_metadata() or ()
    for item in trailers:
        if str(item[0]) == REFUSED_FIELD_METADATA:
            return str(item[1])
    return None


def _last_round(err: grpc.aio.AioRpcError) -> int | None:
    """The CPM's last round for us from a ``stale_round`` refusal, else None."""
    if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    trailers: Any = err.trailing_metadata() or ()
    for item in trailers:
        key, value = str(item[0]), item[1]
        if key == LAST_ROUND_METADATA:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def _unauthenticated(detail: str) -> grpc.aio.AioRpcError:
    """A refusal of our own, shaped like the CPM's, so callers handle one kind of error."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(), detail, ""
    )


async def next_directive(
    inbox: asyncio.Queue[cpm_pb2.Directive], feed: asyncio.Task[None], timeout: float
) -> cpm_pb2.Directive | None:
    """The next directive from a feed task's ``inbox``, or None after ``timeout`` (a round
    without a pairing). A feed that ended with an error re-raises it here."""
    deadline = time.monotonic() + timeout
    while True:
        if feed.done() and inbox.empty():
            feed.result()
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            return await asyncio.wait_for(inbox.get(), min(remaining, 0.5))
        except TimeoutError:
            continue


async def rest_of_round(
    inbox: asyncio.Queue[cpm_pb2.Directive],
    first: cpm_pb2.Directive,
    settle_s: float = ROUND_SETTLE_S,
    limit: int = MAX_DIRECTIVES_PER_ROUND,
) -> list[cpm_pb2.Directive]:
    """The further directives of ``first``'s matchmaking round: those queued in ``inbox``
    or arriving within ``settle_s``, at most ``limit - 1``. Under the CPM's ``pairing:
    per_student`` an agent gets several in one round (one per teacher it learns from, one
    per student it teaches). A directive of another round goes back to the queue for the
    next round; a "not matched" notice is dropped (this round has its pairing)."""
    rest: list[cpm_pb2.Directive] = []
    settle = time.monotonic() + settle_s
    while len(rest) < limit - 1:
        try:
            d = inbox.get_nowait()
        except asyncio.QueueEmpty:
            remaining = settle - time.monotonic()
            if remaining <= 0:
                break
            try:
                d = await asyncio.wait_for(inbox.get(), remaining)
            except TimeoutError:
                break
        if d.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED:
            continue
        if d.matchmaking_round != first.matchmaking_round:
            inbox.put_nowait(d)
            break
        rest.append(d)
    return rest


async def _final_status(call: Any) -> grpc.aio.AioRpcError:
    """The error a reward stream that has ended stands for: its status (UNAVAILABLE, to be
    retried, when the CPM ended it cleanly, e.g. as it shut down)."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return _rpc_error(grpc.StatusCode.UNAVAILABLE, "the reward stream ended")
    return grpc.aio.AioRpcError(
        code,
        await call.initial_metadata(),
        await call.trailing_metadata(),
        details=await call.details(),
        debug_error_string=await call.debug_error_string(),
    )


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details, debug_error_string=None
    )
