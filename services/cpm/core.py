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
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from peerlm.services.cpm.matchmaker import Matchmaker, Pairing
from peerlm.services.cpm.profile import validate_profile
from peerlm.services.cpm.records import (
    DirectiveRecord,
    DirectiveStatus,
    ProfileRecord,
    RewardRecord,
)
from peerlm.services.cpm.store import CpmStore

from peerlm.config import CpmSettings

__all__ = ["CpmCore", "CpmError", "MatchOutcome", "RewardOutcome", "SubmitOutcome"]

_DIRECTIVE_ID = re.compile(r"^[0-9a-f]{32}$")
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")


class CpmError(Exception):
    """A refused request: a gRPC status code name, a metric reason and a message."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


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


@dataclass(frozen=True)
class RewardOutcome:
    directive: DirectiveRecord
    normalised: float
    bandit_updates: int


def settings_fingerprint(settings: CpmSettings) -> str:
    """What must not change between restarts, or the stored bandit would be meaningless."""
    return json.dumps(
        {
            "profile_dim": settings.profile_dim,
            "protocols": list(settings.protocols),
            "roles": list(settings.roles),
            "interaction_features": settings.interaction_features,
            "trust_features": settings.trust_features,
            "ridge": settings.ridge,
        },
        sort_keys=True,
    )


class CpmCore:
    """Holds the matchmaker, the latest profiles and the open directives."""

    def __init__(self, settings: CpmSettings, store: CpmStore, clock: Callable[[], float]) -> None:
        self._s = settings
        self._store = store
        self._clock = clock
        self.matchmaker = Matchmaker(
            profile_dim=settings.profile_dim,
            beta=settings.beta,
            pair_budget=settings.pair_budget,
            protocols=settings.protocols,
            seed=settings.seed,
            roles=settings.roles,
            interaction_features=settings.interaction_features,
            trust_features=settings.trust_features,
            matching=settings.matching,
            prefilter_k=settings.prefilter_k,
            prefilter_min_agents=settings.prefilter_min_agents,
            ridge=settings.ridge,
        )
        fingerprint = settings_fingerprint(settings)
        stored = store.get_meta("fingerprint")
        if stored is not None and stored != fingerprint:
            raise ValueError(
                "the CPM database was created with different bandit settings "
                f"({stored}); use a new --db or the original settings ({fingerprint})"
            )
        if stored is None:
            store.set_meta("fingerprint", fingerprint)
        state = store.load_bandit()
        if state is not None:
            self.matchmaker.restore(state)
        self._profiles: dict[str, ProfileRecord] = {p.agent: p for p in store.load_profiles()}
        self._open: dict[str, DirectiveRecord] = {
            d.directive_id: d for d in store.open_directives()
        }
        self._round = int(store.get_meta("matchmaking_round") or 0)
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
    ) -> SubmitOutcome:
        """Validate and store an agent's profile for the next matchmaking round."""
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
        if endpoint and (len(endpoint) > 255 or not _ENDPOINT.match(endpoint)):
            raise CpmError(
                "INVALID_ARGUMENT", "endpoint", f"peer_endpoint {endpoint[:64]!r} is not host:port"
            )
        previous = self._profiles.get(agent)
        if previous is not None and round_ < previous.round:
            raise CpmError(
                "FAILED_PRECONDITION",
                "stale_round",
                f"profile for round {round_} is older than round {previous.round} already seen",
            )
        if previous is None and len(self._profiles) >= self._s.max_agents:
            raise CpmError(
                "RESOURCE_EXHAUSTED",
                "max_agents",
                f"the CPM already tracks {self._s.max_agents} agents",
            )
        record = ProfileRecord(agent, round_, vec, endpoint, self._clock())
        self._store.upsert_profile(record)
        self._profiles[agent] = record
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

    def matchmake(self) -> MatchOutcome:
        """Run Algorithm 2 over the pending profiles and record the directives."""
        started = time.perf_counter()
        agents = sorted(self._pending)
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
            )
        profiles = {a: self._profiles[a].features for a in agents}
        pairings = self.matchmaker.select(profiles)
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
        )

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
    ) -> RewardOutcome:
        """Apply a reward once, from the directive's student; durable before it returns."""
        if not _DIRECTIVE_ID.match(directive_id):
            raise CpmError("INVALID_ARGUMENT", "directive_id", "directive_id is not 32 hex chars")
        for name, value in (("reward", reward), ("loss_pre", loss_pre), ("loss_post", loss_post)):
            if not math.isfinite(value):
                raise CpmError("INVALID_ARGUMENT", "non_finite", f"{name} must be finite")
        if abs(reward) > self._s.max_reward_magnitude:
            raise CpmError(
                "INVALID_ARGUMENT",
                "reward_magnitude",
                f"|reward| exceeds {self._s.max_reward_magnitude:g}",
            )
        directive = self._open.get(directive_id)
        if directive is None:
            known = self._store.get_directive(directive_id)
            if known is None:
                raise CpmError("NOT_FOUND", "unknown_directive", "no such directive")
            if known.student != agent:
                raise CpmError(
                    "PERMISSION_DENIED", "not_receiver", "only the directive's student may report"
                )
            if known.status is DirectiveStatus.REWARDED:
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
        before = self.matchmaker.snapshot()
        pairing = Pairing(
            sender=directive.teacher,
            receiver=directive.student,
            protocol=directive.protocol,
            role=directive.role,
            context=directive.context,
            ucb=directive.ucb,
            mean=float("nan"),
        )
        try:
            normalised = self.matchmaker.observe(pairing, reward)
            record = RewardRecord(reward, normalised, loss_pre, loss_post, kilobytes, now)
            self._store.commit_reward(directive_id, record, self.matchmaker.snapshot())
        except BaseException:
            # Nothing was acknowledged: put the in-memory model back as the store has it.
            self.matchmaker.restore(before)
            raise
        del self._open[directive_id]
        self.rewards_observed += 1
        return RewardOutcome(
            directive.with_status(DirectiveStatus.REWARDED, record),
            normalised,
            self.matchmaker.n_updates,
        )

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
