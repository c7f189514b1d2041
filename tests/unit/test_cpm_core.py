"""The CPM protocol core with an in-memory store and a fake clock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from peerlm.services.cpm import MENU, CpmSettings, Pairing
from peerlm.services.cpm.core import CpmCore, CpmError, RewardReport
from peerlm.services.cpm.records import DirectiveStatus
from peerlm.services.cpm.store import MemoryCpmStore, SqliteCpmStore
from pydantic import ValidationError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _profile(i: int) -> list[float]:
    rng = np.random.default_rng(i)
    p = rng.uniform(0, 1, 32)
    return [float(x) for x in p]


@pytest.fixture
def core() -> tuple[CpmCore, Clock, MemoryCpmStore]:
    clock = Clock()
    store = MemoryCpmStore()
    settings = CpmSettings(directive_ttl_s=60, round_interval_s=30, init=True)
    return CpmCore(settings, store, clock), clock, store


def _submit_all(c: CpmCore, agents: list[str], round_: int = 1) -> None:
    for i, a in enumerate(agents):
        c.submit_profile(a, round_, _profile(i), f"127.0.0.1:{5000 + i}", connected=len(agents))


def test_quorum_then_disjoint_directives(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, _, _ = core
    agents = ["a", "b", "c", "d"]
    for i, a in enumerate(agents[:3]):
        out = c.submit_profile(a, 1, _profile(i), "", connected=4)
        assert not out.quorum_reached
    out = c.submit_profile("d", 1, _profile(3), "h:1", connected=4)
    assert out.quorum_reached and c.match_due(4) == "quorum"
    match = c.matchmake()
    assert match.matchmaking_round == 1 and len(match.directives) == 2
    seen = [x for d in match.directives for x in (d.teacher, d.student)]
    assert sorted(seen) == agents
    for d in match.directives:
        assert d in c.open_directives_for(d.teacher) and d in c.open_directives_for(d.student)
    assert c.pending == 0 and c.match_due(4) is None


def test_timer_trigger(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, clock, _ = core
    c.submit_profile("a", 1, _profile(0), "", connected=10)
    c.submit_profile("b", 1, _profile(1), "", connected=10)
    assert c.match_due(10) is None
    clock.now += 31
    assert c.match_due(10) == "timer"


def test_reward_once_from_student_only(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, _, store = core
    _submit_all(c, ["a", "b"])
    [d] = c.matchmake().directives
    with pytest.raises(CpmError) as e:
        c.report_reward(d.teacher, d.directive_id, 1.0)
    assert e.value.code == "PERMISSION_DENIED"
    with pytest.raises(CpmError) as e:
        c.report_reward("mallory", d.directive_id, 1.0)
    assert e.value.code == "PERMISSION_DENIED"
    out = c.report_reward(d.student, d.directive_id, 0.7, loss_pre=2, loss_post=1.3, kilobytes=4)
    assert out.bandit_updates == 1 and out.normalised == 0.0
    assert store.get_directive(d.directive_id).status is DirectiveStatus.REWARDED  # type: ignore[union-attr]
    with pytest.raises(CpmError) as e:
        c.report_reward(d.student, d.directive_id, 0.7)
    assert e.value.code == "ALREADY_EXISTS"
    assert c.matchmaker.n_updates == 1


@pytest.mark.parametrize(
    ("directive_id", "reward", "code", "reason"),
    [
        ("nothex", 1.0, "INVALID_ARGUMENT", "directive_id"),
        ("0" * 32, float("nan"), "INVALID_ARGUMENT", "non_finite"),
        ("0" * 32, float("inf"), "INVALID_ARGUMENT", "non_finite"),
        ("0" * 32, 1e12, "INVALID_ARGUMENT", "reward_magnitude"),
        ("0" * 32, 1.0, "NOT_FOUND", "unknown_directive"),
    ],
)
def test_bad_rewards_leave_state_unchanged(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
    directive_id: str,
    reward: float,
    code: str,
    reason: str,
) -> None:
    c, _, _ = core
    before = c.matchmaker.snapshot()
    with pytest.raises(CpmError) as e:
        c.report_reward("a", directive_id, reward)
    assert (e.value.code, e.value.reason) == (code, reason)
    after = c.matchmaker.snapshot()
    np.testing.assert_array_equal(before.a_inv, after.a_inv)
    assert after.n_updates == before.n_updates


def test_expired_directive(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, clock, _ = core
    _submit_all(c, ["a", "b"])
    [d] = c.matchmake().directives
    clock.now += 61
    with pytest.raises(CpmError) as e:
        c.report_reward(d.student, d.directive_id, 1.0)
    assert e.value.code == "FAILED_PRECONDITION"
    assert c.open_count == 0 and c.matchmaker.n_updates == 0


def test_expire_due(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, clock, _ = core
    _submit_all(c, ["a", "b", "c", "d"])
    c.matchmake()
    assert c.expire_due() == []
    clock.now += 61
    assert len(c.expire_due()) == 2 and c.open_count == 0


@pytest.mark.parametrize(
    ("features", "endpoint", "reason"),
    [
        ([0.0] * 31, "", "profile_dim"),
        ([0.0] * 33, "", "profile_dim"),
        ([float("nan")] + [0.0] * 31, "", "profile_values"),
        ([float("inf")] + [0.0] * 31, "", "profile_values"),
        ([1e9] + [0.0] * 31, "", "profile_values"),
        ([0.0] * 32, "not an endpoint", "endpoint"),
        ([0.0] * 32, "h:1" + "x" * 300, "endpoint"),
    ],
)
def test_bad_profiles_refused(
    core: tuple[CpmCore, Clock, MemoryCpmStore], features: list[float], endpoint: str, reason: str
) -> None:
    c, _, store = core
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 1, features, endpoint, connected=1)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.reason == reason
    assert store.load_profiles() == [] and c.pending == 0


@pytest.mark.parametrize(
    "endpoint", ["h:0", "h:65536", "h:99999", "[::1]:70000", "h:", ":80", "h:1:2", "h :80"]
)
def test_endpoint_port_must_be_a_tcp_port(
    core: tuple[CpmCore, Clock, MemoryCpmStore], endpoint: str
) -> None:
    """Port 99999 was once accepted."""
    c, _, store = core
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 1, _profile(0), endpoint, connected=1)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.reason == "endpoint"
    assert store.load_profiles() == [] and c.pending == 0


SANS = frozenset({"127.0.0.1", "::1", "a1.example.org", "*.pool.example.org"})


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "127.0.0.1:5000",
        "A1.Example.org:5000",
        "a1.example.org.:1",
        "[::1]:8",
        "x.pool.example.org:65535",
    ],
)
def test_an_endpoint_named_by_the_callers_certificate_is_accepted(
    core: tuple[CpmCore, Clock, MemoryCpmStore], endpoint: str
) -> None:
    c, _, _ = core
    c.submit_profile("a", 1, _profile(0), endpoint, connected=1, endpoint_hosts=SANS)
    assert c.pending == 1


@pytest.mark.parametrize(
    "endpoint",
    [
        "a2.example.org:5000",
        "10.0.0.7:5000",
        "pool.example.org:1",
        "y.x.pool.example.org:1",
        "[::2]:1",
    ],
)
def test_an_endpoint_not_in_the_callers_certificate_is_refused(
    core: tuple[CpmCore, Clock, MemoryCpmStore], endpoint: str
) -> None:
    """Another agent's address was once accepted as this agent's peer endpoint."""
    c, _, store = core
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 1, _profile(0), endpoint, connected=1, endpoint_hosts=SANS)
    assert e.value.code == "PERMISSION_DENIED" and e.value.reason == "endpoint_not_certified"
    assert endpoint.rsplit(":", 1)[0] in e.value.message
    assert store.load_profiles() == [] and c.pending == 0
    # Without a certificate (insecure-dev: endpoint_hosts=None) only the form is checked.
    c.submit_profile("a", 1, _profile(0), endpoint, connected=1)
    assert c.pending == 1


def test_stale_round_refused_same_round_accepted(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
) -> None:
    c, _, _ = core
    c.submit_profile("a", 5, _profile(0), "", connected=1)
    c.submit_profile("a", 5, _profile(1), "", connected=1)
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 4, _profile(0), "", connected=1)
    assert e.value.code == "FAILED_PRECONDITION"


def test_max_agents(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    clock = Clock()
    c = CpmCore(CpmSettings(max_agents=2, init=True), MemoryCpmStore(), clock)
    c.submit_profile("a", 1, _profile(0), "", connected=0)
    c.submit_profile("b", 1, _profile(1), "", connected=0)
    with pytest.raises(CpmError) as e:
        c.submit_profile("c", 1, _profile(2), "", connected=0)
    assert e.value.code == "RESOURCE_EXHAUSTED"


def test_restart_restores_everything(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, clock, store = core
    _submit_all(c, ["a", "b", "c", "d"])
    ds = c.matchmake().directives
    c.report_reward(ds[0].student, ds[0].directive_id, 0.3)
    c2 = CpmCore(CpmSettings(directive_ttl_s=60, round_interval_s=30), store, clock)
    assert c2.matchmaker.n_updates == 1
    np.testing.assert_array_equal(c2.matchmaker.snapshot().a_inv, c.matchmaker.snapshot().a_inv)
    assert c2.matchmaking_round == 1 and c2.open_count == 1
    with pytest.raises(CpmError) as e:
        c2.report_reward(ds[0].student, ds[0].directive_id, 0.3)
    assert e.value.code == "ALREADY_EXISTS"
    c2.report_reward(ds[1].student, ds[1].directive_id, -0.3)
    assert c2.matchmaker.n_updates == 2


def test_restart_keeps_unmatched_profiles_pending(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
) -> None:
    c, clock, store = core
    _submit_all(c, ["a", "b", "c", "d"])
    assert c.matchmake().directives  # a..d matched: not pending after a restart
    clock.now += 5
    c.submit_profile("a", 2, _profile(0), "h:1", connected=4)
    c.submit_profile("b", 2, _profile(1), "h:2", connected=4)
    settings = CpmSettings(directive_ttl_s=60, round_interval_s=30)
    c2 = CpmCore(settings, store, clock)
    assert c2.pending == 2  # a and b wait for the next matchmaking, as before the restart
    match = c2.matchmake()
    assert {x for d in match.directives for x in (d.teacher, d.student)} == {"a", "b"}
    assert CpmCore(settings, store, clock).pending == 0  # matched: never twice
    # A profile older than a directive's lifetime is not revived (its agent moved on).
    clock.now += 5
    c2.submit_profile("c", 2, _profile(2), "h:3", connected=4)
    clock.now += 61
    assert CpmCore(settings, store, clock).pending == 0


def test_changed_bandit_settings_refused(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    _, clock, store = core
    with pytest.raises(ValueError, match="different bandit settings"):
        CpmCore(CpmSettings(interaction_features=False), store, clock)


def test_failed_commit_rolls_back_model(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, _, store = core
    _submit_all(c, ["a", "b"])
    [d] = c.matchmake().directives
    before = c.matchmaker.snapshot()

    def boom(*_: object) -> None:
        raise OSError("disk full")

    store.commit_rewards = boom  # type: ignore[method-assign]
    with pytest.raises(OSError):
        c.report_reward(d.student, d.directive_id, 1.0)
    after = c.matchmaker.snapshot()
    np.testing.assert_array_equal(before.a_inv, after.a_inv)
    np.testing.assert_array_equal(before.b, after.b)
    assert after.reward_count == before.reward_count and c.open_count == 1


def _rewarded(c: CpmCore, rounds: int) -> None:
    agents = ["a", "b", "c", "d"]
    for r in range(1, rounds + 1):
        _submit_all(c, agents, r)
        for d in c.matchmake().directives:
            c.report_reward(d.student, d.directive_id, 0.1 * r)


def test_indefinite_snapshot_is_rebuilt_from_the_ledger(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
) -> None:
    c, clock, store = core
    _rewarded(c, 5)
    good = c.matchmaker.snapshot()
    bad = c.matchmaker.snapshot()
    bad.a_inv = -bad.a_inv  # what the attack left behind: an indefinite A^-1, no A
    bad.a = None
    store.save_snapshot(bad, 10)
    c2 = CpmCore(CpmSettings(directive_ttl_s=60, round_interval_s=30), store, clock)
    assert c2.bandit_recovery.startswith("rebuilt")
    assert c2.matchmaker.n_updates == 10
    np.testing.assert_allclose(c2.matchmaker.snapshot().a_inv, good.a_inv, rtol=1e-8, atol=1e-12)
    loaded = store.load_snapshot()
    assert loaded is not None and loaded[1] == 10
    assert np.linalg.eigvalsh(loaded[0].a_inv).min() > 0


def test_invalid_state_is_never_persisted(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, _, store = core
    _rewarded(c, 3)
    assert c.write_snapshot()
    bandit = c.matchmaker._bandit
    bandit._a_inv = -bandit._a_inv  # simulate corruption of both matrices in memory
    bandit._a = -bandit._a
    assert c.write_snapshot()
    assert c.snapshots_refused == 1
    loaded = store.load_snapshot()
    assert loaded is not None
    assert np.linalg.eigvalsh(loaded[0].a_inv).min() > 0 and loaded[0].n_updates == 6


def test_sqlite_restart_replays_rewards_after_the_snapshot(tmp_path: Path) -> None:
    from peerlm.services.cpm.store import SqliteCpmStore

    clock = Clock()
    settings = CpmSettings(directive_ttl_s=60, round_interval_s=30, snapshot_every=4, init=True)
    store = SqliteCpmStore(tmp_path / "cpm.db")
    c = CpmCore(settings, store, clock)
    _rewarded(c, 5)  # 10 rewards: snapshots after 4 and 8, two rewards only in the ledger
    loaded = store.load_snapshot()
    assert loaded is not None and loaded[1] == 8
    expected = c.matchmaker.snapshot()
    store.close()  # like a SIGKILL: no final snapshot
    store = SqliteCpmStore(tmp_path / "cpm.db")
    c2 = CpmCore(settings, store, clock)
    assert c2.bandit_recovery == "snapshot" and c2.rewards_replayed == 2
    assert c2.matchmaker.snapshot() == expected  # the same code path: bitwise equal
    store.close()


def test_one_batch_takes_a_directive_once(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    c, _, _ = core
    _submit_all(c, ["a", "b"])
    [d] = c.matchmake().directives
    rep = RewardReport(d.student, d.directive_id, 0.5)
    out = c.report_rewards([rep, rep, RewardReport(d.teacher, d.directive_id, 0.5)])
    assert not isinstance(out[0], CpmError)
    assert isinstance(out[1], CpmError) and out[1].reason == "replayed"
    assert isinstance(out[2], CpmError) and out[2].reason == "not_receiver"
    assert c.matchmaker.n_updates == 1


def test_unpaired_agents_are_named(core: tuple[CpmCore, Clock, MemoryCpmStore]) -> None:
    """Three profiles make one pair: the third agent is reported unmatched (and told)."""
    c, _, _ = core
    _submit_all(c, ["a", "b", "c"])
    match = c.matchmake()
    assert len(match.directives) == 1
    paired = {match.directives[0].teacher, match.directives[0].student}
    assert set(match.unmatched) == {"a", "b", "c"} - paired and len(match.unmatched) == 1
    assert match.unmatched_round == match.matchmaking_round == 1
    # A full pairing leaves nobody out.
    _submit_all(c, ["a", "b", "c", "d"], round_=2)
    assert c.matchmake().unmatched == ()


def test_a_lone_agent_is_told_once_nobody_else_is_connected(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
) -> None:
    c, clock, _ = core
    _submit_all(c, ["a", "b"])
    c.matchmake()
    out = c.submit_profile("a", 2, _profile(0), "", connected=2)
    clock.now += 31
    assert c.match_due(2) is None  # b is still connected: it may yet submit
    assert c.match_due(1) == "alone"
    match = c.matchmake()
    assert match.directives == [] and match.unmatched == ("a",)
    assert match.unmatched_round == out.matchmaking_round  # the round "a" was promised
    assert c.pending == 0


# -- the protocol menu: declarations validated, stored and obeyed -------------------------


def _menu_core(store: MemoryCpmStore | SqliteCpmStore | None = None) -> CpmCore:
    settings = CpmSettings(protocols=MENU, init=True, directive_ttl_s=60)
    return CpmCore(settings, store or MemoryCpmStore(), Clock())


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"param_space": "x" * 129}, "param_space"),
        ({"param_space": "white space"}, "param_space"),
        ({"protocols": ["akd", "akd"]}, "protocols"),
        ({"protocols": ["Bad"]}, "protocols"),
        ({"protocols": [f"p{k}" for k in range(17)]}, "protocols"),
    ],
)
def test_bad_declarations_are_refused_and_change_nothing(
    kwargs: dict[str, object], reason: str
) -> None:
    c = _menu_core()
    c.submit_profile("a", 1, _profile(0), "h:1", connected=2, param_space="ps-1")
    before = [(p.agent, p.round, p.param_space, p.protocols) for p in c.agents()]
    with pytest.raises(CpmError) as e:
        c.submit_profile("a", 2, _profile(1), "h:1", connected=2, **kwargs)  # type: ignore[arg-type]
    assert (e.value.code, e.value.reason) == ("INVALID_ARGUMENT", reason)
    assert [(p.agent, p.round, p.param_space, p.protocols) for p in c.agents()] == before
    assert c.pending == 1


def test_directives_name_only_admissible_protocols() -> None:
    c = _menu_core()
    spaces = {"a": "ps-1", "b": "ps-1", "c": "ps-2", "d": "ps-2", "e": "", "f": ""}
    for i, (agent, space) in enumerate(spaces.items()):
        c.submit_profile(
            agent, 1, _profile(i), f"h:{i + 1}", connected=6, param_space=space, protocols=MENU
        )
    for _ in range(6):
        match = c.matchmake()
        for d in match.directives:
            same = spaces[d.teacher] and spaces[d.teacher] == spaces[d.student]
            assert d.protocol == "akd" or same, d
            # Reward what is inadmissible across spaces most: the mask still holds.
            c.report_reward(d.student, d.directive_id, 1.0 if d.protocol != "akd" else -1.0)
        for i, (agent, space) in enumerate(spaces.items()):
            c.submit_profile(
                agent, 1, _profile(i), f"h:{i + 1}", connected=6, param_space=space, protocols=MENU
            )


def test_declarations_survive_a_restart_and_old_databases_migrate(tmp_path: Path) -> None:
    db = tmp_path / "cpm.db"
    # A database from before the menu: the profiles table has no declaration columns.
    old = sqlite3.connect(db)
    old.execute(
        "CREATE TABLE profiles (agent TEXT PRIMARY KEY, round INTEGER NOT NULL, "
        "features BLOB NOT NULL, endpoint TEXT NOT NULL, received_at REAL NOT NULL)"
    )
    old.execute(
        "INSERT INTO profiles VALUES ('old', 3, ?, 'h:9', 1.0)",
        (np.zeros(32, "<f8").tobytes(),),
    )
    old.commit()
    old.close()
    store = SqliteCpmStore(db)
    c = _menu_core(store)
    [legacy] = c.agents()
    assert (legacy.agent, legacy.param_space, legacy.protocols) == ("old", "", ())
    c.submit_profile(
        "a", 1, _profile(0), "h:1", connected=2, param_space="ps1:ab", protocols=["akd", "pmix"]
    )
    store.close()
    store = SqliteCpmStore(db)
    c2 = CpmCore(CpmSettings(protocols=MENU, directive_ttl_s=60), store, Clock())
    got = {p.agent: (p.param_space, p.protocols) for p in c2.agents()}
    assert got == {"old": ("", ()), "a": ("ps1:ab", ("akd", "pmix"))}
    store.close()


@pytest.mark.parametrize("protocols", [("h_ties",), ("akd", "lora"), ()])
def test_the_cpm_menu_is_checked_at_start(protocols: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError):
        CpmSettings(protocols=protocols)


def test_the_default_menu_is_akd_only() -> None:
    assert CpmSettings().protocols == ("akd",)


# -- the robust reward normaliser across restarts (services/cpm/robust_normalise.py) -------


def _robust_settings(**kw: object) -> CpmSettings:
    given: dict[str, object] = {
        "directive_ttl_s": 60,
        "round_interval_s": 30,
        "snapshot_every": 7,
        "reward_normaliser": "robust",
        "reward_window": 16,
    }
    return CpmSettings(**(given | kw))  # type: ignore[arg-type]


def _pairing_of(d: object) -> Pairing:
    return Pairing(
        sender=d.teacher,  # type: ignore[attr-defined]
        receiver=d.student,  # type: ignore[attr-defined]
        protocol=d.protocol,  # type: ignore[attr-defined]
        role=d.role,  # type: ignore[attr-defined]
        context=d.context,  # type: ignore[attr-defined]
        ucb=d.ucb,  # type: ignore[attr-defined]
        mean=float("nan"),
    )


def test_sqlite_restart_keeps_the_robust_window_exactly(tmp_path: Path) -> None:
    """Same z-scores after a kill, a restart and the ledger's replay as without the restart:
    30 rewards (the window of 16 has wrapped), snapshots after 7, 14, 21 and 28, two
    rewards only in the ledger; then 20 more rewards on both."""
    clock = Clock()
    agents = ["a", "b", "c", "d"]
    rng = np.random.default_rng(7)
    store = SqliteCpmStore(tmp_path / "cpm.db")
    c = CpmCore(_robust_settings(init=True), store, clock)
    for r in range(1, 16):
        _submit_all(c, agents, r)
        for d in c.matchmake().directives:
            c.report_reward(d.student, d.directive_id, float(rng.normal(0, 0.2)))
    expected = c.matchmaker.snapshot()
    assert expected.reward_window is not None and len(expected.reward_window) == 16
    assert expected.reward_count == 30
    loaded = store.load_snapshot()
    assert loaded is not None and loaded[1] == 28
    unrestarted = c.matchmaker  # goes on in memory, as if the CPM had never stopped
    store.close()  # like a SIGKILL: no final snapshot
    store = SqliteCpmStore(tmp_path / "cpm.db")
    c2 = CpmCore(_robust_settings(), store, clock)
    assert c2.bandit_recovery == "snapshot" and c2.rewards_replayed == 2
    assert c2.matchmaker.snapshot() == expected  # window, count and bandit: bitwise
    for r in range(16, 26):
        _submit_all(c2, agents, r)
        for d in c2.matchmake().directives:
            reward = float(rng.normal(0, 0.2))
            out = c2.report_reward(d.student, d.directive_id, reward)
            assert out.normalised == unrestarted.observe(_pairing_of(d), reward)
    assert c2.matchmaker.snapshot() == unrestarted.snapshot()
    store.close()


def test_normaliser_mismatch_is_refused_not_reset(tmp_path: Path) -> None:
    """A z-score database is not silently restarted as a robust one (or the reverse, or
    with another window): the fingerprint names both settings."""
    clock = Clock()
    db = tmp_path / "cpm.db"
    store = SqliteCpmStore(db)
    _rewarded(
        CpmCore(
            CpmSettings(directive_ttl_s=60, init=True, reward_normaliser="zscore"), store, clock
        ),
        2,
    )
    with pytest.raises(ValueError, match=r"different bandit settings.*reward_normaliser"):
        CpmCore(_robust_settings(), store, clock)
    store.close()
    store = SqliteCpmStore(tmp_path / "robust.db")
    CpmCore(_robust_settings(init=True), store, clock)
    with pytest.raises(ValueError, match="different bandit settings"):
        CpmCore(CpmSettings(directive_ttl_s=60, reward_normaliser="zscore"), store, clock)
    with pytest.raises(ValueError, match='"reward_window": 16'):
        CpmCore(_robust_settings(reward_window=32), store, clock)
    store.close()
    # A matchmaker asked to restore the other kind's state says so (all-or-nothing).
    robust = CpmCore(_robust_settings(init=True), MemoryCpmStore(), clock).matchmaker
    zscore = CpmCore(
        CpmSettings(init=True, reward_normaliser="zscore"), MemoryCpmStore(), clock
    ).matchmaker
    with pytest.raises(ValueError, match="running z-score statistics"):
        robust.restore(zscore.snapshot())
    with pytest.raises(ValueError, match="reward window"):
        zscore.restore(robust.snapshot())


def test_a_z_score_snapshot_from_before_the_window_column_loads(tmp_path: Path) -> None:
    clock = Clock()
    db = tmp_path / "cpm.db"
    store = SqliteCpmStore(db)
    c = CpmCore(
        CpmSettings(directive_ttl_s=60, init=True, reward_normaliser="zscore"), store, clock
    )
    _rewarded(c, 3)
    assert c.write_snapshot()
    expected = c.matchmaker.snapshot()
    store.close()
    old = sqlite3.connect(db)  # the bandit table as databases before the window have it
    old.execute("ALTER TABLE bandit DROP COLUMN reward_window")
    old.commit()
    old.close()
    store = SqliteCpmStore(db)
    c2 = CpmCore(CpmSettings(directive_ttl_s=60, reward_normaliser="zscore"), store, clock)
    assert c2.bandit_recovery == "snapshot" and c2.rewards_replayed == 0
    assert c2.matchmaker.snapshot() == expected and expected.reward_window is None
    store.close()


def test_an_agent_that_closed_its_feed_is_not_paired(
    core: tuple[CpmCore, Clock, MemoryCpmStore],
) -> None:
    """A pending agent the hub lists as having closed its directive feed is left out of
    the round (``without_feed``); the others are paired among themselves."""
    c, _, _ = core
    _submit_all(c, ["a", "b", "c", "d"])
    match = c.matchmake(closed={"d"})
    named = {x for d in match.directives for x in (d.teacher, d.student)}
    assert "d" not in named and len(match.directives) == 1
    assert match.without_feed == ("d",) and match.candidates == 3


def test_the_hub_lists_an_agent_that_closed_its_feed_until_it_reopens() -> None:
    from peerlm.services.cpm.service import DirectiveHub

    hub = DirectiveHub(4)
    q = hub.attach("a")
    assert hub.closed() == frozenset()
    hub.detach("a", q)  # the agent ended its stream
    assert hub.closed() == {"a"}
    hub.attach("a")
    assert hub.closed() == frozenset()
    hub.detach("a", hub.attach("a"))
    hub.submitted("a")  # a profile after the close: it wants pairing (replay on connect)
    assert hub.closed() == frozenset()
