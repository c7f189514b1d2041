"""The agent's memory of the directives its CPM feed delivered, and per-object authorisation.

A teacher streams a knowledge package only to the student named in a directive it holds
(design principle 2: the caller's name comes from its certificate, never from a message).
:meth:`DirectiveBook.teaching_for` makes that decision and raises a typed
:class:`DirectiveError` whose ``code`` is the gRPC status to answer with:

====================================  =====================  ===================
situation                             error                  code
====================================  =====================  ===================
no such directive                     UnknownDirective       NOT_FOUND
this agent is not its teacher         NotTeacher             PERMISSION_DENIED
the caller is not its student         NotStudent             PERMISSION_DENIED
it has expired                        DirectiveExpired       FAILED_PRECONDITION
the student used up its fetches       FetchLimitReached      RESOURCE_EXHAUSTED
====================================  =====================  ===================

Fetches: a directive is not single-use, because a download can fail half-way (a restart,
a dropped connection) and the student must be able to retry; but it is not unlimited
either, or one directive would entitle a student to unbounded transfers. Each authorised
fetch counts, a fetch the teacher itself fails is refunded; ``max_fetches`` (3 by
default) are allowed per directive.

The book is bounded (``capacity`` directives): when full, expired directives go first, then
the oldest. Expired ones are otherwise kept, so a late student learns *expired*
(FAILED_PRECONDITION) rather than *unknown*. Not thread-safe: it lives on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal

import grpc

from peerlm.wire.v1 import cpm_pb2

__all__ = [
    "DirectiveBook",
    "DirectiveError",
    "DirectiveExpired",
    "FetchLimitReached",
    "NotStudent",
    "NotTeacher",
    "UnknownDirective",
    "directive_action",
    "expires_at_seconds",
    "refusal_failure",
    "space_mismatches",
]

#: Most co-senders a merge directive may name: the CPM's ``MAX_MERGE_SENDERS`` - 1 (not
#: imported: this module must not load the CPM library; a test checks the two agree).
MAX_CO_SENDERS = 15

#: What the round loop does with its directive (:func:`directive_action`).
DirectiveAction = Literal["refuse", "learn", "merge", "teach", "serve_adapter"]


def directive_action(
    protocol: str,
    role: cpm_pb2.ExchangeRole.ValueType,
    executed: Collection[str],
    merges: Collection[str],
    co_senders: int = 0,
) -> DirectiveAction:
    """The round loop's move for a directive of ``protocol`` addressed to us as ``role``,
    given the protocols this agent ``executed`` (advertised in its profile) and the merge
    protocols (the catalogue's, ``peerlm.protocols.names(kind="merge")``; the daemon passes
    them, and tests pass other sets): ``refuse`` a
    protocol it does not execute (whatever the CPM sent); as student ``merge`` the
    teacher's adapter or ``learn`` its package by AKD; as teacher ``serve_adapter`` (a
    merge: nothing to build) or ``teach`` (build the package). A directive naming
    ``co_senders`` (further senders, ``Directive.co_senders``) on a protocol that is not a
    merge is refused whatever the role: the CPM never sends one, and AKD has no way to use
    several teachers' packages in one exchange; so is one naming more than
    ``MAX_CO_SENDERS`` (no CPM sends one either), before anything walks the list."""
    if protocol not in executed or (co_senders and protocol not in merges):
        return "refuse"
    if co_senders > MAX_CO_SENDERS:
        return "refuse"
    merge = protocol in merges
    if role == cpm_pb2.EXCHANGE_ROLE_STUDENT:
        return "merge" if merge else "learn"
    if role == cpm_pb2.EXCHANGE_ROLE_TEACHER:
        return "serve_adapter" if merge else "teach"
    return "refuse"


_F = cpm_pb2.ExchangeFailure
#: The agent's failure reasons (``peerlm_agent_exchange_failures_total{reason}``: the
#: package's, the pull's and the adapter codec's refusal reasons) that say something about
#: the directive's tuple, by the ``ExchangeFailure`` the student reports to the CPM.
_REFUSALS = MappingProxyType(
    {
        "unsupported_protocol": _F.EXCHANGE_FAILURE_UNSUPPORTED_PROTOCOL,
        "tokenizer_mismatch": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "tokenizer": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "model_type": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "lora_config": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "keys": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "shape": _F.EXCHANGE_FAILURE_PARAMETER_SPACE,
        "timeout": _F.EXCHANGE_FAILURE_PULL_FAILED,
        "unavailable": _F.EXCHANGE_FAILURE_PULL_FAILED,
        "refused": _F.EXCHANGE_FAILURE_PULL_FAILED,
        "too_large": _F.EXCHANGE_FAILURE_PULL_FAILED,
        "unverified_sender": _F.EXCHANGE_FAILURE_SENDER_PROOF,
        "corrupt": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "decode": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "format": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "dtype": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "non_finite": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "norm": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
        "package": _F.EXCHANGE_FAILURE_INVALID_PAYLOAD,
    }
)


def refusal_failure(reason: str) -> cpm_pb2.ExchangeFailure.ValueType:
    """The ``ExchangeFailure`` a student reports for a directive it could not execute for
    ``reason``, or ``EXCHANGE_FAILURE_UNSPECIFIED`` (0: report nothing) for a reason that
    is this agent's own trouble (an internal error, an aggregation that changed nothing),
    which says nothing about the tuple the CPM chose: that directive expires unrewarded,
    as before."""
    return _REFUSALS.get(reason, _F.EXCHANGE_FAILURE_UNSPECIFIED)


def space_mismatches(refusals: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """The senders, of ``(sender, reason)`` refusals of their pulled adapters, whose
    adapter proved to be of another parameter space than this agent's own: the reason is
    one the adapter codec gives when the adapter's own spec (base model type, tokenizer
    hash, LoRA ``r``/``alpha``, tensor names, shapes: every part of the fingerprint an
    adapter carries) differs from this host's. In first-seen order, each once.

    A student names them to the CPM with its report (``ReportRewardRequest.space_mismatch``)
    as its disproof of the fingerprint each declared (docs/matchmaker.md, "The
    fingerprint"). A sender that failed for any other reason (unreachable, a refused or
    unverified pull, a corrupt, non-finite or over-norm adapter) proved nothing about its
    space and is not named.
    """
    named: dict[str, None] = {}
    for sender, reason in refusals:
        if _REFUSALS.get(reason) == _F.EXCHANGE_FAILURE_PARAMETER_SPACE:
            named.setdefault(sender, None)
    return tuple(named)


class DirectiveError(Exception):
    """A request a directive does not authorise; ``code`` is the gRPC status to answer."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.FAILED_PRECONDITION
    #: Short label for metrics (``peerlm_agent_peer_refusals_total{reason}``).
    reason: ClassVar[str] = "directive"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownDirective(DirectiveError):
    """This agent holds no directive with that id."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "unknown_directive"


class NotTeacher(DirectiveError):
    """The directive does not make this agent the teacher."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "not_teacher"


class NotStudent(DirectiveError):
    """The caller is not the directive's student."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "not_student"


class DirectiveExpired(DirectiveError):
    """The directive's ``expires_at`` has passed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "expired"


class FetchLimitReached(DirectiveError):
    """The student has already fetched this directive's package ``max_fetches`` times."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "fetch_limit"


def expires_at_seconds(directive: cpm_pb2.Directive) -> float:
    """The directive's expiry as Unix seconds."""
    ts = directive.expires_at
    return ts.seconds + ts.nanos / 1e9


@dataclass
class _Entry:
    directive: cpm_pb2.Directive
    expires_at: float
    fetches: int = 0


class DirectiveBook:
    """Directives received from the CPM, checked against callers' certificate names.

    ``clock`` returns Unix seconds (``time.time``; tests pass a fake). ``self_name``, when
    given, must also equal the directive's ``teacher`` for this agent to serve it; without
    it the directive's ``role`` (as the CPM addressed it to us) decides.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        self_name: str | None = None,
        capacity: int = 1024,
        max_fetches: int = 3,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if max_fetches < 1:
            raise ValueError(f"max_fetches must be at least 1, got {max_fetches}")
        self._clock = clock
        self._self_name = self_name
        self._capacity = capacity
        self._max_fetches = max_fetches
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, directive_id: object) -> bool:
        return directive_id in self._entries

    @property
    def max_fetches(self) -> int:
        """Authorised fetches allowed per directive."""
        return self._max_fetches

    def add(self, directive: cpm_pb2.Directive) -> bool:
        """Remember ``directive``; False if it was already known (a replay after reconnect).

        A replay keeps the original entry and its fetch count. Raises ``ValueError`` for a
        directive without id, teacher, student or expiry, which the CPM never sends.
        """
        if not directive.directive_id or not directive.teacher or not directive.student:
            raise ValueError("directive lacks an id, a teacher or a student")
        if not directive.HasField("expires_at"):
            raise ValueError(f"directive {directive.directive_id} has no expiry")
        if directive.directive_id in self._entries:
            return False
        if len(self._entries) >= self._capacity:
            self._make_room()
        copy = cpm_pb2.Directive()
        copy.CopyFrom(directive)  # messages are mutable; the caller may reuse theirs
        self._entries[directive.directive_id] = _Entry(copy, expires_at_seconds(directive))
        return True

    def get(self, directive_id: str) -> cpm_pb2.Directive | None:
        """The directive with that id, or None."""
        entry = self._entries.get(directive_id)
        return entry.directive if entry else None

    def fetches(self, directive_id: str) -> int:
        """How many authorised fetches the directive has had (0 if unknown)."""
        entry = self._entries.get(directive_id)
        return entry.fetches if entry else 0

    def teaching_for(self, directive_id: str, student_name: str) -> cpm_pb2.Directive:
        """Authorise ``student_name`` (from its certificate) to fetch ``directive_id``'s package.

        Counts one fetch on success. Checks run in an order that tells a caller nothing it
        is not entitled to: only the directive's own student learns whether it expired.
        """
        entry = self._entries.get(directive_id)
        if entry is None:
            raise UnknownDirective(f"no directive {directive_id!r} is known to this agent")
        d = entry.directive
        teaching = d.role == cpm_pb2.EXCHANGE_ROLE_TEACHER
        if not teaching or (self._self_name is not None and d.teacher != self._self_name):
            raise NotTeacher(
                f"this agent is not the teacher of directive {directive_id!r} "
                f"(the teacher is {d.teacher!r})"
            )
        if student_name != d.student:
            raise NotStudent(
                f"directive {directive_id!r} entitles {d.student!r}, not {student_name!r}"
            )
        now = self._clock()
        if now >= entry.expires_at:
            raise DirectiveExpired(
                f"directive {directive_id!r} expired {now - entry.expires_at:.0f} s ago"
            )
        if entry.fetches >= self._max_fetches:
            raise FetchLimitReached(
                f"directive {directive_id!r} has been fetched {entry.fetches} times, "
                f"the limit is {self._max_fetches}"
            )
        entry.fetches += 1
        return d

    def refund(self, directive_id: str) -> None:
        """Give back one fetch counted by :meth:`teaching_for`.

        For failures on the teacher's side (its package could not be built or is over its
        own limit): those must not use up the student's retries.
        """
        entry = self._entries.get(directive_id)
        if entry is not None and entry.fetches > 0:
            entry.fetches -= 1

    def purge_expired(self) -> int:
        """Forget every expired directive; returns how many were dropped."""
        now = self._clock()
        gone = [key for key, entry in self._entries.items() if now >= entry.expires_at]
        for key in gone:
            del self._entries[key]
        return len(gone)

    def _make_room(self) -> None:
        if self.purge_expired() == 0:
            # Dicts keep insertion order: the first entry is the oldest.
            del self._entries[next(iter(self._entries))]
