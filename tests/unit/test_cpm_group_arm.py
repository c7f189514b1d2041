"""A merge directive's senders scored as one LinUCB arm: ``co_sender_scoring="group"``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peerlm.bench.cpm_group_arm import run_group_arm
from peerlm.services.cpm import (
    MENU,
    MERGE_PROTOCOLS,
    Capabilities,
    ContextFeatures,
    CpmSettings,
    Matchmaker,
    Pairing,
)
from peerlm.services.cpm.core import CpmCore, settings_fingerprint
from peerlm.services.cpm.store import SqliteCpmStore

from tests.cli import assert_run_experiment_refuses
from tests.unit.test_cpm_merge_senders import Clock, _admissible, _federation, _submit


def _world(n: int = 8, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, Capabilities]]:
    rng = np.random.default_rng(seed)
    names = [f"a{k}" for k in range(n)]
    return (
        {a: rng.uniform(-1, 1, 32) for a in names},
        {a: Capabilities("ps", ("svd_hka",)) for a in names},
    )


def _group(m: Matchmaker, profiles: dict[str, np.ndarray], p: Pairing) -> np.ndarray:
    """The group context of ``p`` built by ContextFeatures.build_groups from its senders."""
    ids = sorted(profiles)
    mat = m.features.bound_profiles(np.stack([profiles[a] for a in ids]))
    trust = np.array([m.trust(a) for a in ids])
    members = np.array([[ids.index(a) for a in (p.sender, *p.co_senders)]], dtype=np.intp)
    combo = m.features.combo_index(p.protocol, p.role)
    n_roles = len(m.features.roles)
    return m.features.build_groups(
        mat,
        trust,
        members,
        np.array([ids.index(p.receiver)], dtype=np.intp),
        np.array([combo // n_roles], dtype=np.intp),
        np.array([combo % n_roles], dtype=np.intp),
    )[0]


@settings(max_examples=40, deadline=None)
@given(
    g=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    interaction=st.booleans(),
    trust=st.booleans(),
)
def test_group_contexts_depend_on_the_set_of_senders_only(
    g: int, seed: int, interaction: bool, trust: bool
) -> None:
    """Any order of the same members gives the same context bit for bit; a group of one
    is build's pair context bit for bit; the sender block is the members' mean profile,
    trust_s their mean trust, and the interaction blocks are those of that mean."""
    rng = np.random.default_rng(seed)
    feats = ContextFeatures(6, ("akd", "svd_hka"), interaction=interaction, trust=trust)
    n = 10
    mat = rng.uniform(-1, 1, (n, 6))
    tr = rng.uniform(0, 1, n) if trust else None
    members = np.stack([rng.choice(n, g, replace=False) for _ in range(5)]).astype(np.intp)
    shuffled = rng.permuted(members, axis=1)
    receivers = rng.integers(0, n, 5).astype(np.intp)
    proto = rng.integers(0, 2, 5).astype(np.intp)
    role = np.zeros(5, dtype=np.intp)
    x = feats.build_groups(mat, tr, members, receivers, proto, role)
    assert np.array_equal(x, feats.build_groups(mat, tr, shuffled, receivers, proto, role))
    lay = feats.layout
    mean = mat[members].mean(axis=1)
    np.testing.assert_allclose(x[:, lay.sender], mean, rtol=0, atol=1e-15)
    if lay.absdiff is not None and lay.product is not None:
        pr = mat[receivers]
        np.testing.assert_allclose(x[:, lay.absdiff], np.abs(mean - pr), rtol=0, atol=1e-15)
        np.testing.assert_allclose(x[:, lay.product], mean * pr, rtol=0, atol=1e-15)
    if tr is not None and lay.trust_sender is not None:
        np.testing.assert_allclose(x[:, lay.trust_sender], tr[members].mean(axis=1), atol=1e-15)
    one = members[:, :1]
    assert np.array_equal(
        feats.build_groups(mat, tr, one, receivers, proto, role),
        feats.build(mat, tr, one[:, 0], receivers, proto, role),
    )


def test_pair_scoring_is_the_default_and_unchanged() -> None:
    """``"pair"`` is the default everywhere and selects, learns and fingerprints exactly
    as without the setting; so does ``"group"`` with one sender per merge."""
    assert CpmSettings().co_sender_scoring == "pair"
    assert "co_sender_scoring" not in settings_fingerprint(CpmSettings(merge_senders=3))
    profiles, caps = _world(10, seed=3)
    for k, scoring in ((3, "pair"), (1, "group")):
        default = Matchmaker(32, seed=2, protocols=("akd", "svd_hka"), merge_senders=k)
        other = Matchmaker(
            32, seed=2, protocols=("akd", "svd_hka"), merge_senders=k, co_sender_scoring=scoring
        )
        rng = np.random.default_rng(k)
        for _ in range(4):
            a, b = default.select(profiles, caps), other.select(profiles, caps)
            assert a == b
            for p, q in zip(a, b, strict=True):
                r = float(rng.normal())
                default.observe(p, r)
                other.observe(q, r)
        assert default.snapshot() == other.snapshot()


@settings(max_examples=50, deadline=None)
@given(
    caps=_federation(),
    k=st.integers(2, 5),
    matching=st.sampled_from(["greedy", "blossom"]),
    seed=st.integers(0, 2**16),
)
def test_group_co_senders_are_admissible_distinct_and_at_most_k_minus_one(
    caps: dict[str, Capabilities], k: int, matching: Literal["greedy", "blossom"], seed: int
) -> None:
    """Under "group" the same rules hold as under "pair" (admissible for the directive's
    protocol, on the student's overlay list, never the student or the teacher, never
    repeated, at most k - 1, merges only); the walk's (teacher, student, protocol, role)
    are those of merge_senders=1, and a merge directive's stored context is its group's."""
    rng = np.random.default_rng(seed)
    grp = Matchmaker(
        32, seed=seed, protocols=MENU, matching=matching, merge_senders=k, co_sender_scoring="group"
    )
    one = Matchmaker(32, seed=seed, protocols=MENU, matching=matching)
    for _ in range(3):
        profiles = {a: rng.uniform(-1, 1, 32) for a in caps}
        one.restore(grp.snapshot())  # the same learnt state: the walk must be the same
        pairings = grp.select(profiles, caps)
        plain = one.select(profiles, caps)
        key = [(p.sender, p.receiver, p.protocol, p.role) for p in pairings]
        assert key == [(p.sender, p.receiver, p.protocol, p.role) for p in plain]
        for p, q in zip(pairings, plain, strict=True):
            co = p.co_senders
            assert len(co) <= k - 1 and len(set(co)) == len(co)
            assert p.sender not in co and p.receiver not in co
            if p.protocol not in MERGE_PROTOCOLS or not co:
                assert co == () and p == q
            for c in co:
                assert _admissible(c, p.receiver, p.protocol, caps), (c, p)
            if co:
                assert np.array_equal(p.context, _group(grp, profiles, p))
        for p in pairings:
            grp.observe(p, 1.0 if p.protocol in MERGE_PROTOCOLS else -1.0)


def _reference_greedy(m: Matchmaker, profiles: dict[str, np.ndarray], p: Pairing) -> list[str]:
    """The greedy by group UCB written out per candidate: contexts from ContextFeatures.single
    on the members' mean bounded profile and mean trust, scored in float64."""
    feats = m.features
    bounded = {a: feats.bound_profiles(v[None, :])[0] for a, v in profiles.items()}
    state = m.snapshot()
    group = [p.sender]
    pool = sorted(a for a in profiles if a not in (p.sender, p.receiver))
    for _ in range(len(p.co_senders)):
        ucbs = []
        for c in pool:
            members = [*group, c]
            x = feats.single(
                np.mean([bounded[a] for a in members], axis=0),
                bounded[p.receiver],
                p.protocol,
                p.role,
                float(np.mean([m.trust(a) for a in members])),
                m.trust(p.receiver),
            )
            ucbs.append(x @ m.theta + np.sqrt(max(x @ state.a_inv @ x, 0.0)))
        best = pool[int(np.argmax(ucbs))]
        group.append(best)
        pool.remove(best)
    return group[1:]


def test_group_co_senders_are_the_greedy_best_by_group_ucb() -> None:
    """Each co-sender is the candidate whose addition gives the highest group UCB (checked
    against a per-candidate reference on contexts built one by one), the stored ucb and
    mean are the group context's, and the group always fills K - 1."""
    profiles, caps = _world()
    m = Matchmaker(32, seed=1, protocols=("svd_hka",), merge_senders=4, co_sender_scoring="group")
    rng = np.random.default_rng(5)
    for _ in range(5):
        for p in m.select(profiles, caps):
            m.observe(p, float(rng.normal()))
    pairings = m.select(profiles, caps)
    assert pairings and all(len(p.co_senders) == 3 for p in pairings)
    state = m.snapshot()
    for p in pairings:
        assert list(p.co_senders) == _reference_greedy(m, profiles, p)
        x = p.context
        assert p.mean == pytest.approx(float(x @ m.theta), abs=1e-9)
        assert p.ucb == pytest.approx(p.mean + float(np.sqrt(x @ state.a_inv @ x)), abs=1e-9)


def test_a_fresh_bandit_still_forms_full_groups() -> None:
    """Before any reward the mean profile's shorter context has a lower bonus than the
    teacher's pair context, so a rule that stopped when an addition lowers the UCB would
    never form a group; the greedy fills K - 1 anyway (docs/matchmaker.md)."""
    profiles, caps = _world()
    pair = Matchmaker(32, seed=4, protocols=("svd_hka",))
    grp = Matchmaker(32, seed=4, protocols=("svd_hka",), merge_senders=3, co_sender_scoring="group")
    singles, groups = pair.select(profiles, caps), grp.select(profiles, caps)
    assert all(len(g.co_senders) == 2 for g in groups)
    assert any(g.ucb < s.ucb for s, g in zip(singles, groups, strict=True))


def test_the_group_reward_updates_exactly_the_stored_group_context() -> None:
    """One reward, one update, on the group context the directive stored (not the
    teacher's pair context); the teacher's trust only."""
    profiles, caps = _world()
    m = Matchmaker(32, seed=0, protocols=("svd_hka",), merge_senders=3, co_sender_scoring="group")
    ref = Matchmaker(32, seed=0, protocols=("svd_hka",), merge_senders=3)
    pair = Matchmaker(32, seed=0, protocols=("svd_hka",), merge_senders=3)
    [p, *_] = m.select(profiles, caps)
    [q, *_] = pair.select(profiles, caps)
    assert p.co_senders and (p.sender, p.receiver) == (q.sender, q.receiver)
    assert not np.array_equal(p.context, q.context)
    m.observe(p, 0.7)
    ref.observe(Pairing(p.sender, p.receiver, p.protocol, p.role, p.context, 0.0, 0.0), 0.7)
    assert m.snapshot() == ref.snapshot() and m.n_updates == 1
    assert m.snapshot().trust == {p.sender: (1, 1)}
    pair.observe(q, 0.7)
    assert m.snapshot() != pair.snapshot()


def test_the_core_stores_and_replays_group_contexts(tmp_path: Path) -> None:
    """The ledger holds each directive's group context, and the ledger replay after a
    restart (no snapshot) reproduces the bandit bit for bit."""
    db = tmp_path / "cpm.db"
    names = ["a", "b", "c", "d", "e", "f"]
    s = CpmSettings(
        init=True,
        db=db,
        protocols=("svd_hka",),
        merge_senders=3,
        co_sender_scoring="group",
        directive_ttl_s=60,
        snapshot_every=1000,
    )
    store = SqliteCpmStore(db)
    c = CpmCore(s, store, Clock())
    _submit(c, names)
    directives = c.matchmake().directives
    assert len(directives) == 3 and all(len(d.co_senders) == 2 for d in directives)
    feats = c.matchmaker.features
    for d in directives:
        # The sender block is the mean of the three senders' profiles.
        sent = [names.index(n) for n in (d.teacher, *(n for n, _ in d.co_senders))]
        mean = np.mean([np.random.default_rng(k).uniform(0, 1, 32) for k in sent], axis=0)
        np.testing.assert_allclose(d.context[feats.layout.sender], mean, atol=1e-12)
    for d in directives[:2]:
        c.report_reward(d.student, d.directive_id, 0.4 if d is directives[0] else -0.2)
    expected = c.matchmaker.snapshot()
    store.close()
    store = SqliteCpmStore(db)
    again = CpmCore(replace_init(s), store, Clock())
    assert again.rewards_replayed == 2 and again.matchmaker.snapshot() == expected
    store.close()


def replace_init(s: CpmSettings) -> CpmSettings:
    return s.model_copy(update={"init": False})


def test_a_database_made_under_one_scoring_is_refused_under_the_other(tmp_path: Path) -> None:
    db = tmp_path / "cpm.db"
    grp = CpmSettings(
        init=True, db=db, protocols=("svd_hka",), merge_senders=3, co_sender_scoring="group"
    )
    assert '"co_sender_scoring": "group"' in settings_fingerprint(grp)
    store = SqliteCpmStore(db)
    CpmCore(grp, store, Clock())
    store.close()
    store = SqliteCpmStore(db)
    with pytest.raises(ValueError, match="different bandit settings"):
        CpmCore(CpmSettings(db=db, protocols=("svd_hka",), merge_senders=3), store, Clock())
    store.close()
    store = SqliteCpmStore(db)
    CpmCore(replace_init(grp), store, Clock())
    store.close()
    # And the other way round: a "pair" database refuses "group".
    db2 = tmp_path / "pair.db"
    store = SqliteCpmStore(db2)
    CpmCore(CpmSettings(init=True, db=db2, protocols=("svd_hka",), merge_senders=3), store, Clock())
    store.close()
    store = SqliteCpmStore(db2)
    with pytest.raises(ValueError, match="different bandit settings"):
        CpmCore(grp.model_copy(update={"db": db2, "init": False}), store, Clock())
    store.close()


def test_bad_co_sender_scoring_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="co_sender_scoring"):
        Matchmaker(32, co_sender_scoring="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="co_sender_scoring"):
        CpmSettings(co_sender_scoring="best")  # type: ignore[arg-type]
    monkeypatch.setenv("PEERLM_CPM_CO_SENDER_SCORING", "group")
    assert CpmSettings().co_sender_scoring == "group"


def test_the_experiment_plan_carries_the_scoring_to_its_cpm() -> None:
    from peerlm.app.experiment import ExperimentPlan

    plan = ExperimentPlan(cpm_merge_senders=3, cpm_co_sender_scoring="group")
    assert plan.cpm_settings(protocols=("svd_hka",)).co_sender_scoring == "group"
    assert ExperimentPlan().cpm_settings().co_sender_scoring == "pair"


def test_group_scoring_learns_a_complementary_group_that_pair_scoring_misses() -> None:
    """bench/cpm_group_arm.py's "mix" world (students need both skills; the value of a
    two-sender merge is 1 with one sender of each skill, else 0): over the second half of
    40 rounds "group" picks the complementary co-sender in nearly every directive;
    "pair" ranks each co-sender alone and gets clearly less on average (per seed, seeds
    0-5: group 1.0, 1.0, 1.0, 1.0, 0.925, 1.0; pair 0.9, 0.81, 0.99, 0.86, 0.78, 0.7)."""
    late = slice(20, 40)
    grp = [np.mean(run_group_arm("mix", "group", s, rounds=40).values[late]) for s in range(6)]
    pair = [np.mean(run_group_arm("mix", "pair", s, rounds=40).values[late]) for s in range(6)]
    assert np.mean(grp) >= 0.95
    assert np.mean(pair) <= np.mean(grp) - 0.1


def test_the_bench_command_reports_both_scorings_per_scenario() -> None:
    import json

    from peerlm.bench.cli import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["cpm-group-arm", "--seeds", "2", "--rounds", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for scenario in ("mix", "diversity"):
        values = report["scenarios"][scenario]["values"]
        assert set(values["per_seed"]) == {"pair", "group"}
        assert all(len(v) == 2 for v in values["per_seed"].values())
        low, high = values["group_minus_pair"]["ci95"]
        assert low <= values["group_minus_pair"]["mean"] <= high


@pytest.mark.parametrize(
    "flags",
    [
        ["--co-sender-scoring", "best"],
        ["--co-sender-scoring", "group"],  # no co-senders to score without --merge-senders
        ["--merge-senders", "1", "--co-sender-scoring", "group"],
    ],
)
def test_run_experiment_refuses_a_bad_co_sender_scoring(tmp_path: Path, flags: list[str]) -> None:
    """Refused before anything runs (exit 2, nothing written)."""
    assert_run_experiment_refuses(tmp_path / "out", flags, "co-sender-scoring")


def test_large_rounds_grow_groups_among_the_prefiltered_partners() -> None:
    """From prefilter_min_agents on (N = 150) the group greedy runs over each student's
    candidate partners of the round: still admissible, distinct, at most K - 1, the stored
    context the group's, and K - 1 reached where the candidates allow it."""
    rng = np.random.default_rng(11)
    names = [f"a{k:03d}" for k in range(150)]
    caps = {
        n: Capabilities(
            "ps-a" if k % 5 else "ps-b",
            ("akd", "svd_hka"),
            frozenset(names[(k + 1) % 150 : (k + 1) % 150 + 6]) if k % 3 == 0 else None,
        )
        for k, n in enumerate(names)
    }
    m = Matchmaker(
        32,
        seed=3,
        protocols=("akd", "svd_hka"),
        merge_senders=4,
        beta=0.1,
        co_sender_scoring="group",
    )
    filled = 0
    for _ in range(3):
        profiles = {n: rng.uniform(-1, 1, 32) for n in names}
        pairings = m.select(profiles, caps)
        for p in pairings:
            co = p.co_senders
            assert len(co) <= 3 and len(set(co)) == len(co)
            assert p.sender not in co and p.receiver not in co
            for c in co:
                assert p.protocol == "svd_hka" and _admissible(c, p.receiver, p.protocol, caps)
            if co:
                assert np.array_equal(p.context, _group(m, profiles, p))
            filled += len(co) == 3
        for p in pairings:
            m.observe(p, 1.0 if p.protocol == "svd_hka" else -1.0)
    assert filled > 0
