"""One abstract test class, run against every CpmStore backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from peerlm.services.cpm.matchmaker import MatchmakerState
from peerlm.services.cpm.records import (
    DirectiveRecord,
    DirectiveStatus,
    ProfileRecord,
    RewardRecord,
)
from peerlm.services.cpm.store import CpmStore, MemoryCpmStore, SqliteCpmStore, StoreConflict


def _state(d: int = 4, n: int = 0) -> MatchmakerState:
    rng = np.random.default_rng(n)
    m = rng.normal(size=(d, d))
    return MatchmakerState(
        context_dim=d,
        a_inv=m @ m.T + np.eye(d),
        b=rng.normal(size=d),
        n_updates=n,
        reward_count=n,
        reward_mean=0.25 * n,
        reward_m2=1.5 * n,
        trust={"a": (n, n // 2), "b": (1, 0)},
    )


def _directive(i: str, teacher: str = "a", student: str = "b") -> DirectiveRecord:
    return DirectiveRecord(
        directive_id=i * 32,
        matchmaking_round=1,
        protocol="akd",
        role="one_way",
        teacher=teacher,
        student=student,
        teacher_endpoint="127.0.0.1:1",
        student_endpoint="",
        context=np.arange(6, dtype=np.float64),
        ucb=1.5,
        issued_at=10.0,
        expires_at=20.0,
    )


class StoreContract:
    """Behaviour every backend must have."""

    def make(self, tmp_path: Path) -> CpmStore:
        raise NotImplementedError

    def reopen(self, store: CpmStore, tmp_path: Path) -> CpmStore:
        return store

    def test_meta_and_bandit_round_trip(self, tmp_path: Path) -> None:
        store = self.make(tmp_path)
        assert store.load_snapshot() is None
        store.set_meta("k", "v")
        s = _state(n=3)
        s.a = np.linalg.inv(s.a_inv)
        store.save_snapshot(s, 3)
        store = self.reopen(store, tmp_path)
        loaded = store.load_snapshot()
        assert loaded is not None and loaded[1] == 3
        got = loaded[0]
        assert got.a is not None
        np.testing.assert_array_equal(got.a, s.a)
        np.testing.assert_array_equal(got.a_inv, s.a_inv)
        np.testing.assert_array_equal(got.b, s.b)
        assert (got.n_updates, got.reward_mean, got.reward_m2) == (3, 0.75, 4.5)
        assert got.trust == s.trust
        assert store.get_meta("k") == "v"

    @pytest.mark.parametrize("window", [None, [], [0.5, -1.25, 3.0]])
    def test_reward_window_round_trip(self, tmp_path: Path, window: list[float] | None) -> None:
        """The robust normaliser's window (None under the z-score; empty before a reward)."""
        store = self.make(tmp_path)
        s = _state(n=3)
        s.reward_window = None if window is None else np.array(window, dtype=np.float64)
        store.save_snapshot(s, 3)
        store = self.reopen(store, tmp_path)
        loaded = store.load_snapshot()
        assert loaded is not None
        got = loaded[0].reward_window
        if window is None:
            assert got is None
        else:
            assert got is not None and got.tolist() == window
        assert loaded[0] == s

    def test_profiles_upsert(self, tmp_path: Path) -> None:
        store = self.make(tmp_path)
        store.upsert_profile(ProfileRecord("a", 1, np.ones(3), "h:1", 5.0))
        store.upsert_profile(ProfileRecord("a", 2, np.zeros(3), "h:2", 6.0))
        store = self.reopen(store, tmp_path)
        [p] = store.load_profiles()
        assert (p.agent, p.round, p.endpoint) == ("a", 2, "h:2")
        np.testing.assert_array_equal(p.features, np.zeros(3))

    def test_reward_is_single_use_and_batches_are_atomic(self, tmp_path: Path) -> None:
        store = self.make(tmp_path)
        store.record_round(1, [_directive("a"), _directive("b"), _directive("e")])
        assert store.get_meta("matchmaking_round") == "1"
        assert len(store.open_directives()) == 3
        reward = RewardRecord(0.5, 0.0, 2.0, 1.5, 7, 11.0)
        store.commit_rewards([("a" * 32, reward, 1)])
        with pytest.raises(StoreConflict):
            store.commit_rewards([("a" * 32, reward, 2)])
        # One refused row fails the whole batch: "e" stays open.
        with pytest.raises(StoreConflict):
            store.commit_rewards([("e" * 32, reward, 2), ("a" * 32, reward, 3)])
        store = self.reopen(store, tmp_path)
        assert store.last_reward_seq() == 1
        [(seq, rewarded)] = store.rewards_after(0)
        assert seq == 1 and rewarded.directive_id == "a" * 32
        assert store.rewards_after(1) == []
        store.commit_rewards([("e" * 32, reward, 2)])
        assert [q for q, _ in store.rewards_after(0)] == [1, 2]
        store.expire(["e" * 32])
        d = store.get_directive("a" * 32)
        assert d is not None and d.status is DirectiveStatus.REWARDED and d.reward == reward
        np.testing.assert_array_equal(d.context, np.arange(6, dtype=np.float64))
        assert [x.directive_id for x in store.open_directives()] == ["b" * 32]
        counts = store.count_directives()
        assert counts[DirectiveStatus.REWARDED] == 2 and counts[DirectiveStatus.OPEN] == 1

    def test_expire_and_duplicate_ids(self, tmp_path: Path) -> None:
        store = self.make(tmp_path)
        store.record_round(1, [_directive("c")])
        with pytest.raises(StoreConflict):
            store.record_round(2, [_directive("c")])
        store.expire(["c" * 32])
        assert store.open_directives() == []
        with pytest.raises(StoreConflict):
            store.commit_rewards([("c" * 32, RewardRecord(1, 0, 0, 0, 0, 0), 1)])
        d = store.get_directive("c" * 32)
        assert d is not None and d.status is DirectiveStatus.EXPIRED
        assert store.get_directive("f" * 32) is None


class TestMemoryStore(StoreContract):
    def make(self, tmp_path: Path) -> CpmStore:
        return MemoryCpmStore()


class TestSqliteStore(StoreContract):
    def make(self, tmp_path: Path) -> CpmStore:
        return SqliteCpmStore(tmp_path / "cpm.db")

    def reopen(self, store: CpmStore, tmp_path: Path) -> CpmStore:
        store.close()
        return SqliteCpmStore(tmp_path / "cpm.db")

    def test_wal_mode(self, tmp_path: Path) -> None:
        import sqlite3

        store = self.make(tmp_path)
        store.set_meta("x", "y")
        mode = sqlite3.connect(tmp_path / "cpm.db").execute("PRAGMA journal_mode").fetchone()
        assert mode[0] == "wal"
        store.close()
