"""Durable CPM state behind one interface, with SQLite (WAL) and in-memory backends.

What is stored: the latest profile per agent, the directive ledger, a periodic snapshot
of the bandit (A, A^-1, b, update count, reward normaliser, per-agent trust) and a few
meta values, and the parameter-space disproofs students filed with their rewards
(written in the rewards' transaction).

**The directive ledger is the reward ledger.** Acknowledging a reward writes only its
directive row (status, raw and normalised reward, and ``reward_seq``: the order in which
the bandit applied it) — a few hundred bytes — and several concurrent rewards share one
transaction, hence one fsync (group commit, see ``CpmService``). The bandit itself is
written as a snapshot tagged with the ``reward_seq`` it covers, every
``snapshot_every`` rewards and at shutdown; on start the CPM restores the snapshot and
replays the rewarded directives after it, in ``reward_seq`` order, through the same
code path that applied them. Exactly once follows: a reward is acknowledged only after
its row is durable, and its row is replayed only if the snapshot does not cover it.
Arrays are stored as raw little-endian float64 bytes, never pickled.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from peerlm.services.cpm.matchmaker import MatchmakerState
from peerlm.services.cpm.records import (
    DirectiveRecord,
    DirectiveStatus,
    ProfileRecord,
    RewardRecord,
    SpaceDisproof,
)

__all__ = ["CpmStore", "MemoryCpmStore", "SqliteCpmStore", "StoreConflict"]


class StoreConflict(RuntimeError):
    """A write lost a race it must not win (e.g. rewarding a directive that is not open)."""


class CpmStore(ABC):
    """Persistence the CPM core needs. Implementations must make each method atomic."""

    @abstractmethod
    def get_meta(self, key: str) -> str | None: ...

    @abstractmethod
    def set_meta(self, key: str, value: str) -> None: ...

    @abstractmethod
    def load_snapshot(self) -> tuple[MatchmakerState, int] | None:
        """The last bandit snapshot and the ``reward_seq`` it covers, or ``None``."""

    @abstractmethod
    def save_snapshot(self, state: MatchmakerState, reward_seq: int) -> None:
        """Replace the bandit snapshot with ``state``, covering rewards up to ``reward_seq``."""

    @abstractmethod
    def upsert_profile(self, profile: ProfileRecord) -> None: ...

    @abstractmethod
    def load_profiles(self) -> list[ProfileRecord]: ...

    @abstractmethod
    def record_round(self, matchmaking_round: int, directives: Iterable[DirectiveRecord]) -> None:
        """Store new directives and the round counter together."""

    @abstractmethod
    def get_directive(self, directive_id: str) -> DirectiveRecord | None: ...

    @abstractmethod
    def open_directives(self) -> list[DirectiveRecord]: ...

    @abstractmethod
    def commit_rewards(
        self,
        rewards: Sequence[tuple[str, RewardRecord, int]],
        disproofs: Sequence[SpaceDisproof] = (),
    ) -> None:
        """Mark each ``(directive_id, reward, reward_seq)`` rewarded, all in one transaction,
        with the ``disproofs`` filed with them (one per sender, fingerprint and student:
        a repeat is ignored).

        Raises :class:`StoreConflict` (and writes none of them) if a directive is not open.
        """

    @abstractmethod
    def load_space_disproofs(self) -> list[SpaceDisproof]:
        """Every recorded parameter-space disproof."""

    @abstractmethod
    def rewards_after(self, reward_seq: int) -> list[tuple[int, DirectiveRecord]]:
        """Rewarded directives with ``reward_seq`` greater than the given one, in order."""

    @abstractmethod
    def last_reward_seq(self) -> int:
        """The highest ``reward_seq`` committed (0 when none)."""

    @abstractmethod
    def invalid_directives(self, context_dim: int) -> list[str]:
        """Ids of directive rows that would not parse (checked once, at start)."""

    @abstractmethod
    def expire(self, directive_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def count_directives(self) -> dict[DirectiveStatus, int]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the default has none."""


def _copy_state(state: MatchmakerState) -> MatchmakerState:
    return replace(
        state,
        a_inv=state.a_inv.copy(),
        b=state.b.copy(),
        trust=dict(state.trust),
        a=None if state.a is None else state.a.copy(),
        reward_window=None if state.reward_window is None else state.reward_window.copy(),
    )


class MemoryCpmStore(CpmStore):
    """Volatile store for simulations and tests; same semantics as SQLite, minus durability."""

    def __init__(self) -> None:
        self._meta: dict[str, str] = {}
        self._bandit: tuple[MatchmakerState, int] | None = None
        self._profiles: dict[str, ProfileRecord] = {}
        self._directives: dict[str, DirectiveRecord] = {}
        self._ledger: list[tuple[int, str]] = []
        self._disproofs: dict[tuple[str, str, str], SpaceDisproof] = {}

    def get_meta(self, key: str) -> str | None:
        return self._meta.get(key)

    def set_meta(self, key: str, value: str) -> None:
        self._meta[key] = value

    def load_snapshot(self) -> tuple[MatchmakerState, int] | None:
        return None if self._bandit is None else (_copy_state(self._bandit[0]), self._bandit[1])

    def save_snapshot(self, state: MatchmakerState, reward_seq: int) -> None:
        self._bandit = (_copy_state(state), reward_seq)

    def upsert_profile(self, profile: ProfileRecord) -> None:
        self._profiles[profile.agent] = profile

    def load_profiles(self) -> list[ProfileRecord]:
        return list(self._profiles.values())

    def record_round(self, matchmaking_round: int, directives: Iterable[DirectiveRecord]) -> None:
        for d in directives:
            if d.directive_id in self._directives:
                raise StoreConflict(f"directive id {d.directive_id} already exists")
            self._directives[d.directive_id] = d
        self._meta["matchmaking_round"] = str(matchmaking_round)

    def get_directive(self, directive_id: str) -> DirectiveRecord | None:
        return self._directives.get(directive_id)

    def open_directives(self) -> list[DirectiveRecord]:
        return [d for d in self._directives.values() if d.status is DirectiveStatus.OPEN]

    def commit_rewards(
        self,
        rewards: Sequence[tuple[str, RewardRecord, int]],
        disproofs: Sequence[SpaceDisproof] = (),
    ) -> None:
        ids = [i for i, _, _ in rewards]
        for i in ids:
            d = self._directives.get(i)
            if d is None or d.status is not DirectiveStatus.OPEN or ids.count(i) > 1:
                raise StoreConflict(f"directive {i} is not open")
        for i, reward, seq in rewards:
            self._directives[i] = self._directives[i].with_status(DirectiveStatus.REWARDED, reward)
            self._ledger.append((seq, i))
        for p in disproofs:
            self._disproofs.setdefault((p.sender, p.param_space, p.student), p)

    def load_space_disproofs(self) -> list[SpaceDisproof]:
        return list(self._disproofs.values())

    def rewards_after(self, reward_seq: int) -> list[tuple[int, DirectiveRecord]]:
        return [(q, self._directives[i]) for q, i in sorted(self._ledger) if q > reward_seq]

    def last_reward_seq(self) -> int:
        return max((q for q, _ in self._ledger), default=0)

    def invalid_directives(self, context_dim: int) -> list[str]:
        return [
            i
            for i, d in self._directives.items()
            if d.context.shape != (context_dim,)
            or (d.status is DirectiveStatus.REWARDED and d.reward is None)
        ]

    def expire(self, directive_ids: Iterable[str]) -> None:
        for i in directive_ids:
            d = self._directives.get(i)
            if d is not None and d.status is DirectiveStatus.OPEN:
                self._directives[i] = d.with_status(DirectiveStatus.EXPIRED)

    def count_directives(self) -> dict[DirectiveStatus, int]:
        counts = dict.fromkeys(DirectiveStatus, 0)
        for d in self._directives.values():
            counts[d.status] += 1
        return counts


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bandit (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    context_dim INTEGER NOT NULL,
    a_inv BLOB NOT NULL,
    b BLOB NOT NULL,
    n_updates INTEGER NOT NULL,
    reward_count INTEGER NOT NULL,
    reward_mean REAL NOT NULL,
    reward_m2 REAL NOT NULL,
    a BLOB,
    reward_seq INTEGER,
    reward_window BLOB
);
CREATE TABLE IF NOT EXISTS trust (
    agent TEXT PRIMARY KEY, exchanges INTEGER NOT NULL, successes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS profiles (
    agent TEXT PRIMARY KEY, round INTEGER NOT NULL, features BLOB NOT NULL,
    endpoint TEXT NOT NULL, received_at REAL NOT NULL,
    param_space TEXT NOT NULL DEFAULT '', protocols TEXT NOT NULL DEFAULT '',
    overlay_peers TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS directives (
    directive_id TEXT PRIMARY KEY,
    matchmaking_round INTEGER NOT NULL,
    protocol TEXT NOT NULL, role TEXT NOT NULL,
    teacher TEXT NOT NULL, student TEXT NOT NULL,
    teacher_endpoint TEXT NOT NULL, student_endpoint TEXT NOT NULL,
    context BLOB NOT NULL, ucb REAL NOT NULL,
    issued_at REAL NOT NULL, expires_at REAL NOT NULL,
    status TEXT NOT NULL,
    reward REAL, normalised_reward REAL, loss_pre REAL, loss_post REAL,
    kilobytes INTEGER, rewarded_at REAL, reward_seq INTEGER,
    failure TEXT NOT NULL DEFAULT '',
    co_senders TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS directives_open ON directives(status) WHERE status = 'open';
CREATE TABLE IF NOT EXISTS space_disproofs (
    sender TEXT NOT NULL, param_space TEXT NOT NULL, student TEXT NOT NULL,
    directive_id TEXT NOT NULL, reported_at REAL NOT NULL,
    PRIMARY KEY (sender, param_space, student)
);
"""

# Databases written before the reward ledger had a sequence: add the columns, number the
# rewarded directives in the order they were applied, and mark the stored bandit (which
# was then written with every reward) as covering all of them.
_MIGRATIONS = (
    ("bandit", "a", "ALTER TABLE bandit ADD COLUMN a BLOB"),
    ("bandit", "reward_seq", "ALTER TABLE bandit ADD COLUMN reward_seq INTEGER"),
    ("directives", "reward_seq", "ALTER TABLE directives ADD COLUMN reward_seq INTEGER"),
    # The robust normaliser's window (services/cpm/robust_normalise.py); NULL: z-score.
    ("bandit", "reward_window", "ALTER TABLE bandit ADD COLUMN reward_window BLOB"),
    # The protocol menu: what each agent declared (services/cpm/menu.py).
    (
        "profiles",
        "param_space",
        "ALTER TABLE profiles ADD COLUMN param_space TEXT NOT NULL DEFAULT ''",
    ),
    ("profiles", "protocols", "ALTER TABLE profiles ADD COLUMN protocols TEXT NOT NULL DEFAULT ''"),
    (
        "profiles",
        "overlay_peers",
        "ALTER TABLE profiles ADD COLUMN overlay_peers TEXT NOT NULL DEFAULT ''",
    ),
    # Refused exchanges (services/cpm/refusals.py): the reason, "" for a reward.
    ("directives", "failure", "ALTER TABLE directives ADD COLUMN failure TEXT NOT NULL DEFAULT ''"),
    # Several senders per merge directive: JSON [[name, endpoint], ...], "" for none.
    (
        "directives",
        "co_senders",
        "ALTER TABLE directives ADD COLUMN co_senders TEXT NOT NULL DEFAULT ''",
    ),
)
_LEDGER_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS directives_reward_seq ON directives(reward_seq)"
    " WHERE reward_seq IS NOT NULL"
)


def _blob(a: NDArray[np.float64]) -> bytes:
    return np.ascontiguousarray(a, dtype="<f8").tobytes()


def _array(blob: bytes, shape: tuple[int, ...]) -> NDArray[np.float64]:
    arr = np.frombuffer(blob, dtype="<f8").astype(np.float64)
    return arr.reshape(shape)


def _window(blob: bytes) -> NDArray[np.float64]:
    """A stored reward window: float64 values, oldest first (an empty blob: no reward yet)."""
    if len(blob) % 8:
        raise ValueError(f"a reward window of {len(blob)} bytes is not float64 values")
    return _array(blob, (len(blob) // 8,))


def _co_senders(text: str) -> tuple[tuple[str, str], ...]:
    """The stored co-senders column (JSON ``[[name, endpoint], ...]``; "" for none)."""
    if not text:
        return ()
    return tuple((str(name), str(endpoint)) for name, endpoint in json.loads(text))


class SqliteCpmStore(CpmStore):
    """SQLite in WAL mode with ``synchronous=FULL``: a committed reward survives kill -9
    and power loss. One connection, guarded by a lock, so callers may use any one thread
    at a time (the service uses a single dedicated thread)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        with self._tx() as db:
            for table, column, ddl in _MIGRATIONS:
                cols = {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in cols:
                    db.execute(ddl)
            unnumbered = db.execute(
                "SELECT directive_id FROM directives WHERE status='rewarded'"
                " AND reward_seq IS NULL ORDER BY rewarded_at, rowid"
            ).fetchall()
            if unnumbered:
                top = db.execute("SELECT COALESCE(MAX(reward_seq), 0) FROM directives")
                first = int(top.fetchone()[0]) + 1
                db.executemany(
                    "UPDATE directives SET reward_seq=? WHERE directive_id=?",
                    [(first + k, str(r[0])) for k, r in enumerate(unnumbered)],
                )
            db.execute(
                "UPDATE bandit SET reward_seq=(SELECT COALESCE(MAX(reward_seq), 0)"
                " FROM directives) WHERE reward_seq IS NULL"
            )
            db.execute(_LEDGER_INDEX)

    def _tx(self) -> _Tx:
        return _Tx(self._db, self._lock)

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def load_snapshot(self) -> tuple[MatchmakerState, int] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT context_dim, a_inv, b, n_updates, reward_count, reward_mean, reward_m2,"
                " a, reward_seq, reward_window FROM bandit WHERE id=1"
            ).fetchone()
            trust_rows = self._db.execute(
                "SELECT agent, exchanges, successes FROM trust"
            ).fetchall()
        if row is None:
            return None
        d = int(row[0])
        state = MatchmakerState(
            context_dim=d,
            a_inv=_array(row[1], (d, d)),
            b=_array(row[2], (d,)),
            n_updates=int(row[3]),
            reward_count=int(row[4]),
            reward_mean=float(row[5]),
            reward_m2=float(row[6]),
            trust={str(a): (int(e), int(s)) for a, e, s in trust_rows},
            a=None if row[7] is None else _array(row[7], (d, d)),
            reward_window=None if row[9] is None else _window(row[9]),
        )
        return state, int(row[8] or 0)

    def save_snapshot(self, state: MatchmakerState, reward_seq: int) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO bandit(id, context_dim, a_inv, b, n_updates,"
                " reward_count, reward_mean, reward_m2, a, reward_seq, reward_window)"
                " VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    state.context_dim,
                    _blob(state.a_inv),
                    _blob(state.b),
                    state.n_updates,
                    state.reward_count,
                    state.reward_mean,
                    state.reward_m2,
                    None if state.a is None else _blob(state.a),
                    reward_seq,
                    None if state.reward_window is None else _blob(state.reward_window),
                ),
            )
            db.execute("DELETE FROM trust")
            db.executemany(
                "INSERT INTO trust(agent, exchanges, successes) VALUES (?, ?, ?)",
                [(a, e, s) for a, (e, s) in state.trust.items()],
            )

    def upsert_profile(self, profile: ProfileRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO profiles(agent, round, features, endpoint, received_at,"
                " param_space, protocols, overlay_peers) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    profile.agent,
                    profile.round,
                    _blob(profile.features),
                    profile.endpoint,
                    profile.received_at,
                    profile.param_space,
                    # Names are identifiers (checked before they get here): a space-free list.
                    " ".join(profile.protocols),
                    # Certificate names (checked): no spaces either.
                    " ".join(profile.overlay_peers),
                ),
            )

    def load_profiles(self) -> list[ProfileRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT agent, round, features, endpoint, received_at, param_space, protocols,"
                " overlay_peers FROM profiles"
            ).fetchall()
        return [
            ProfileRecord(
                agent=str(a),
                round=int(r),
                features=_array(f, (len(f) // 8,)),
                endpoint=str(e),
                received_at=float(t),
                param_space=str(ps),
                protocols=tuple(str(pr).split()),
                overlay_peers=tuple(str(op).split()),
            )
            for a, r, f, e, t, ps, pr, op in rows
        ]

    def record_round(self, matchmaking_round: int, directives: Iterable[DirectiveRecord]) -> None:
        rows = [
            (
                d.directive_id,
                d.matchmaking_round,
                d.protocol,
                d.role,
                d.teacher,
                d.student,
                d.teacher_endpoint,
                d.student_endpoint,
                _blob(d.context),
                d.ucb,
                d.issued_at,
                d.expires_at,
                d.status.value,
                json.dumps([list(c) for c in d.co_senders]) if d.co_senders else "",
            )
            for d in directives
        ]
        with self._tx() as db:
            try:
                db.executemany(
                    "INSERT INTO directives(directive_id, matchmaking_round, protocol, role,"
                    " teacher, student, teacher_endpoint, student_endpoint, context, ucb,"
                    " issued_at, expires_at, status, co_senders)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
            except sqlite3.IntegrityError as exc:
                raise StoreConflict(f"directive id collision: {exc}") from None
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('matchmaking_round', ?)",
                (str(matchmaking_round),),
            )

    _DIRECTIVE_COLUMNS = (
        "directive_id, matchmaking_round, protocol, role, teacher, student, teacher_endpoint,"
        " student_endpoint, context, ucb, issued_at, expires_at, status, reward,"
        " normalised_reward, loss_pre, loss_post, kilobytes, rewarded_at, failure, co_senders"
    )

    @staticmethod
    def _directive(row: tuple[object, ...]) -> DirectiveRecord:
        ctx = row[8]
        assert isinstance(ctx, bytes)
        status = DirectiveStatus(str(row[12]))
        reward = None
        if status is DirectiveStatus.REWARDED:
            reward = RewardRecord(
                reward=float(row[13]),  # type: ignore[arg-type]
                normalised=float(row[14]),  # type: ignore[arg-type]
                loss_pre=float(row[15]),  # type: ignore[arg-type]
                loss_post=float(row[16]),  # type: ignore[arg-type]
                kilobytes=int(row[17]),  # type: ignore[call-overload]
                rewarded_at=float(row[18]),  # type: ignore[arg-type]
                failure=str(row[19]),
            )
        return DirectiveRecord(
            directive_id=str(row[0]),
            matchmaking_round=int(row[1]),  # type: ignore[call-overload]
            protocol=str(row[2]),
            role=str(row[3]),
            teacher=str(row[4]),
            student=str(row[5]),
            teacher_endpoint=str(row[6]),
            student_endpoint=str(row[7]),
            context=_array(ctx, (len(ctx) // 8,)),
            ucb=float(row[9]),  # type: ignore[arg-type]
            issued_at=float(row[10]),  # type: ignore[arg-type]
            expires_at=float(row[11]),  # type: ignore[arg-type]
            status=status,
            reward=reward,
            co_senders=_co_senders(str(row[20])),
        )

    def get_directive(self, directive_id: str) -> DirectiveRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._DIRECTIVE_COLUMNS} FROM directives WHERE directive_id=?",
                (directive_id,),
            ).fetchone()
        return None if row is None else self._directive(row)

    def open_directives(self) -> list[DirectiveRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._DIRECTIVE_COLUMNS} FROM directives WHERE status='open'"
            ).fetchall()
        return [self._directive(r) for r in rows]

    def commit_rewards(
        self,
        rewards: Sequence[tuple[str, RewardRecord, int]],
        disproofs: Sequence[SpaceDisproof] = (),
    ) -> None:
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO space_disproofs"
                " (sender, param_space, student, directive_id, reported_at)"
                " VALUES (?, ?, ?, ?, ?)",
                [
                    (p.sender, p.param_space, p.student, p.directive_id, p.reported_at)
                    for p in disproofs
                ],
            )
            for directive_id, reward, seq in rewards:
                cur = db.execute(
                    "UPDATE directives SET status='rewarded', reward=?, normalised_reward=?,"
                    " loss_pre=?, loss_post=?, kilobytes=?, rewarded_at=?, reward_seq=?,"
                    " failure=? WHERE directive_id=? AND status='open'",
                    (
                        reward.reward,
                        reward.normalised,
                        reward.loss_pre,
                        reward.loss_post,
                        reward.kilobytes,
                        reward.rewarded_at,
                        seq,
                        reward.failure,
                        directive_id,
                    ),
                )
                if cur.rowcount != 1:
                    raise StoreConflict(f"directive {directive_id} is not open")

    def load_space_disproofs(self) -> list[SpaceDisproof]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sender, param_space, student, directive_id, reported_at"
                " FROM space_disproofs ORDER BY reported_at, rowid"
            ).fetchall()
        return [SpaceDisproof(str(a), str(b), str(c), str(d), float(e)) for a, b, c, d, e in rows]

    def rewards_after(self, reward_seq: int) -> list[tuple[int, DirectiveRecord]]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT reward_seq, {self._DIRECTIVE_COLUMNS} FROM directives"
                " WHERE status='rewarded' AND reward_seq > ? ORDER BY reward_seq",
                (reward_seq,),
            ).fetchall()
        return [(int(r[0]), self._directive(r[1:])) for r in rows]

    def invalid_directives(self, context_dim: int) -> list[str]:
        statuses = ",".join(f"'{s.value}'" for s in DirectiveStatus)
        with self._lock:
            rows = self._db.execute(
                "SELECT directive_id FROM directives WHERE"
                f" status NOT IN ({statuses})"
                " OR typeof(context) != 'blob' OR length(context) != ?"
                " OR (status = 'rewarded' AND (reward IS NULL OR normalised_reward IS NULL"
                "      OR reward_seq IS NULL OR rewarded_at IS NULL))"
                " ORDER BY rowid LIMIT 100",
                (8 * context_dim,),
            ).fetchall()
        return [str(r[0]) for r in rows]

    def last_reward_seq(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT COALESCE(MAX(reward_seq), 0) FROM directives").fetchone()
        return int(row[0])

    def expire(self, directive_ids: Iterable[str]) -> None:
        with self._tx() as db:
            db.executemany(
                "UPDATE directives SET status='expired' WHERE directive_id=? AND status='open'",
                [(i,) for i in directive_ids],
            )

    def count_directives(self) -> dict[DirectiveStatus, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT status, COUNT(*) FROM directives GROUP BY status"
            ).fetchall()
        counts = dict.fromkeys(DirectiveStatus, 0)
        for status, n in rows:
            counts[DirectiveStatus(str(status))] = int(n)
        return counts

    def close(self) -> None:
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()


class _Tx:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` under the store lock; rollback on error."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db = db
        self._lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self._lock.release()
