"""The CPM's protocol core: profiles in, directives out, rewards into the bandit.

No network code lives here (the gRPC service in ``service.py`` is a thin adapter), so the
whole CPM protocol of KNEXA-FL Algorithm 3 (phases 2 and 4) is testable with an in-memory
store and a fake clock. The core is not thread-safe: the service calls it from one thread.

Decisions the paper leaves open, made here:

* Matchmaking considers the agents whose profile arrived since the last matchmaking round
  ("pending"); each profile is matched at most once, unmatched agents train locally and
  submit again. Agents considered in a round and left unpaired are told so at once
  (``MatchOutcome.unmatched``, an ``EXCHANGE_ROLE_UNMATCHED`` notice on their feed) rather
  than left waiting for their round timeout. Matchmaking runs on quorum
  (``max(min_quorum, ceil(quorum_fraction * connected))`` pending profiles, where
  ``connected`` counts agents with an open directive feed) or when ``round_interval_s``
  has passed with at least two pending profiles.
* A profile for an older round than the agent's last is refused (FAILED_PRECONDITION); the
  same round may be re-submitted (agents retry after failures) and replaces the pending one.
* A reward is accepted once, from the directive's student, before ``expires_at``. The
  context stored with the directive at selection time is the one the bandit learns from
  (the agent never sends a context vector, so it cannot poison the model's features).
* Expired directives are closed without a bandit update; they are counted in a metric.
* A student that refuses a directive reports the failure in the reward's place
  (``RewardReport.failure``, :mod:`.refusals`): same authorisation, once, same group
  commit; the ledger keeps the reason and the bandit learns ``refusal_reward``.
* Rewards are committed in batches (:meth:`CpmCore.report_rewards`): each is applied to
  the in-memory bandit in turn, then all their ledger rows go into one transaction; if
  that fails, the bandit is put back as it was before the batch and nothing is
  acknowledged. The bandit is snapshotted every ``snapshot_every`` rewards, after a full
  check (:meth:`Matchmaker.check`), so an invalid state is never persisted.
* The CPM never refuses to start over its own bandit: a snapshot that does not restore
  (corrupt, or indefinite ``A^-1`` from an older CPM) is discarded and the bandit rebuilt
  by replaying the whole reward ledger; rewards after the snapshot are replayed on top.
* A student may name, with its reward, the directive's senders whose pulled adapter was
  of another parameter space than its own (``RewardReport.space_mismatch``): a disproof
  of the fingerprint each declared, stored with the reward. The pair is then excluded from
  same-space protocols while the sender declares that fingerprint; from
  ``space_disproof_quorum`` distinct students on, the sender is matched as undeclared
  (docs/matchmaker.md, "The fingerprint").
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from peerlm.services.cpm.matchmaker import MAX_MERGE_SENDERS, Pairing
from peerlm.services.cpm.menu import (
    Capabilities,
    check_overlay_peers,
    check_param_space,
    check_protocols,
)
from peerlm.services.cpm.normalise import DEFAULT_REWARD_CLIP_SIGMAS
from peerlm.services.cpm.profile import validate_profile
from peerlm.services.cpm.records import (
    DirectiveRecord,
    DirectiveStatus,
    ProfileRecord,
    RewardRecord,
    SpaceDisproof,
)
from peerlm.services.cpm.refusals import failure_name
from peerlm.services.cpm.settings import CpmSettings
from peerlm.services.cpm.store import CpmStore

from peerlm.pki.identity import host_listed

__all__ = [
    "CpmCore",
    "CpmError",
    "MatchOutcome",
    "RewardOutcome",
    "RewardReport",
    "SubmitOutcome",
]

_DIRECTIVE_ID = re.compile(r"^[0-9a-f]{32}$")
#: Trailing metadata of a ``stale_round`` refusal: the last round the CPM holds for the agent.
LAST_ROUND_METADATA = "peerlm-last-round"
#: Trailing metadata of an ``INVALID_ARGUMENT`` refusal of one profile field: its name
#: (``overlay_peers``, so that an agent can submit again without the list).
REFUSED_FIELD_METADATA = "peerlm-refused-field"
#: uint64 fields are stored as SQLite INTEGER (signed 64-bit): anything above is refused.
MAX_STORED_INT = 2**63 - 1
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")
#: Longest ``peer_endpoint`` (a DNS name is at most 253 characters, plus ``:65535``).
MAX_ENDPOINT_LEN = 255


def check_endpoint(endpoint: str, hosts: frozenset[str] | None) -> None:
    """Refuse a ``peer_endpoint`` that is not ``host:port`` (a name, an IPv4 address or a
    bracketed IPv6 address; a port in 1-65535; at most :data:`MAX_ENDPOINT_LEN` characters)
    or, when ``hosts`` (the DNS/IP SANs of the caller's certificate) is given, whose host the
    certificate does not name. Peers dial the endpoint and check the server's certificate
    against its host, so an endpoint outside the SANs is either unreachable or another
    member's address; only the first can be honest, and neither is worth pairing.
    ``hosts=None`` (insecure-dev: no certificate) checks the form only."""
    match = _ENDPOINT.match(endpoint) if len(endpoint) <= MAX_ENDPOINT_LEN else None
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise CpmError(
            "INVALID_ARGUMENT",
            "endpoint",
            f"peer_endpoint {endpoint[:64]!r} is not host:port with a port in 1-65535",
        )
    host = match.group(1)
    if hosts is not None and not host_listed(host, hosts):
        raise CpmError(
            "PERMISSION_DENIED",
            "endpoint_not_certified",
            f"peer_endpoint host {host[:64]!r} is not a DNS or IP SAN of your certificate "
            f"({', '.join(sorted(hosts)[:8]) or 'none'}); advertise one of those, or have the "
            f"certificate reissued with --san {host[:64]}",
        )


class CpmError(Exception):
    """A refused request: a gRPC status code name, a metric reason and a message."""

    def __init__(
        self, code: str, reason: str, message: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        #: Machine-readable detail for the caller (gRPC trailing metadata).
        self.trailers = trailers


@dataclass(frozen=True)
class SubmitOutcome:
    matchmaking_round: int
    pending: int
    quorum_reached: bool


@dataclass(frozen=True)
class MatchOutcome:
    matchmaking_round: int
    directives: list[DirectiveRecord]
    candidates: int
    seconds: float
    # Agents considered in this round and left without a pairing (told, so they need not
    # wait for their round timeout), and the matchmaking round their profiles were
    # promised (SubmitProfile's answer), which the notice carries.
    unmatched: tuple[str, ...] = ()
    unmatched_round: int = 0
    # Pending agents left out because they closed their directive feed: a directive to an
    # agent that will not receive it would only expire, and hold its partner for the round.
    without_feed: tuple[str, ...] = ()


@dataclass(frozen=True)
class RewardReport:
    """One ReportReward call, as the core sees it (the agent is the caller's identity)."""

    agent: str
    directive_id: str
    reward: float
    loss_pre: float = 0.0
    loss_post: float = 0.0
    kilobytes: int = 0
    #: A refused exchange's wire code (``peerlm.v1.ExchangeFailure``, :mod:`.refusals`);
    #: 0 for a reward.
    failure: int = 0
    #: The directive's senders (teacher, co-senders) whose pulled adapter proved to be of
    #: another parameter space than the student's own.
    space_mismatch: tuple[str, ...] = ()


@dataclass(frozen=True)
class RewardOutcome:
    directive: DirectiveRecord
    normalised: float
    bandit_updates: int


def _pairing(directive: DirectiveRecord) -> Pairing:
    """The pairing a directive was issued for, with the context the bandit scored."""
    return Pairing(
        sender=directive.teacher,
        receiver=directive.student,
        protocol=directive.protocol,
        role=directive.role,
        context=directive.context,
        ucb=directive.ucb,
        mean=float("nan"),
    )


def open_database(settings: CpmSettings) -> str:
    """Open (with ``settings.init``: create) the CPM database and check it as a start would.

    For ``peerlm cpm --init --init-only``: a one-shot step that deployments run once, so
    that the long-running CPM never needs ``--init``. Returns a one-line summary.
    """
    from peerlm.services.cpm.store import SqliteCpmStore

    store = SqliteCpmStore(settings.db)
    try:
        core = CpmCore(settings, store, time.time)
        return (
            f"CPM database {settings.db}: bandit {core.bandit_recovery}, "
            f"{core.matchmaker.n_updates} rewards, round {core.matchmaking_round}"
        )
    finally:
        store.close()


def _check_range(name: str, value: int) -> None:
    if not 0 <= value <= MAX_STORED_INT:
        raise CpmError(
            "INVALID_ARGUMENT", "out_of_range", f"{name} must be in [0, 2^63 - 1], got {value}"
        )


def settings_fingerprint(settings: CpmSettings) -> str:
    """What must not change between restarts, or the stored bandit would be meaningless."""
    fields: dict[str, Any] = {
        "profile_dim": settings.profile_dim,
        "protocols": list(settings.protocols),
        "roles": list(settings.roles),
        "interaction_features": settings.interaction_features,
        "trust_features": settings.trust_features,
        "ridge": settings.ridge,
    }
    # Only when set: a database created before the setting existed keeps its fingerprint.
    if settings.context_columns is not None:
        fields["context_columns"] = list(settings.context_columns)
    # Under K > 1 every merge reward is a group reward (the teacher and its co-senders), so
    # the merge arms learn another quantity than under one sender: mixing the two regimes in
    # one database would average them.
    if settings.merge_senders != 1:
        fields["merge_senders"] = settings.merge_senders
    # Only when not the default: databases made before winsorising keep their fingerprint
    # (their replay winsorises from the tenth reward on, like a new one).
    if settings.reward_clip_sigmas != DEFAULT_REWARD_CLIP_SIGMAS:
        fields["reward_clip_sigmas"] = settings.reward_clip_sigmas
    # Under "group" a merge reward is learnt on the group's mean-profile context, under
    # "pair" on the teacher's: the same arms would learn two different regressions.
    if settings.co_sender_scoring != "pair":
        fields["co_sender_scoring"] = settings.co_sender_scoring
    # The snapshot holds a reward window under "robust", running moments under "zscore":
    # neither can continue the other. The window is pinned whatever its value (no database
    # predates it), so a later change of its default cannot silently resize a stored one;
    # under "zscore" it is unused and left out.
    if settings.reward_normaliser != "zscore":
        fields["reward_normaliser"] = settings.reward_normaliser
        fields["reward_window"] = settings.reward_window
    return json.dumps(fields, sort_keys=True)


class CpmCore:
    """Holds the matchmaker, the latest profiles and the open directives."""

    def __init__(self, settings: CpmSettings, store: CpmStore, clock: Callable[[], float]) -> None:
        self._s = settings
        self._store = store
        self._clock = clock
        self.matchmaker = self._s.new_matchmaker()
        fingerprint = settings_fingerprint(settings)
        stored = store.get_meta("fingerprint")
        if stored is None and not settings.init:
            # A deleted or emptied database must not silently become a new federation
            # (every agent's history, trust and open directive would be gone).
            raise ValueError(
                f"the CPM database {settings.db} holds no federation (missing, empty or never "
                "initialised); start with --init to create a new one"
            )
        bad = store.invalid_directives(self.matchmaker.context_dim)
        if bad:
            raise ValueError(
                f"the CPM database {settings.db} has {len(bad)} directive row(s) whose status, "
                f"context or reward does not parse (first: {bad[0]}); restore it from a backup"
            )
        if stored is not None and stored != fingerprint:
            raise ValueError(
                "the CPM database was created with different bandit settings "
                f"({stored}); use a new --db or the original settings ({fingerprint})"
            )
        if stored is None:
            store.set_meta("fingerprint", fingerprint)
        #: How the bandit came back at start: "fresh", "snapshot" or "rebuilt" (+ why).
        self.bandit_recovery = "fresh"
        self.rewards_replayed = 0
        self.ledger_rows_skipped = 0
        self.snapshots_written = 0
        self.snapshots_refused = 0
        #: Re-derivations of A^-1 from A while applying rewards (for a metric).
        self.bandit_refactors = 0
        self._seq = store.last_reward_seq()
        self._snapshot_seq = 0
        self._recover_bandit()
        self._profiles: dict[str, ProfileRecord] = {p.agent: p for p in store.load_profiles()}
        self._open: dict[str, DirectiveRecord] = {
            d.directive_id: d for d in store.open_directives()
        }
        self._round = int(store.get_meta("matchmaking_round") or 0)
        # (sender, fingerprint it declared) -> the students that disproved it.
        self._disproofs: defaultdict[tuple[str, str], set[str]] = defaultdict(set)
        for p in store.load_space_disproofs():
            self._disproofs[(p.sender, p.param_space)].add(p.student)
        #: Disproofs recorded since start (for a metric).
        self.space_disproofs_recorded = 0
        # Agents whose current claim the quorum disproved, kept up to date by the core's
        # thread so that the service's gauge reads a size, never iterates shared state.
        self._disproved: set[str] = set()
        for sender, _ in self._disproofs:
            self._update_disproved(sender)
        # Profiles that arrived after the last matchmaking are still waiting for one: a
        # restart keeps them pending (unless older than a directive's lifetime: that agent
        # has moved on). Written before each round's directives, so a crash in between
        # can only drop a profile (its agent sends the next round's), never match it twice.
        matched_until = float(store.get_meta("matched_until") or "-inf")
        horizon = clock() - self._s.directive_ttl_s
        self._pending: set[str] = {
            a for a, p in self._profiles.items() if p.received_at > max(matched_until, horizon)
        }
        self._last_match = clock()
        self.profiles_received = 0
        self.rewards_observed = 0
        self.directives_issued = 0

    # ------------------------------------------------------------ bandit state

    def _recover_bandit(self) -> None:
        """Snapshot, then the ledger after it; the whole ledger if the snapshot is bad."""
        loaded = self._store.load_snapshot()
        start = 0
        if loaded is not None:
            state, covered = loaded
            try:
                if covered > self._seq:
                    raise ValueError(
                        f"snapshot covers reward {covered}, ledger ends at {self._seq}"
                    )
                self.matchmaker.restore(state)
                start = covered
                self.bandit_recovery = "snapshot"
            except ValueError as exc:
                self.matchmaker = self._s.new_matchmaker()
                self.bandit_recovery = f"rebuilt: {exc}"
        for _, directive in self._store.rewards_after(start):
            assert directive.reward is not None
            try:
                self.matchmaker.observe(_pairing(directive), directive.reward.reward)
            except ValueError:
                # Only a row no current CPM could have written (non-finite context);
                # skipping it beats refusing to start.
                self.ledger_rows_skipped += 1
                continue
            self.rewards_replayed += 1
        self._snapshot_seq = start
        if self.rewards_replayed or self.bandit_recovery.startswith("rebuilt"):
            self.write_snapshot()

    def snapshot_if_behind(self) -> bool:
        """:meth:`write_snapshot` if rewards arrived since the last one (at shutdown)."""
        return self._seq != self._snapshot_seq and self.write_snapshot()

    def write_snapshot(self) -> bool:
        """Persist the bandit if it passes the full check; True if written.

        A state that fails even after re-deriving ``A^-1`` from ``A`` is not written (the
        ledger still holds every reward, so nothing is lost) and is rebuilt from the ledger.
        """
        if not self.matchmaker.check():
            self.snapshots_refused += 1
            self.matchmaker = self._s.new_matchmaker()
            for _, directive in self._store.rewards_after(0):
                assert directive.reward is not None
                with contextlib.suppress(ValueError):
                    self.matchmaker.observe(_pairing(directive), directive.reward.reward)
            if not self.matchmaker.check():
                return False
        self._store.save_snapshot(self.matchmaker.snapshot(), self._seq)
        self._snapshot_seq = self._seq
        self.snapshots_written += 1
        return True

    # ----------------------------------------------------------------- profiles

    @property
    def matchmaking_round(self) -> int:
        return self._round

    @property
    def pending(self) -> int:
        return len(self._pending)

    def quorum(self, connected: int) -> int:
        return max(self._s.min_quorum, math.ceil(self._s.quorum_fraction * connected))

    def submit_profile(
        self,
        agent: str,
        round_: int,
        features: Sequence[float],
        endpoint: str,
        connected: int,
        *,
        endpoint_hosts: frozenset[str] | None = None,
        param_space: str = "",
        protocols: Sequence[str] = (),
        overlay_peers: Sequence[str] = (),
    ) -> SubmitOutcome:
        """Validate and store an agent's profile for the next matchmaking round.

        ``endpoint_hosts``: the DNS/IP SANs of the caller's certificate, which a non-empty
        ``endpoint`` must name (:func:`check_endpoint`); None without a certificate.
        ``param_space`` and ``protocols``: what the agent declares for the menu's
        admissibility (:mod:`.menu`); refused (INVALID_ARGUMENT, reasons ``param_space`` /
        ``protocols``) when out of their bounds, with nothing stored. ``overlay_peers``:
        the agent's overlay top-K, which narrows the senders of its merge directives
        (:func:`.menu.check_overlay_peers`; reason ``overlay_peers``).
        """
        _check_range("round", round_)
        try:
            check_param_space(param_space)
        except ValueError as exc:
            raise CpmError("INVALID_ARGUMENT", "param_space", str(exc)) from None
        try:
            advertised = check_protocols(protocols)
        except ValueError as exc:
            raise CpmError("INVALID_ARGUMENT", "protocols", str(exc)) from None
        try:
            peers = check_overlay_peers(overlay_peers, agent, lambda name: name in self._profiles)
        except ValueError as exc:
            raise CpmError(
                "INVALID_ARGUMENT",
                "overlay_peers",
                str(exc),
                ((REFUSED_FIELD_METADATA, "overlay_peers"),),
            ) from None
        if len(features) != self._s.profile_dim:
            raise CpmError(
                "INVALID_ARGUMENT",
                "profile_dim",
                f"profile has {len(features)} features, expected {self._s.profile_dim}",
            )
        try:
            vec = validate_profile(np.asarray(features, dtype=np.float64), self._s.profile_dim)
        except ValueError as exc:
            raise CpmError("INVALID_ARGUMENT", "profile_values", str(exc)) from None
        if endpoint:
            check_endpoint(endpoint, endpoint_hosts)
        previous = self._profiles.get(agent)
        if previous is not None and round_ < previous.round:
            # The agent restarted with fresh state or an older checkpoint: tell it the last
            # round we hold, so it can resynchronise (agent.cpm.client) instead of ending.
            raise CpmError(
                "FAILED_PRECONDITION",
                "stale_round",
                f"profile for round {round_} is older than round {previous.round} already seen",
                ((LAST_ROUND_METADATA, str(previous.round)),),
            )
        if previous is None and len(self._profiles) >= self._s.max_agents:
            raise CpmError(
                "RESOURCE_EXHAUSTED",
                "max_agents",
                f"the CPM already tracks {self._s.max_agents} agents",
            )
        record = ProfileRecord(
            agent, round_, vec, endpoint, self._clock(), param_space, advertised, peers
        )
        self._store.upsert_profile(record)
        self._profiles[agent] = record
        self._update_disproved(agent)
        self._pending.add(agent)
        self.profiles_received += 1
        return SubmitOutcome(
            matchmaking_round=self._round + 1,
            pending=len(self._pending),
            quorum_reached=len(self._pending) >= self.quorum(connected),
        )

    def match_due(self, connected: int) -> str | None:
        """``"quorum"``, ``"timer"`` or ``"alone"`` when a matchmaking round should run now.

        ``"alone"``: one profile is pending, the timer has run out and no other agent has
        a directive feed open, so nobody can pair with it; the round tells it so (an
        agent finishing after its peers would otherwise wait for its round timeout)."""
        if len(self._pending) >= 2 and len(self._pending) >= self.quorum(connected):
            return "quorum"
        if self.timer_due():
            return "timer"
        if (
            len(self._pending) == 1
            and connected <= 1
            and self._clock() - self._last_match >= self._s.round_interval_s
        ):
            return "alone"
        return None

    def timer_due(self) -> bool:
        """True when the round timer has run out and there is something to match."""
        return (
            len(self._pending) >= 2 and self._clock() - self._last_match >= self._s.round_interval_s
        )

    # ------------------------------------------------------------- matchmaking

    def matchmake(self, closed: Collection[str] = ()) -> MatchOutcome:
        """Run Algorithm 2 over the pending profiles and record the directives.

        ``closed``: the agents that closed their directive feed and have not opened it
        again (the service's hub); such a pending agent is not paired this round
        (``without_feed``) and must submit its profile again to be. An agent that has not
        opened its feed yet is paired: its directives are replayed when it connects."""
        started = time.perf_counter()
        absent = tuple(sorted(a for a in self._pending if a in closed))
        agents = sorted(a for a in self._pending if a not in absent)
        self._pending.clear()
        self._last_match = self._clock()
        self._store.set_meta("matched_until", repr(self._last_match))
        if len(agents) < 2:
            return MatchOutcome(
                self._round,
                [],
                len(agents),
                time.perf_counter() - started,
                tuple(agents),
                self._round + 1,
                absent,
            )
        profiles = {a: self._profiles[a].features for a in agents}
        # Disproved fingerprints (docs/matchmaker.md, "The fingerprint"): each disproving
        # student is excluded from the sender's same-space pairs, in both directions; a
        # claim disproved by the quorum counts as undeclared for everyone.
        excluded: defaultdict[str, set[str]] = defaultdict(set)
        disproved: set[str] = set()
        for a in agents:
            students = self.disproved_by(a)
            for student in students:
                excluded[a].add(student)
                excluded[student].add(a)
            if a in self._disproved:
                disproved.add(a)
        capabilities = {
            a: Capabilities(
                "" if a in disproved else self._profiles[a].param_space,
                self._profiles[a].protocols,
                frozenset(self._profiles[a].overlay_peers) or None,
                frozenset(excluded.get(a, ())),
            )
            for a in agents
        }
        pairings = self.matchmaker.select(profiles, capabilities)
        self._round += 1
        now = self._clock()
        directives = [self._directive(p, now) for p in pairings]
        self._store.record_round(self._round, directives)
        for d in directives:
            self._open[d.directive_id] = d
        self.directives_issued += len(directives)
        paired = {d.teacher for d in directives} | {d.student for d in directives}
        return MatchOutcome(
            self._round,
            directives,
            len(agents),
            time.perf_counter() - started,
            tuple(a for a in agents if a not in paired),
            self._round,
            absent,
        )

    def _directive(self, pairing: Pairing, now: float) -> DirectiveRecord:
        return DirectiveRecord(
            directive_id=secrets.token_hex(16),
            matchmaking_round=self._round,
            protocol=pairing.protocol,
            role=pairing.role,
            teacher=pairing.sender,
            student=pairing.receiver,
            teacher_endpoint=self._profiles[pairing.sender].endpoint,
            student_endpoint=self._profiles[pairing.receiver].endpoint,
            context=np.asarray(pairing.context, dtype=np.float64),
            ucb=float(pairing.ucb),
            issued_at=now,
            expires_at=now + self._s.directive_ttl_s,
            co_senders=tuple((c, self._profiles[c].endpoint) for c in pairing.co_senders),
        )

    def disproved_by(self, agent: str) -> frozenset[str]:
        """The students that disproved the fingerprint ``agent`` declares now."""
        profile = self._profiles.get(agent)
        if profile is None or not profile.param_space:
            return frozenset()
        return frozenset(self._disproofs.get((agent, profile.param_space), ()))

    @property
    def disproved_members(self) -> int:
        """Agents whose declared fingerprint ``space_disproof_quorum`` students disproved
        (matched as undeclared until they declare another)."""
        return len(self._disproved)

    def _update_disproved(self, agent: str) -> None:
        if len(self.disproved_by(agent)) >= self._s.space_disproof_quorum:
            self._disproved.add(agent)
        else:
            self._disproved.discard(agent)

    def open_directives_for(self, agent: str) -> list[DirectiveRecord]:
        now = self._clock()
        return sorted(
            (
                d
                for d in self._open.values()
                if agent in (d.teacher, d.student) and d.expires_at > now
            ),
            key=lambda d: d.issued_at,
        )

    # ------------------------------------------------------------------ rewards

    def report_reward(
        self,
        agent: str,
        directive_id: str,
        reward: float,
        loss_pre: float = 0.0,
        loss_post: float = 0.0,
        kilobytes: int = 0,
        *,
        failure: int = 0,
        space_mismatch: Sequence[str] = (),
    ) -> RewardOutcome:
        """One reward through :meth:`report_rewards`; raises its :class:`CpmError`."""
        [out] = self.report_rewards(
            [
                RewardReport(
                    agent,
                    directive_id,
                    reward,
                    loss_pre,
                    loss_post,
                    kilobytes,
                    failure,
                    tuple(space_mismatch),
                )
            ]
        )
        if isinstance(out, CpmError):
            raise out
        return out

    def report_rewards(self, reports: Sequence[RewardReport]) -> list[RewardOutcome | CpmError]:
        """Apply a batch of rewards, each once and only from its directive's student.

        Every accepted reward is durable (one transaction, one fsync for the batch) before
        this returns; a refused one leaves no trace but its :class:`CpmError`. If the
        commit fails, the bandit is put back as before the batch and the error propagates:
        nothing of the batch was acknowledged.
        """
        before = self.matchmaker.snapshot()
        refactors_before = self.matchmaker.refactors
        seq_before = self._seq
        results: list[RewardOutcome | CpmError | None] = []
        accepted: list[tuple[int, RewardReport, DirectiveRecord]] = []
        staged: list[tuple[str, RewardRecord, int]] = []
        disproofs: list[SpaceDisproof] = []
        taken: set[str] = set()
        try:
            for rep in reports:
                try:
                    directive = self._admit_reward(rep, taken)
                except CpmError as err:
                    results.append(err)
                    continue
                taken.add(rep.directive_id)
                accepted.append((len(results), rep, directive))
                results.append(None)
            # One Woodbury step for the whole batch (LinUCB.update_block).
            # A refused exchange teaches the bandit the configured refusal reward (.refusals).
            values = [
                self._s.refusal_reward if rep.failure else rep.reward for _, rep, _ in accepted
            ]
            normalised = self.matchmaker.observe_many([_pairing(d) for _, _, d in accepted], values)
            now = self._clock()
            updates = before.n_updates
            for (slot, rep, directive), value, r_norm in zip(
                accepted, values, normalised, strict=True
            ):
                record = RewardRecord(
                    value,
                    r_norm,
                    rep.loss_pre,
                    rep.loss_post,
                    rep.kilobytes,
                    now,
                    failure_name(rep.failure),
                )
                self._seq += 1
                updates += 1
                staged.append((rep.directive_id, record, self._seq))
                results[slot] = RewardOutcome(
                    directive.with_status(DirectiveStatus.REWARDED, record), r_norm, updates
                )
                disproofs.extend(self._disproofs_of(rep, now, disproofs))
            if staged:
                self._store.commit_rewards(staged, disproofs)
        except BaseException:
            # Nothing was acknowledged: put the in-memory model back as the store has it.
            self.matchmaker.restore(before)
            self._seq = seq_before
            raise
        for directive_id in taken:
            del self._open[directive_id]
        for p in disproofs:
            self._disproofs[(p.sender, p.param_space)].add(p.student)
            self._update_disproved(p.sender)
        self.space_disproofs_recorded += len(disproofs)
        self.rewards_observed += len(staged)
        self.bandit_refactors += max(0, self.matchmaker.refactors - refactors_before)
        if self._seq - self._snapshot_seq >= self._s.snapshot_every:
            self.write_snapshot()
        return [r for r in results if r is not None]

    def _admit_reward(self, rep: RewardReport, taken: set[str]) -> DirectiveRecord:
        """Validate one reward; its open directive, or a :class:`CpmError` (nothing changed)."""
        agent, directive_id, reward = rep.agent, rep.directive_id, rep.reward
        _check_range("kilobytes", rep.kilobytes)
        if not _DIRECTIVE_ID.match(directive_id):
            raise CpmError("INVALID_ARGUMENT", "directive_id", "directive_id is not 32 hex chars")
        for name, value in (
            ("reward", reward),
            ("loss_pre", rep.loss_pre),
            ("loss_post", rep.loss_post),
        ):
            if not math.isfinite(value):
                raise CpmError("INVALID_ARGUMENT", "non_finite", f"{name} must be finite")
        try:
            failure_name(rep.failure)
        except ValueError as exc:
            raise CpmError("INVALID_ARGUMENT", "failure_reason", str(exc)) from None
        if rep.failure and (reward, rep.loss_pre, rep.loss_post) != (0.0, 0.0, 0.0):
            raise CpmError(
                "INVALID_ARGUMENT",
                "failure_with_reward",
                "a refused exchange carries no reward or losses (the CPM applies its "
                "configured refusal reward); send reward, loss_pre and loss_post as 0",
            )
        if abs(reward) > self._s.max_reward_magnitude:
            raise CpmError(
                "INVALID_ARGUMENT",
                "reward_magnitude",
                f"|reward| exceeds {self._s.max_reward_magnitude:g}",
            )
        directive = None if directive_id in taken else self._open.get(directive_id)
        if directive is None:
            known = self._open.get(directive_id) or self._store.get_directive(directive_id)
            if known is None:
                raise CpmError("NOT_FOUND", "unknown_directive", "no such directive")
            if known.student != agent:
                raise CpmError(
                    "PERMISSION_DENIED", "not_receiver", "only the directive's student may report"
                )
            if directive_id in taken or known.status is DirectiveStatus.REWARDED:
                raise CpmError(
                    "ALREADY_EXISTS", "replayed", "a reward for this directive was already taken"
                )
            raise CpmError("FAILED_PRECONDITION", "expired", "the directive has expired")
        if directive.student != agent:
            raise CpmError(
                "PERMISSION_DENIED", "not_receiver", "only the directive's student may report"
            )
        now = self._clock()
        if now >= directive.expires_at:
            self._expire([directive])
            raise CpmError("FAILED_PRECONDITION", "expired", "the directive has expired")
        if not np.all(np.isfinite(directive.context)):
            raise CpmError("FAILED_PRECONDITION", "bandit_refused", "stored context is not finite")
        senders = {directive.teacher, *(name for name, _ in directive.co_senders)}
        if len(rep.space_mismatch) > MAX_MERGE_SENDERS:
            raise CpmError(
                "INVALID_ARGUMENT",
                "space_mismatch",
                f"space_mismatch names more than a directive's {MAX_MERGE_SENDERS} senders",
            )
        if len(set(rep.space_mismatch)) != len(rep.space_mismatch):
            raise CpmError(
                "INVALID_ARGUMENT",
                "space_mismatch",
                "space_mismatch names a sender more than once",
            )
        for name in rep.space_mismatch:
            if name not in senders:
                raise CpmError(
                    "INVALID_ARGUMENT",
                    "space_mismatch",
                    f"space_mismatch names {name[:64]!r}, not a sender of this directive",
                )
        return directive

    def _disproofs_of(
        self, rep: RewardReport, now: float, batch: Sequence[SpaceDisproof]
    ) -> list[SpaceDisproof]:
        """The new disproofs an admitted report files: one per named sender whose declared
        fingerprint is the student's own (the adapter should have fit the student's space;
        with another declaration a mismatch disproves nothing), unless already held."""
        student = self._profiles.get(rep.agent)
        space = student.param_space if student is not None else ""
        out: list[SpaceDisproof] = []
        for name in rep.space_mismatch:
            sender = self._profiles.get(name)
            if not space or sender is None or sender.param_space != space:
                continue
            if rep.agent in self._disproofs.get((name, space), ()) or any(
                (p.sender, p.param_space, p.student) == (name, space, rep.agent) for p in batch
            ):
                continue
            out.append(SpaceDisproof(name, space, rep.agent, rep.directive_id, now))
        return out

    # ------------------------------------------------------------ housekeeping

    def expire_due(self) -> list[DirectiveRecord]:
        now = self._clock()
        due = [d for d in self._open.values() if d.expires_at <= now]
        self._expire(due)
        return due

    def _expire(self, directives: list[DirectiveRecord]) -> None:
        if not directives:
            return
        self._store.expire(d.directive_id for d in directives)
        for d in directives:
            self._open.pop(d.directive_id, None)

    def directive_counts(self) -> dict[DirectiveStatus, int]:
        return self._store.count_directives()

    @property
    def open_count(self) -> int:
        return len(self._open)

    def agents(self) -> list[ProfileRecord]:
        return sorted(self._profiles.values(), key=lambda p: p.agent)

    @property
    def agent_count(self) -> int:
        """Agents with a profile (O(1): the gauges read it after every group commit)."""
        return len(self._profiles)
